"""Hangs with a process tree: a child that ignores SIGTERM, and a child whose own child
left the process group (its own session); once all exist, writes their pids to argv[1]."""

import os
import subprocess
import sys
import time

ignores_term = subprocess.Popen([sys.executable, "-c",
                                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(1000)"])
parent = subprocess.Popen([sys.executable, "-c",
                           "import subprocess, sys, time\n"
                           "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)'], "
                           "start_new_session=True)\n"
                           "print(p.pid, flush=True)\n"
                           "time.sleep(1000)\n"], stdout=subprocess.PIPE)
grandchild = int(parent.stdout.readline())
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(" ".join(map(str, [os.getpid(), ignores_term.pid, parent.pid, grandchild])))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(1000)

"""Scores a bundle of tasks in one sandbox exec (the evaluator's wrapper program).

Runs in the sandbox under ``python3 -I -S`` (standard library only). argv: root, n,
parallel, timeout, checker file, checker stdout file, tail length. Runs the batch
driver (``driver.py``, fleetrl.actors.recipe's checker driver) over the directories
``root/0 .. root/n-1`` and prints one JSON line: ``[[status, stdout_tail], ...]`` in
task order, or ``{"error": ...}`` (exit 3) when the driver itself failed.
"""

import json
import os
import subprocess
import sys


def main():
    root, n, parallel, timeout, check = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    stdout_file, tail = sys.argv[6], int(sys.argv[7])
    here = os.getcwd()
    dirs = [os.path.join(here, root, str(i)) for i in range(n)]
    done = subprocess.run([sys.executable, "-I", "-S", os.path.join(here, "driver.py"), parallel, timeout, check],
                          input="\n".join(dirs) + "\n", capture_output=True, text=True)
    if done.returncode != 0:
        print(json.dumps({"error": "driver exited %d: %s" % (done.returncode, done.stderr[-2000:])}))
        sys.exit(3)
    status = {}
    for line in done.stdout.splitlines():
        if line.strip():
            i, s = line.split()
            status[int(i)] = int(s)
    out = []
    for i, d in enumerate(dirs):
        try:
            with open(os.path.join(d, stdout_file), encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError:
            text = ""
        out.append([status.get(i), text[-tail:]])
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Runs many task checkers in one sandbox exec (fleetrl's held-out evaluation driver).

Standard library only; runs under ``python3 -I -S`` inside the sandbox, like the
checkers. argv: parallelism, timeout seconds, the checker file name in each directory.
stdin: one directory per line. stdout: one "index exit_status" line per directory
(exit_status -9: killed at its timeout). Each checker runs in a forked child, in its
own process group, with its stdout in ``.checker-stdout`` of its directory.
"""

import os, sys, time, traceback

def run_checker(directory):
    os.chdir(directory)
    fd = os.open(".checker-stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(null, 2)
    code = 0
    try:
        with open(CHECK, encoding="utf-8") as fh:
            source = fh.read()
        exec(compile(source, CHECK, "exec"), {"__name__": "__main__", "__file__": CHECK})
    except SystemExit as stop:
        c = stop.code
        code = 0 if c is None else (c if isinstance(c, int) else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
    except BaseException:
        code = code or 120
    os._exit(code & 0xFF)

def main():
    parallel, timeout = int(sys.argv[1]), float(sys.argv[2])
    dirs = [line for line in sys.stdin.read().splitlines() if line]
    status = [None] * len(dirs)
    running = {}
    nxt = 0
    while nxt < len(dirs) or running:
        while nxt < len(dirs) and len(running) < parallel:
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                try:
                    os.setpgid(0, 0)  # its own group: a kill reaches the test processes it forks
                    run_checker(dirs[nxt])
                finally:
                    os._exit(121)
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass
            running[pid] = (nxt, time.monotonic() + timeout)
            nxt += 1
        pid, wstatus = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            for p, (i, deadline) in list(running.items()):
                if now > deadline:
                    try:
                        os.killpg(p, 9)
                    except OSError:
                        pass
                    os.waitpid(p, 0)
                    del running[p]
                    status[i] = -9
            time.sleep(0.0005)
            continue
        i, _ = running.pop(pid)
        status[i] = os.waitstatus_to_exitcode(wstatus)
        try:
            os.killpg(pid, 9)  # stray test processes the checker left behind
        except OSError:
            pass
    for i, s in enumerate(status):
        print(i, s)

if __name__ == "__main__":
    CHECK = sys.argv[3]
    main()

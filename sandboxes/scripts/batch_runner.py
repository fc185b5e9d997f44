"""In-container runner of ``Sandbox.exec_many``: independent programs, one after another,
in one ``docker exec``. Standalone (Python 3 standard library only): the host passes this
file's source as ``python3 -I -S -c SOURCE``; it never imports fleetrl.

For each program it first resets the sandbox (every other process of the user killed,
the writable dirs wiped, checked), writes the program's files, then runs it in its own
session and process group with its own stdin, env, work dir, wall-clock timeout and
output caps, exactly as one ``docker exec`` would (stdin ``/dev/null`` when none is
given). On timeout or past the output limit every other process of the user is killed.

It protects its own report: it makes itself non-dumpable (``PR_SET_DUMPABLE`` 0), so
processes of the same uid can neither ptrace it nor open ``/proc/<pid>/fd``, ``mem`` or
``environ``; the programs get fresh pipes and none of its descriptors. A program can
still kill or stop it; then its report is cut short, the exit status the engine sees is
not 0, and the host reruns the programs without a complete record one exec each.

Protocol (``batch.py`` on the host is the other side):
  stdin:  one JSON header line, then the payload bytes: each program's files in order,
          then its stdin.
  stdout: per program ``R <json>\\n`` + its kept stdout + its kept stderr, or
          ``S <json>\\n`` when it could not be started (the host runs it itself);
          last ``E <json>\\n``. Exit status 0 only after a complete ``E`` record.
"""

import json
import os
import selectors
import signal
import subprocess
import sys
import time

KILL_ROUNDS = 50
KILL_PAUSE_S = 0.02
DRAIN_AFTER_KILL_S = 10.0
CHUNK = 1 << 16
SYNC_SIGNALS = {"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS"}
DEFAULT_IGNORED = {"SIGCHLD", "SIGCONT", "SIGWINCH", "SIGURG", "SIGKILL", "SIGSTOP", "SIGPIPE"}


class ResetFailed(Exception):
    """The sandbox could not be brought back to a clean state; the batch stops. This
    program's own error, not one of fleetrl.sandboxes (``SandboxError``): it runs
    inside the container, where nothing of ours is installed."""


def protect():
    """Not dumpable (no ptrace, no /proc/<pid>/fd|mem|environ for other processes of
    this uid); catch the signals a program could use to end us early (a handler, not
    SIG_IGN, so nothing is inherited by the programs: handlers reset on exec)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE = 4
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    for name in dir(signal):
        if not name.startswith("SIG") or name.startswith("SIG_") or name in SYNC_SIGNALS | DEFAULT_IGNORED:
            continue
        try:
            signal.signal(getattr(signal, name), lambda *_: None)
        except (OSError, ValueError, RuntimeError, TypeError):
            pass


def others():
    """Pids of processes other than PID 1, us, and our own unreaped zombies."""
    me = os.getpid()
    alive = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        if pid in (1, me):
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # gone
        fields = stat[stat.rfind(b")") + 2 :].split()
        if fields and fields[0] == b"Z" and int(fields[1]) == me:
            continue  # our child, dead, waiting to be reaped
        alive.append(pid)
    return alive


def kill_others():
    """SIGKILL every process of this user but PID 1 (namespace init, immune) and us,
    until none is left. False if some survive."""
    for _ in range(KILL_ROUNDS):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if not others():
            return True
        time.sleep(KILL_PAUSE_S)
    return False


def wipe(dirs):
    for d in dirs:
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            continue
        for n in names:
            p = os.path.join(d, n)
            if os.path.isdir(p) and not os.path.islink(p):
                import shutil  # only when there is a tree to remove (its import costs)

                shutil.rmtree(p, onerror=_unlock)
            else:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
    for d in dirs:
        try:
            left = os.listdir(d)
        except FileNotFoundError:
            continue
        if left:
            raise ResetFailed(f"not wiped: {d}/{left[0]}")


def _unlock(func, path, _exc):
    """rmtree error handler: a program may have removed write/search permission."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        func(path)
    except FileNotFoundError:
        pass


def remove_sysv_ipc():
    """Remove the SysV shared memory, semaphores and message queues this user can
    (they live in the container's IPC namespace and survive a wiped /dev/shm)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    rm = {"shm": lambda i: libc.shmctl(i, 0, None), "sem": lambda i: libc.semctl(i, 0, 0), "msg": lambda i: libc.msgctl(i, 0, None)}
    for kind, fn in rm.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 1 and cols[1].isdigit():
                fn(int(cols[1]))  # IPC_RMID; failures (not ours) are left alone


def reset(dirs):
    if not kill_others():
        raise ResetFailed(f"processes survive: {len(others())}")
    remove_sysv_ipc()
    wipe(dirs)


def oom_count():
    for path in ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events"):
        try:
            with open(path) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == "oom_kill" and parts[1].isdigit():
                        return int(parts[1])
        except OSError:
            continue
    return 0


def write_files(files):
    for path, data in files:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)


def initial_environ():
    """The environment this process was started with (what ``docker exec`` gives), read
    from the kernel's copy: Python may have added to ``os.environ`` at startup (PEP 538
    locale coercion sets LC_CTYPE when the locale is C)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environb)
    env = {}
    for item in raw.split(b"\0"):
        k, eq, v = item.partition(b"=")
        if eq and k:
            env.setdefault(k, v)
    return env


BASE_ENV = {}


def run(prog, stdin, caps):
    """Run one program to its end, timeout or output limit; its record (a dict with the
    kept output as bytes under 'out'/'err'), or None when it could not be started."""
    out_cap, err_cap, limit = caps
    env = dict(BASE_ENV)
    env.update((k.encode(), v.encode()) for k, v in (prog["env"] or {}).items())
    before = oom_count()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            prog["argv"],
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=prog["cwd"],
            env=env,
            start_new_session=True,
            close_fds=True,
        )
    except OSError:
        return None
    sel = selectors.DefaultSelector()
    kept = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    capof = {proc.stdout.fileno(): out_cap, proc.stderr.fileno(): err_cap}
    total = dict.fromkeys(kept, 0)
    for fd in kept:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = None
    if stdin is not None:
        wfd = proc.stdin.fileno()
        os.set_blocking(wfd, False)
        pending = memoryview(stdin)
        if pending:
            sel.register(wfd, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    timed_out = over = killed = False
    deadline = t0 + prog["timeout"]

    def kill():
        nonlocal killed, deadline
        killed = True
        deadline = time.monotonic() + DRAIN_AFTER_KILL_S
        if not kill_others():
            raise ResetFailed("processes survive a kill")

    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            if killed:
                raise ResetFailed("output streams still open after every process was killed")
            timed_out = True
            kill()
            continue
        for key, _ in sel.select(left):
            fd = key.fd
            if fd in kept:
                try:
                    data = os.read(fd, CHUNK)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(fd)
                    continue
                total[fd] += len(data)
                room = capof[fd] - len(kept[fd])
                if room > 0:
                    kept[fd] += data[:room]
                if not killed and sum(total.values()) > limit:
                    over = True
                    kill()
            else:
                try:
                    n = os.write(fd, pending[:CHUNK])
                except BlockingIOError:
                    continue
                except OSError:  # the program exited or closed its stdin
                    n = len(pending)
                pending = pending[n:]
                if not pending:
                    sel.unregister(fd)
                    proc.stdin.close()
    sel.close()
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        if killed:
            raise ResetFailed("a killed program did not exit")
        timed_out = True
        kill()
        try:
            proc.wait(timeout=DRAIN_AFTER_KILL_S)
        except subprocess.TimeoutExpired:
            raise ResetFailed("a killed program did not exit") from None
    duration = time.monotonic() - t0
    proc.stdout.close()
    proc.stderr.close()
    code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
    after = oom_count()
    o, e = list(kept.values())
    ot, et = list(total.values())
    return {
        "exit_code": code,
        "timed_out": timed_out,
        "over_limit": over,
        "oom": code == 137 and not timed_out and after > before,
        "oom_count": after,
        "duration": duration,
        "out_total": ot,
        "err_total": et,
        "out": bytes(o),
        "err": bytes(e),
    }


def emit(out, tag, head, *blobs):
    out.write(tag + b" " + json.dumps(head, separators=(",", ":")).encode() + b"\n")
    for b in blobs:
        out.write(b)
    out.flush()


def in_sandbox(keeper):
    """Only where PID 1 is the sandbox's keeper and we are not root: ``kill(-1)``
    anywhere else (say, on a host by mistake) would kill far too much."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            argv = f.read().split(b"\0")[:-1]
    except OSError:
        return False
    return os.getuid() != 0 and argv == [a.encode() for a in keeper]


def main():
    BASE_ENV.update(initial_environ())
    protect()
    raw = sys.stdin.buffer.read()
    nl = raw.index(b"\n")
    header = json.loads(raw[:nl])
    payload = memoryview(raw)[nl + 1 :]
    if not in_sandbox(header["keeper"]):
        print("fleetrl batch runner: not inside a fleetrl sandbox (PID 1 is not the keeper, or uid 0); refusing", file=sys.stderr)
        return 4
    dirs = header["dirs"]
    caps = (header["stdout_cap"], header["stderr_cap"], header["output_limit"])
    out = sys.stdout.buffer
    pos = 0
    for i, prog in enumerate(header["programs"]):
        files = []
        for path, n in prog["files"]:
            files.append((path, payload[pos : pos + n]))
            pos += n
        stdin = None
        if prog["stdin"] is not None:
            stdin = payload[pos : pos + prog["stdin"]]
            pos += prog["stdin"]
        try:
            reset(dirs)
        except (ResetFailed, OSError) as e:
            emit(out, b"E", {"reset": 1, "error": f"reset before program {i}: {e}", "oom_count": oom_count()})
            return 3
        try:
            write_files(files)
        except OSError:
            emit(out, b"S", {"i": i})
            continue
        try:
            rec = run(prog, stdin, caps)
        except ResetFailed as e:
            emit(out, b"E", {"reset": 1, "error": f"program {i}: {e}", "oom_count": oom_count()})
            return 3
        if rec is None:
            emit(out, b"S", {"i": i})
            continue
        o, e = rec.pop("out"), rec.pop("err")
        rec.update(i=i, out_len=len(o), err_len=len(e))
        emit(out, b"R", rec, o, e)
    status, error = None, ""
    if header["final"]:
        try:
            reset(dirs)
            status = 0
        except (ResetFailed, OSError) as e:
            status, error = 1, str(e)
    emit(out, b"E", {"reset": status, "error": error, "oom_count": oom_count()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

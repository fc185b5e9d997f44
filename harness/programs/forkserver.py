"""A preloading fork server for Python harness programs (stdlib only; run by fleetrl).

    python -c SOURCE SOCKET_PATH MODULE[,MODULE...]

It imports the given modules once, then listens on the Unix socket SOCKET_PATH
(``SOCK_SEQPACKET``: one message is one JSON object). Each connection asks for one run:
a JSON object (``argv``: ``[script, args...]`` or ``["-m",
module, args...]``; ``env``; ``cwd``) sent with three file descriptors (stdin, stdout,
stderr) as ``SCM_RIGHTS``. The server forks; the child starts a session of its own,
takes the descriptors as 0, 1 and 2, the working directory, the environment and
``sys.argv``, and runs the program as ``__main__`` (``runpy``), so a program that imports
what was preloaded starts without paying for the import again. The server answers
``{"pid": N}`` at once and ``{"exit": CODE}`` when the child has exited (CODE < 0: killed
by signal -CODE), one message each, then closes the connection; a request it cannot run
gets ``{"error": WHY}``.

Its stdout carries one line, ``ready``, once the modules are imported (or an error line
and exit status 3 when a module fails to import or leaves threads running: a fork copies
only the forking thread). It exits when its stdin reaches end of file (the daemon is
gone); the children it started live on in their own sessions, for the daemon's process
tree cleanup to find.
"""

import array
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import traceback

MAX_REQUEST = 1 << 20


def _run_child(request):
    argv = request["argv"]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:
        if done.code is None:
            code = 0
        elif isinstance(done.code, int):
            code = done.code
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code & 0xFF)


def _fork(conn, listener, running, request, fds):
    pid = os.fork()
    if pid == 0:
        try:
            listener.close()
            conn.close()
            for other in running.values():
                other.close()
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            for fd in fds:
                if fd > 2:
                    os.close(fd)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
                signal.signal(sig, signal.SIG_DFL)
        except BaseException:
            traceback.print_exc()
            os._exit(127)
        _run_child(request)
    for fd in fds:
        os.close(fd)
    return pid


def _read_request(conn):
    data, ancdata, flags, _addr = conn.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(3 * 4))
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a run request is one message of at most {MAX_REQUEST} bytes with 3 file "
                         f"descriptors, got {len(fds)} descriptors (flags {flags:#x})")
    request = json.loads(data.decode())
    argv = request.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv) or argv == ["-m"]:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"argv must be [script, ...] or ['-m', module, ...], got {argv!r}")
    return request, list(fds)


def _send(conn, obj):
    try:
        conn.send(json.dumps(obj).encode())
    except OSError:
        pass  # the daemon gave the run up: nothing to tell


def main():
    path, modules = sys.argv[1], [m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else []
    try:
        for name in modules:
            importlib.import_module(name)
    except BaseException as err:
        print(f"error: preloading {name!r} failed: {type(err).__name__}: {err}", flush=True)
        return 3
    if threading.active_count() > 1:
        names = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        print(f"error: the preloaded modules left threads running ({', '.join(names)}); a fork would copy "
              "only this one", flush=True)
        return 3
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(128)
    print("ready", flush=True)
    running = {}  # pid -> the connection that asked for it
    stdin = sys.stdin.fileno()
    while True:
        readable, _, _ = select.select([listener, stdin], [], [], 0.05)
        if stdin in readable and not os.read(stdin, 4096):
            return 0
        if listener in readable:
            conn, _ = listener.accept()
            try:
                request, fds = _read_request(conn)
            except (ValueError, OSError, UnicodeDecodeError) as err:
                _send(conn, {"error": str(err)})
                conn.close()
            else:
                pid = _fork(conn, listener, running, request, fds)
                running[pid] = conn
                _send(conn, {"pid": pid})
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                code = os.waitstatus_to_exitcode(status)
                _send(conn, {"exit": code})
                conn.close()


if __name__ == "__main__":
    sys.exit(main())

"""Python harness programs started from a preloading fork server (`ExternalCommand.preload`).

A Python harness pays for its imports on every attempt: the official ``openai`` client
costs about 1.5 s of CPU, litellm (mini-swe-agent) several seconds, more than the
attempt's own work on a small task. `ForkServer` runs ``harness/programs/forkserver.py``
under the harness's own interpreter, once: it imports the ``preload`` modules, then
forks a child per attempt that runs the program as ``__main__`` in a session of its own,
with the attempt's environment, working directory and our pipes as its stdin, stdout and
stderr. The child is an ordinary process of its own session: `processes.run_command`
waits for it, keeps its output tails and kills its tree on timeout exactly as for a
process it started itself (`ForkedProcess` stands in for `trio.Process`).

What differs from a fresh interpreter, on purpose: modules imported by the preload ran
their import-time code once, in the server, with the server's environment (the command's
``env`` and inherited variables, not an attempt's ``OPENAI_*``/``FLEETRL_*``: clients read
those when they are built, not when imported); ``random`` is reseeded in every child by
Python itself, other generators seeded at import (numpy's global one) are not. A preload
that leaves threads running is refused (a fork copies only the forking thread).

The server lives until `ForkServer.aclose` (the harness's ``aclose``), or until its
stdin reaches end of file (the daemon is gone). If it dies, the next attempt starts a
new one; an attempt whose server died under it is a failed attempt (the child's tree is
killed), never a reward.
"""

from __future__ import annotations

import array
import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Mapping, Sequence

import trio

from .errors import ForkServerFailed
from .program_files import program_text

__all__ = ["ForkServer", "ForkServerFailed", "ForkedProcess", "check_preload_argv"]

MAX_REQUEST = 1 << 20
"""Bytes of one run request (argv, environment, working directory as JSON)."""


def check_preload_argv(argv: Sequence[str]) -> None:
    """A command the fork server can run is ``[python, script, args...]`` or ``[python,
    -m, module, args...]``; anything else (an interpreter option, no script) is a
    `ValueError` naming what to write instead."""
    if len(argv) < 2 or (argv[1] == "-m" and len(argv) < 3):
        raise ValueError(f"preload needs argv = [python, script.py, ...] or [python, -m, module, ...], "
                         f"got {list(argv)!r}")
    if argv[1].startswith("-") and argv[1] != "-m":
        raise ValueError(f"preload runs a script or a module (-m), not interpreter options: argv[1] is {argv[1]!r}")


class ForkedProcess:
    """A child of the fork server as `processes.run_command` sees a process: its ``pid``
    (the leader of its own session), ``returncode`` once it has exited, ``wait``."""

    def __init__(self, pid: int, conn: trio.socket.SocketType) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn

    async def wait(self) -> int:
        if self.returncode is None:
            data = await self._conn.recv(65536)
            if not data:
                raise ForkServerFailed(f"the fork server died while its child {self.pid} ran")
            self.returncode = int(json.loads(data)["exit"])
            self._conn.close()
        return self.returncode

    def close(self) -> None:
        self._conn.close()


class ForkServer:
    """One preloading fork server: ``python`` (the harness's interpreter) with the
    ``preload`` modules imported, under environment ``env`` (module docstring)."""

    def __init__(self, python: str, preload: Sequence[str], env: Mapping[str, str], *,
                 start_timeout_s: float = 120.0) -> None:
        self.python = python
        self.preload = tuple(preload)
        self.env = dict(env)
        self.start_timeout_s = start_timeout_s
        self.starts = 0
        self._proc: trio.Process | None = None
        self._dir: str | None = None
        self._lock = trio.Lock()

    @property
    def socket_path(self) -> str:
        assert self._dir is not None
        return os.path.join(self._dir, "s")

    async def _start(self) -> None:
        await self.aclose()
        self._dir = tempfile.mkdtemp(prefix="fleetrl-forkserver-")
        err_path = os.path.join(self._dir, "stderr")
        with open(err_path, "wb") as err:
            try:
                self._proc = await trio.lowlevel.open_process(
                    [self.python, "-c", program_text("forkserver.py"), self.socket_path, ",".join(self.preload)],
                    env=self.env, cwd=self._dir, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                    start_new_session=True)
            except OSError as exc:
                raise ForkServerFailed(f"cannot start the fork server {self.python!r}: {exc}") from exc
        assert self._proc.stdout is not None
        line = b""
        with trio.move_on_after(self.start_timeout_s):
            while not line.endswith(b"\n"):
                chunk = await self._proc.stdout.receive_some(4096)
                if not chunk:
                    break
                line += chunk
        if line.strip() != b"ready":
            with open(err_path, "rb") as f:
                tail = f.read()[-1500:].decode(errors="replace")
            await self.aclose()
            why = line.decode(errors="replace").strip() or f"no answer within {self.start_timeout_s:g} s"
            raise ForkServerFailed(f"the fork server ({self.python}, preload {', '.join(self.preload)}) did not "
                                   f"start: {why}{': ' + tail if tail else ''}")
        self.starts += 1

    async def spawn(self, program: Sequence[str], *, env: Mapping[str, str], cwd: str,
                    stdio: tuple[int, int, int]) -> ForkedProcess:
        """Run ``program`` (``[script, args...]`` or ``["-m", module, args...]``) in a
        child with ``env``, ``cwd`` and the descriptors ``stdio`` as its 0, 1, 2 (the
        caller keeps and closes its own copies)."""
        request = json.dumps({"argv": list(program), "env": dict(env), "cwd": cwd}).encode()
        if len(request) > MAX_REQUEST:
            raise ForkServerFailed(f"a run request of {len(request)} bytes is over {MAX_REQUEST} "
                                   "(argv and environment)")
        async with self._lock:
            if self._proc is None or self._proc.returncode is not None:
                await self._start()
            path = self.socket_path
        conn = trio.socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            await conn.connect(path)
            await conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", stdio).tobytes())])
            data = await conn.recv(65536)
        except OSError as exc:
            conn.close()
            raise ForkServerFailed(f"the fork server did not take the run: {exc}") from exc
        except BaseException:
            conn.close()
            raise
        answer = json.loads(data) if data else {"error": "the fork server closed the connection"}
        if "pid" not in answer:
            conn.close()
            raise ForkServerFailed(f"the fork server refused the run: {answer.get('error')}")
        return ForkedProcess(int(answer["pid"]), conn)

    async def aclose(self) -> None:
        """Stop the server (its children, in their own sessions, are not touched)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with trio.CancelScope(shield=True):
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
                if proc.stdin is not None:
                    await proc.stdin.aclose()
                if proc.stdout is not None:
                    await proc.stdout.aclose()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

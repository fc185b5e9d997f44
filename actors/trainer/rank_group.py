"""The trainer's rank processes, seen from the trainer actor: start, talk to, watch, kill.

`RankGroup` starts ``world_size`` processes of `fleetrl.actors.trainer.rank_main` (each in
its own session, its output appended to ``<state_dir>/ranks/rank-<r>.log``), hands rank 0
one end of a socket pair, and exchanges `rank_protocol` frames with it. Every wait polls
the socket a few times a second and checks that each rank process is still alive, so a
rank that dies (SIGKILL, OOM, a native crash) is noticed within a fraction of a second,
mid-step or not, and raises `RanksFailed`; so does a request unanswered within
``step_timeout_s`` (a hung rank) and a rank that does not answer the start within
``start_timeout_s``. `kill()` SIGKILLs every rank's process group and reaps them; the
group is then spent (a restart is a new `RankGroup`).

Blocking: the trainer actor calls it from a worker thread.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from fleetrl.harness.processes import exit_reason

from .config import TrainerConfig
from .errors import RanksFailed
from .rank_protocol import FrameReader, RankError, RankReply, Ready, Start, frame, decode_reply

__all__ = ["RankGroup", "RankSpec", "free_port"]

POLL_S = 0.2
"""How often a wait checks that the ranks are alive."""


class RankSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What every rank process is started with (written as JSON next to its logs)."""

    config: TrainerConfig
    state_dir: str
    run_id: str
    master_addr: str
    master_port: int
    world_size: int


def free_port(addr: str) -> int:
    """A TCP port on ``addr`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


class RankGroup:
    """One incarnation of the rank processes (module docstring)."""

    def __init__(self, cfg: TrainerConfig, state_dir: Path, run_id: str) -> None:
        assert cfg.ranks is not None
        self.cfg = cfg
        self.ranks = cfg.ranks
        self.state_dir = Path(state_dir)
        self.run_id = run_id
        self.procs: list[subprocess.Popen] = []
        self._sock: socket.socket | None = None
        self._reader = FrameReader()
        self.log_dir = self.state_dir / "ranks"

    # -- lifetime ---------------------------------------------------------------------
    def start(self, start: Start) -> Ready:
        """Start the processes and send ``start``; their `Ready`. Raises `RanksFailed`."""
        r = self.ranks
        port = r.master_port or free_port(r.master_addr)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        spec = RankSpec(config=self.cfg, state_dir=str(self.state_dir), run_id=self.run_id,
                        master_addr=r.master_addr, master_port=port, world_size=r.world_size)
        spec_path = self.log_dir / "spec.json"
        spec_path.write_bytes(msgspec.json.encode(spec))
        ours, theirs = socket.socketpair()
        self._sock = ours
        threads = r.threads or max(1, (os.cpu_count() or 1) // r.world_size)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), FLEETRL_RANK_THREADS=str(threads))
        try:
            for rank in range(r.world_size):
                argv = [sys.executable, "-m", "fleetrl.actors.trainer.rank_main", "--spec", str(spec_path),
                        "--rank", str(rank)]
                fds: tuple[int, ...] = ()
                if rank == 0:
                    argv += ["--fd", str(theirs.fileno())]
                    fds = (theirs.fileno(),)
                with (self.log_dir / f"rank-{rank}.log").open("ab") as log:
                    self.procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                                       stderr=subprocess.STDOUT, pass_fds=fds,
                                                       start_new_session=True))
        except BaseException:
            self.kill()
            raise
        finally:
            theirs.close()
        self.send(start)
        reply = self.receive(r.start_timeout_s, "start")
        if isinstance(reply, RankError):
            self.kill()
            raise RanksFailed(f"rank group failed to start: {reply.error} (logs: {self.log_dir})")
        if not isinstance(reply, Ready):
            self.kill()
            raise RanksFailed(f"rank 0 answered the start with {type(reply).__name__}")
        return reply

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead(self) -> str | None:
        """Why the group cannot go on (ranks have exited: those killed by a signal first,
        since a rank whose peer died exits on its own after), or None while all run."""
        exited = [(rank, p.pid, code) for rank, p in enumerate(self.procs) if (code := p.poll()) is not None]
        if not exited:
            return None
        exited.sort(key=lambda x: (x[2] >= 0, x[0]))
        return ", ".join(f"rank {rank} (pid {pid}) {exit_reason(code)}" for rank, pid, code in exited)

    def dead_within(self, timeout_s: float) -> str | None:
        """`dead` after waiting up to ``timeout_s`` for a rank to exit (a rank whose peer died
        often reports the broken collective before the dead peer's exit is visible)."""
        deadline = time.monotonic() + timeout_s
        while (why := self.dead()) is None and time.monotonic() < deadline:
            time.sleep(POLL_S / 4)
        return why

    def kill(self) -> None:
        """SIGKILL every rank's process group and reap them; close the socket."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL cannot end
                pass
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask the ranks to leave cleanly; kill whatever is still running after ``timeout_s``."""
        from .rank_protocol import Stop

        try:
            if self._sock is not None and self.dead() is None:
                self.send(Stop())
                deadline = time.monotonic() + timeout_s
                for p in self.procs:
                    try:
                        p.wait(timeout=max(0.0, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        break
        except (OSError, RanksFailed):
            pass
        finally:
            self.kill()

    # -- messages ---------------------------------------------------------------------
    def send(self, msg) -> None:
        if self._sock is None:
            raise RanksFailed("the rank group is not running")
        try:
            self._sock.sendall(frame(msg))
        except OSError as exc:
            why = self.dead() or f"socket to rank 0 failed: {exc}"
            self.kill()
            raise RanksFailed(why) from None

    def receive(self, timeout_s: float | None, what: str) -> RankReply:
        """The next reply from rank 0, checking every `POLL_S` that every rank is alive."""
        assert self._sock is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            body = self._reader.next_frame()
            if body is not None:
                return decode_reply(body)
            why = self.dead()
            if why is not None:
                self.kill()
                raise RanksFailed(f"{why} during {what} (logs: {self.log_dir})")
            if deadline is not None and time.monotonic() > deadline:
                self.kill()
                raise RanksFailed(f"no answer to {what} within {timeout_s:g} s (a hung rank); killed the "
                                  f"group (logs: {self.log_dir})")
            ready, _, _ = select.select([self._sock], [], [], POLL_S)
            if ready:
                data = self._sock.recv(1 << 20)
                if not data:
                    time.sleep(POLL_S)  # rank 0 closed: let its exit status show
                    why = self.dead() or "rank 0 closed its socket"
                    self.kill()
                    raise RanksFailed(f"{why} during {what} (logs: {self.log_dir})")
                self._reader.feed(data)

    def request(self, msg, what: str) -> RankReply:
        """Send ``msg`` and wait for its reply (``step_timeout_s``)."""
        self.send(msg)
        return self.receive(self.ranks.step_timeout_s, what)

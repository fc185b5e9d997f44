"""Samplers as child processes of the daemon (``process = true``): start, watch, restart, stop.

A sampler whose backend is native code (vLLM) can crash the process it runs in. Run as
a child process it joins the pool over the remote protocol, as ``fleetrl sampler
--join`` does from another host (`remote_client`), and its crash is a restart, not an
outage. `ProcessSampler.run` keeps one configured sampler running for ever:

1. Reserve its id: a fresh random token claims the configured sampler id on the join
   endpoint (`remote_server.Reservations`). Each start gets a new token, so a process of
   an earlier start can never serve under the id again.
2. Start ``python -m fleetrl.actors.pool.cli --join URL ...`` (`child_argv`) in a session
   (process group) of its own. The tokens (its join token; the control token that
   guards the delta store it follows) are in its environment, never on its command line
   where ``ps`` shows them (`child_env`). Its stdout and stderr are appended to
   ``<actor state>/samplers/<id>.log``. ``--parent-pid`` makes the child kill its own
   process group once the daemon is gone, so a SIGKILLed daemon leaves no sampler behind.
3. Watch it: it must join within ``start_timeout_s``, and join again within that after
   a lost connection, or it is killed.
4. When it exits or is killed: its requests are re-routed (its connection is gone; the
   pool takes out its registration, should the connection not have noticed yet), what
   is left of its process group is killed and reaped, and it is started again after a
   backoff of the project's restart policy (`daemon.restart.RestartTracker` over
   ``PoolConfig.process_restart``: the delay grows with each exit within ``period_s``).
   More than ``intensity`` exits within ``period_s`` raise `SamplerProcessFailed`: the
   pool actor fails, and the kernel's restart policy for it takes over.
5. At shutdown (the task is cancelled): SIGTERM, ``grace_s`` for it to exit, then
   SIGKILL for its whole process group, and it is reaped
   (`fleetrl.harness.processes.kill_process_tree`), shielded from the cancellation.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import trio
from fleetrl.daemon.config import RestartPolicy
from fleetrl.daemon.restart import RestartTracker
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT
from fleetrl.harness.processes import exit_reason, kill_process_tree

from .config import LocalSamplerConfig
from .core import SamplerPool
from .errors import PoolError
from .remote_server import Reservation, Reservations

__all__ = ["Launch", "ProcessSampler", "ProcessStatistics", "SamplerProcessFailed", "child_argv", "child_env"]

TOKEN_ENV = "FLEETRL_FLEET_TOKEN"
"""The child's join token (`cli` reads it as the default of ``--token``)."""
CONTROL_TOKEN_ENV = "FLEETRL_TOKEN"
"""The control token, for the delta store behind the control plane (``--weights-token``)."""


class SamplerProcessFailed(PoolError):
    """A child sampler process exited more often than its restart policy allows."""


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """Where a child sampler joins and what it follows (the same for every child)."""

    join_url: str
    """``ws://HOST:PORT<join_prefix>/join`` of this daemon's control plane."""
    weights_url: str | None = None
    """The delta store over HTTP (the trainer's ``/weights`` mount); None: no following."""
    control_token: str | None = None
    """Bearer token of the delta store (the control plane's token)."""
    ca_file: str | None = None
    """The daemon's TLS certificate, which the child verifies it by (None: plain ws://)."""
    max_support: int = DEFAULT_MAX_SUPPORT
    """The pool's support cap, which each child's backend enforces too (`PoolConfig.max_support`)."""

    def __repr__(self) -> str:  # never print the credential
        return f"Launch(join_url={self.join_url!r}, weights_url={self.weights_url!r}, control_token='***')"


class ProcessStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """One child sampler's process history."""

    sampler_id: str
    pid: int | None
    """The running process (None between starts)."""
    starts: int
    exits: int
    joins: int
    """Times one of its processes joined the pool."""
    last_exit: str | None
    log: str


def child_argv(sc: LocalSamplerConfig, launch: Launch, *, parent_pid: int) -> list[str]:
    """The command line of the child that runs `sc` (no credential on it)."""
    argv = [sys.executable, "-m", "fleetrl.actors.pool.cli", "--join", launch.join_url,
            "--backend", sc.backend, "--dtype", sc.dtype, "--model", sc.model_dir, "--device", sc.device,
            "--price-per-hour", repr(float(sc.price_per_hour)), "--capacity", str(sc.capacity),
            "--max-batch", str(sc.max_batch), "--name", sc.id, "--parent-pid", str(parent_pid),
            "--max-support", str(launch.max_support)]
    if sc.backend == "torch":
        argv += ["--fp8-scheme", sc.fp8_scheme, "--matmul", sc.matmul]
    else:
        argv += ["--vllm", msgspec.json.encode(sc.vllm).decode()]
    if launch.weights_url is not None:
        argv += ["--weights", launch.weights_url]
    if launch.ca_file is not None:
        argv += ["--ca-file", launch.ca_file]
    return argv


def child_env(token: str, launch: Launch, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the daemon's, with its join token and (when it follows
    the delta store) the control token; output unbuffered, so its log is current."""
    env = dict(os.environ if base is None else base)
    env[TOKEN_ENV] = token
    env.pop(CONTROL_TOKEN_ENV, None)
    if launch.weights_url is not None and launch.control_token:
        env[CONTROL_TOKEN_ENV] = launch.control_token
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ProcessSampler:
    """One configured sampler run as a child process, restarted when it exits (module
    docstring). `log` is a structlog-style logger (or None); `on_change` is called after
    each start and exit (the actor updates its metrics there)."""

    def __init__(self, sc: LocalSamplerConfig, *, pool: SamplerPool, reservations: Reservations, launch: Launch,
                 log_dir: Path, policy: RestartPolicy, start_timeout_s: float, grace_s: float,
                 log: Any = None, on_change: Any = None, rng: Any = None) -> None:
        self.sc = sc
        self.pool = pool
        self.reservations = reservations
        self.launch = launch
        self.log_path = Path(log_dir) / f"{sc.id}.log"
        self.policy = policy
        self.tracker = RestartTracker(policy, rng)
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.log = log
        self.on_change = on_change
        self.pid: int | None = None
        self.starts = 0
        self.exits = 0
        self.joins = 0
        self.first_join = trio.Event()
        """Set when a process of this sampler first joined the pool."""
        self.last_exit: str | None = None

    def statistics(self) -> ProcessStatistics:
        return ProcessStatistics(sampler_id=self.sc.id, pid=self.pid, starts=self.starts, exits=self.exits,
                                 joins=self.joins, last_exit=self.last_exit, log=str(self.log_path))

    async def run(self) -> NoReturn:
        """Start the child, and again after every exit (module docstring); returns only
        by cancellation (the child is stopped first) or `SamplerProcessFailed`."""
        while True:
            why = await self.run_once()
            delay = self.tracker.crash(trio.current_time())
            if delay is None:
                raise SamplerProcessFailed(
                    f"sampler {self.sc.id!r}: its process exited {self.tracker.recent(trio.current_time())} "
                    f"times within {self.policy.period_s:g} s (process_restart.intensity="
                    f"{self.policy.intensity}); last: {why}; its output is in {self.log_path}")
            self._emit("restarting sampler process", "warning", why=why, in_s=round(delay, 3))
            await trio.sleep(delay)

    async def run_once(self) -> str:
        """One child process from start to exit; returns why it ended."""
        reservation = self.reservations.reserve(self.sc.id)
        proc: trio.Process | None = None
        try:
            try:
                proc = await self._start(reservation)
            except OSError as exc:
                why = f"could not be started: {exc}"
            else:
                self._emit("sampler process started", pid=proc.pid, start=self.starts, log=str(self.log_path))
                self._changed()
                why = await self._watch(proc, reservation)
        finally:
            self.reservations.release(reservation)
            if proc is not None:
                await self._stop(proc)
            self._take_out(reservation, "its process ended")
        self.exits += 1
        self.last_exit = why
        self.pid = None
        self._emit("sampler process exited", "warning", pid=proc.pid if proc is not None else None, why=why,
                   log=str(self.log_path))
        self._changed()
        return why

    async def _start(self, reservation: Reservation) -> trio.Process:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = child_argv(self.sc, self.launch, parent_pid=os.getpid())
        with self.log_path.open("ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} start {self.starts + 1} of sampler "
                      f"{self.sc.id}: {' '.join(argv)}\n".encode())
            out.flush()
            proc = await trio.lowlevel.open_process(
                argv, env=child_env(reservation.token, self.launch), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = proc.pid
        self.starts += 1
        return proc

    async def _watch(self, proc: trio.Process, reservation: Reservation) -> str:
        """Until `proc` exits, or does not (re)join in time (then it is killed)."""
        why: list[str] = []
        async with trio.open_nursery() as nursery:
            async def exited() -> None:
                await proc.wait()
                why.append(exit_reason(proc.returncode))
                nursery.cancel_scope.cancel()

            async def joined() -> None:
                while True:
                    handle = None
                    with trio.move_on_after(self.start_timeout_s):
                        handle = await reservation.wait_joined()
                    if handle is None:
                        why.append(f"did not join the pool within start_timeout_s={self.start_timeout_s:g} s; "
                                   "killed")
                        nursery.cancel_scope.cancel()
                        return
                    self.joins += 1
                    self.first_join.set()
                    self._emit("sampler process joined", pid=proc.pid, joins=self.joins)
                    await reservation.wait_left(handle)

            nursery.start_soon(exited)
            nursery.start_soon(joined)
        return why[0]

    async def _stop(self, proc: trio.Process) -> None:
        """SIGTERM the child's process group, SIGKILL what is left after ``grace_s``, reap."""
        with trio.CancelScope(shield=True):
            root = proc.pid if proc.returncode is None else None  # a reaped pid may be reused
            await kill_process_tree(root, proc.pid, grace_s=self.grace_s)
            with trio.move_on_after(max(self.grace_s, 5.0)):
                await proc.wait()

    def _take_out(self, reservation: Reservation, why: str) -> None:
        """Take the child's registration out of the pool (its requests are re-routed), in
        case its connection has not been noticed as gone yet."""
        handle = reservation.handle
        if handle is not None and self.pool.handles.get(self.sc.id) is handle:
            handle.lose(why)
            self.pool.mark_dead(self.sc.id, why)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def _emit(self, event: str, level: str = "info", **kw: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, sampler=self.sc.id, **kw)

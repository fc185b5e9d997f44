"""The supervisor: runs the configured actors under one Trio nursery tree.

Shutdown contract
-----------------
Shutdown begins on the first SIGTERM or SIGINT, on ``POST /shutdown``, or when
`Supervisor.request_shutdown` is called (also by an actor, through
``ctx.request_shutdown(reason)``). Then, in this order:

1. *Stop admitting work.* The drain event is set (``ctx.draining`` is true,
   ``ctx.wait_draining()`` returns, ``ctx.wait_unpaused()`` stops blocking) and the
   kernel closes its own send side of every inbox. No actor is restarted from now on.
2. *Drain.* Actors finish in-flight work and return. A consumer's inbox ends with
   ``EndOfChannel`` once every producer holding a ``ctx.sender`` clone has returned,
   so a pipeline drains front to back without sentinels.
3. *Grace deadline.* Actors still running ``daemon.grace_s`` seconds after step 1
   are cancelled (``trio.Cancelled`` is raised inside them, at their next checkpoint).
4. *Final checkpoint.* Every registered checkpoint hook runs (even of actors that
   were cancelled or crashed: the hook is a closure over their state), within
   ``daemon.checkpoint_timeout_s``, and one checkpoint file is written atomically.
5. *Control plane and signal handling stop*; `Supervisor.run` returns
   ``ExitCode.OK``.

A second SIGTERM/SIGINT during shutdown forces exit: everything still running,
including the final checkpoint, is cancelled and `run` returns ``ExitCode.FORCED``
(4); if unwinding takes more than `FORCE_EXIT_AFTER_S` seconds (an actor stuck where
cancellation cannot reach), the process leaves with ``os._exit(4)``. The previous
checkpoint on disk stays valid (writes are atomic). If the final checkpoint cannot be
written (disk full), `run` returns ``ExitCode.CHECKPOINT_FAILED`` (6). An actor that
halts the run (``ctx.halt(reason)``: an error no restart can fix, e.g. a trainer whose
corrections mask every token) starts the same graceful shutdown, and `run` returns
``ExitCode.HALTED`` (7) with `Supervisor.halted` naming the actor and the reason.

An actor that crashes more than ``intensity`` times within ``period_s`` escalates:
the supervisor logs ``actor escalated`` naming the actor and its last error, cancels
all actors at once (no grace: the daemon is failing), writes a final checkpoint
from the hooks, and `run` returns ``ExitCode.ESCALATED`` (1) with
`Supervisor.escalation` set to the `ActorEscalated` error. No exception escapes
`run` for these outcomes; an exception that does escape is a bug in the kernel.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import structlog
import trio

from .actor import ActorContext, CheckpointHook, Gate
from .checkpoint import CheckpointStore
from .checkpointing import Checkpointer
from .config import ActorSpec, Config
from .control import MountTable, build_app, serve_control
from .credentials import CredentialStore
from .faults import ActorEscalated, ExitCode
from .handles import HandleTable
from .metrics import ActorMetrics, KernelMetrics, MetricsRegistry
from .restart import RestartTracker
from .state import StateDir

__all__ = ["ActorRecord", "Supervisor", "run_inline"]

#: after a forced exit, seconds before the process leaves with os._exit(4) regardless
FORCE_EXIT_AFTER_S = 5.0


class ActorRecord:
    """What the supervisor knows about one actor (shown in /status)."""

    def __init__(self, spec: ActorSpec) -> None:
        self.spec = spec
        self.state = "pending"  # pending|starting|running|backoff|finished|failed|cancelled
        self.incarnation = 0
        self.restarts = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.versions: dict[str, Any] = {}

    def as_json(self, inbox: tuple[int, int], statistics: dict[str, Any] | None = None
                ) -> dict[str, Any]:
        return {"state": self.state, "factory": self.spec.factory,
                "incarnation": self.incarnation, "restarts": self.restarts,
                "last_error": self.last_error, "last_error_at": self.last_error_at,
                "versions": dict(self.versions),
                "inbox": {"messages": inbox[0], "capacity": inbox[1]},
                "statistics": statistics}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def run_inline(fn: Callable[..., Any], *args: Any) -> Any:
    """Run blocking I/O on the Trio thread (see `Supervisor`'s `run_blocking`)."""
    return fn(*args)


class Supervisor:
    """Owns one run of the daemon: actors, inboxes, checkpoints, control plane.

    `state` must already be open (locked). `rng` seeds restart jitter (tests pass a
    seeded one or set ``jitter = 0``). `run_blocking` runs checkpoint file I/O and
    actors' blocking work (``ctx.run_blocking``); the default moves it to a worker
    thread, and tests that use Trio's autojump clock pass `run_inline` instead (the
    clock would otherwise jump while a thread works). `clock` is what ``ctx.clock()``
    reads (default ``time.monotonic``; such tests pass ``trio.current_time``, which
    needs `run_inline`: it cannot be read from a worker thread).
    """

    def __init__(self, config: Config, state: StateDir, *,
                 rng: random.Random | None = None,
                 run_blocking: Callable[..., Awaitable[Any]] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.state = state
        self.run_id = state.run_id
        self.instance_id = state.instance_id
        self.log = structlog.get_logger("fleetrl.daemon").bind(run_id=self.run_id)
        self.gate = Gate()
        self.draining_event = trio.Event()
        self.mounts = MountTable()
        self.credentials = CredentialStore(state.path, state.token)
        self.metrics = MetricsRegistry()
        self._kmetrics = KernelMetrics(self.metrics, uptime=self.uptime,
                                       inbox_stats=self.inbox_stats,
                                       statistics=self.actor_statistics)
        self._rng = rng if rng is not None else random.Random()
        self._blocking = run_blocking or trio.to_thread.run_sync
        self.clock = clock or time.monotonic
        self._checkpoint_failed = False
        self._records = {s.name: ActorRecord(s) for s in config.actors}
        self._inboxes: dict[str, tuple[trio.MemorySendChannel[Any],
                                       trio.MemoryReceiveChannel[Any]]] = {
            s.name: trio.open_memory_channel(s.inbox) for s in config.actors}
        self._handles = HandleTable([s.name for s in config.actors])
        self._ckpt = Checkpointer(
            CheckpointStore(state.checkpoints, keep=config.daemon.checkpoint_keep), run_id=self.run_id,
            order=[s.name for s in config.actors], timeout_s=config.daemon.checkpoint_timeout_s,
            run_blocking=self._blocking, metrics=self._kmetrics, log=self.log)
        self._shutdown = trio.Event()
        self._shutdown_reason = ""
        self._forced = False
        self._started_mono = time.monotonic()
        self._root: trio.CancelScope | None = None
        self._actors_scope: trio.CancelScope | None = None
        self._final_scope: trio.CancelScope | None = None
        self._phase = "starting"
        self.escalation: ActorEscalated | None = None
        self.halted: str | None = None
        """Set by `halt`: which actor halted the run, and why."""
        self.control_address: tuple[str, int] | None = None

    # -- the kernel API actors reach through ActorContext -------------------------
    def inbox_sender(self, name: str) -> trio.MemorySendChannel[Any]:
        if name not in self._inboxes:
            raise KeyError(f"no actor named {name!r} (known: {', '.join(self._inboxes)})")
        return self._inboxes[name][0]

    async def wait_handle(self, name: str, *, asker: str | None = None) -> Any:
        """The handle actor `name` started with (waits while it is not running).
        `asker`: the actor asking (None: code outside the daemon's actors, e.g. a test)."""
        if name not in self._records:
            raise KeyError(f"no actor named {name!r} (known: {', '.join(self._records)})")
        if (asker is not None and self._records[name].state == "pending"
                and self._records[asker].state == "starting"):
            raise ValueError(f"actor {asker!r} asks for the handle of {name!r}, which starts after it: "
                             f"add {name!r} to [actors.{asker}] after = [...]")
        return await self._handles.wait(name)

    async def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self._blocking(fn, *args)

    def set_hook(self, name: str, hook: CheckpointHook) -> None:
        self._ckpt.hooks[name] = hook

    def report_version(self, actor: str, key: str, value: Any) -> None:
        self._records[actor].versions[key] = value

    # -- operator API (control plane, signals) -------------------------------------
    def uptime(self) -> float:
        return time.monotonic() - self._started_mono

    def inbox_stats(self) -> dict[str, tuple[int, int]]:
        out = {}
        for name, (send, _) in self._inboxes.items():
            st = send.statistics()
            out[name] = (st.current_buffer_used, int(st.max_buffer_size))
        return out

    def pause(self) -> None:
        if not self.gate.closed:
            self.log.info("paused")
        self.gate.close()
        self._kmetrics.paused.set(1)

    def resume(self) -> None:
        if self.gate.closed:
            self.log.info("resumed")
        self.gate.open()
        self._kmetrics.paused.set(0)

    def request_shutdown(self, reason: str) -> None:
        """Begin graceful shutdown (idempotent); see the module's shutdown contract."""
        if not self._shutdown.is_set():
            self._shutdown_reason = reason
            self.log.info("shutdown requested", reason=reason,
                          grace_s=self.config.daemon.grace_s)
            self._shutdown.set()

    def halt(self, actor: str, reason: str) -> None:
        """Stop the run on an error no restart can fix: graceful shutdown (the same path as
        `request_shutdown`), and `run` returns ``ExitCode.HALTED``. The first halt wins."""
        if self.halted is None:
            self.halted = f"actor {actor!r}: {reason}"
        self.request_shutdown(f"halted by actor {actor!r}: {reason}")

    def force_exit(self, reason: str) -> None:
        """Cancel everything now, final checkpoint included (second signal)."""
        self.log.warning("forced exit", reason=reason, exit_code=int(ExitCode.FORCED))
        self._forced = True
        for scope in (self._final_scope, self._root):
            if scope is not None:
                scope.cancel()
        # an actor blocked where cancellation cannot reach (a thread, a C call) must
        # not keep a forced daemon alive: exit hard if unwinding takes too long
        timer = threading.Timer(FORCE_EXIT_AFTER_S, os._exit, [int(ExitCode.FORCED)])
        timer.daemon = True
        timer.start()

    def actor_statistics(self) -> dict[str, dict[str, Any]]:
        """Each running actor's ``handle.statistics()`` as plain data (see `HandleTable`)."""
        return self._handles.statistics()

    def status(self) -> dict[str, Any]:
        stats = self.inbox_stats()
        records = self.actor_statistics()
        last = self._ckpt.last
        return {
            "run_id": self.run_id, "instance_id": self.instance_id,
            "uptime_s": round(self.uptime(), 3), "phase": self._phase,
            "paused": self.gate.closed, "draining": self.draining_event.is_set(),
            "actors": {n: r.as_json(stats[n], records.get(n)) for n, r in self._records.items()},
            "mounts": self.mounts.prefixes(),
            "checkpoint": last,
            "halted": self.halted,
        }

    def metrics_text(self) -> bytes:
        return self.metrics.render()

    # -- running -------------------------------------------------------------------
    async def run(self, *, handle_signals: bool = True,
                  task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED,
                  ) -> ExitCode:
        """Run until shutdown or escalation; returns the process exit code."""
        await self._ckpt.restore()
        stop_http = trio.Event()
        async with trio.open_nursery() as root:
            self._root = root.cancel_scope
            if handle_signals:
                await root.start(self._signals)
            if self.config.http.enabled:
                http = self.config.http
                self.credentials.admin_token = self.state.token  # read when the state was opened
                app = build_app(self, self.state.token, self.mounts, self.credentials)
                self.control_address = await root.start(partial(
                    serve_control, app, http.host, http.port, shutdown_trigger=stop_http.wait,
                    certfile=http.tls_cert, keyfile=http.tls_key))
                host, port = self.control_address
                self.state.write_control(host, port, tls_cert=http.tls_cert)
                scheme = "https" if http.tls_cert is not None else "http"
                self.log.info("control plane listening", url=f"{scheme}://{host}:{port}")
            root.start_soon(self._periodic_checkpoints)
            await self._run_actors(task_status)
            self.draining_event.set()  # already set unless escalating
            await self._final_checkpoint()
            stop_http.set()
            root.cancel_scope.cancel()
        self._phase = "stopped"
        if self._forced:
            return ExitCode.FORCED
        if self.escalation is not None:
            return ExitCode.ESCALATED
        if self._checkpoint_failed:
            return ExitCode.CHECKPOINT_FAILED
        if self.halted is not None:
            self.log.error("run halted", reason=self.halted, exit_code=int(ExitCode.HALTED))
            return ExitCode.HALTED
        self.log.info("stopped cleanly", reason=self._shutdown_reason)
        return ExitCode.OK

    async def _run_actors(self, task_status: trio.TaskStatus[Supervisor]) -> None:
        async with trio.open_nursery() as actors:
            self._actors_scope = actors.cancel_scope
            for spec in self.config.actors:
                if self._shutdown.is_set():
                    break
                await actors.start(self._keeper, spec)
            self._phase = "running"
            self.log.info("daemon running", actors=[s.name for s in self.config.actors])
            task_status.started(self)
            await self._shutdown.wait()
            self._begin_drain()
            actors.cancel_scope.deadline = trio.current_time() + self.config.daemon.grace_s
        if actors.cancel_scope.cancelled_caught and self.escalation is None:
            late = [n for n, r in self._records.items() if r.state == "cancelled"]
            self.log.warning("grace deadline passed; cancelled actors", actors=late)

    def _begin_drain(self) -> None:
        self._phase = "draining"
        self.draining_event.set()
        self.gate.open()
        self._kmetrics.draining.set(1)
        for send, _ in self._inboxes.values():
            send.close()

    def _escalate(self, err: ActorEscalated) -> None:
        if self.escalation is None:
            self.escalation = err
            self.log.error("actor escalated", failed_actor=err.actor,
                           last_error=err.last_error, error=str(err))
            self._shutdown_reason = f"escalation of actor {err.actor!r}"
            self._phase = "failing"
        if self._actors_scope is not None:
            self._actors_scope.cancel()

    async def _keeper(self, spec: ActorSpec, *, task_status: trio.TaskStatus[None]) -> None:
        """Runs one actor, restarting it after crashes (one-for-one)."""
        rec = self._records[spec.name]
        tracker = RestartTracker(spec.restart, self._rng)
        announced = False
        cancelled = False
        structlog.contextvars.bind_contextvars(actor=spec.name, run_id=self.run_id)
        log = self.log.bind(actor=spec.name)
        up = self._kmetrics.up.labels(actor=spec.name)
        try:
            while True:
                rec.incarnation += 1
                rec.state = "starting"
                ctx = ActorContext(
                    name=spec.name, kernel=self, inbox=self._inboxes[spec.name][1].clone(),
                    state_dir=self.state.actor_dir(spec.name),
                    restored=self._ckpt.states.get(spec.name), incarnation=rec.incarnation,
                    log=log, metrics=ActorMetrics(self.metrics, spec.name),
                    previous_handle=self._handles.previous(spec.name))
                try:
                    async with trio.open_nursery() as n:
                        self._handles.publish(spec.name, await n.start(partial(spec.run, spec.config, ctx)))
                        rec.state = "running"
                        up.set(1)
                        if not announced:
                            announced = True
                            task_status.started()
                    rec.state = "finished"
                    log.info("actor finished")
                    if not self.draining_event.is_set():
                        self.mounts.remove_owner(spec.name)  # nobody serves them now
                    return
                except BaseException as group:
                    exc = _unwrap(group)
                    if not isinstance(exc, Exception):  # Cancelled, KeyboardInterrupt...
                        rec.state = "cancelled" if isinstance(exc, trio.Cancelled) else "failed"
                        cancelled = True
                        raise
                    rec.last_error = _describe(exc)
                    rec.last_error_at = time.time()
                    if self.draining_event.is_set():
                        rec.state = "failed"
                        log.error("actor crashed while draining; not restarted",
                                  error=rec.last_error, exc_info=exc)
                        return
                    delay = tracker.crash(trio.current_time())
                    if delay is None:
                        rec.state = "failed"
                        log.error("actor crashed", error=rec.last_error, exc_info=exc)
                        self._escalate(ActorEscalated(spec.name, tracker.recent(
                            trio.current_time()), spec.restart.period_s, rec.last_error))
                        return
                    rec.state = "backoff"
                    rec.restarts += 1
                    self._kmetrics.restarts.labels(actor=spec.name).inc()
                    log.warning("actor crashed; restarting", error=rec.last_error,
                                delay_s=round(delay, 3), restarts=rec.restarts, exc_info=exc)
                finally:
                    up.set(0)
                    self._handles.retract(spec.name)
                    ctx._close()
                with trio.move_on_after(delay):
                    await self.draining_event.wait()
                if self.draining_event.is_set():
                    rec.state = "finished"
                    return
        finally:
            if not announced and not cancelled:
                # escalation or drain while the first incarnation was still starting:
                # let nursery.start() return; the record says what happened.
                task_status.started()

    async def _signals(self, *, task_status: trio.TaskStatus[None]) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if not self._shutdown.is_set():
                    self.request_shutdown(name)
                else:
                    self.force_exit(f"second signal {name}")

    # -- checkpoints -----------------------------------------------------------------
    async def checkpoint(self, reason: str = "requested") -> None:
        """Run every hook and write one checkpoint (`Checkpointer.write`)."""
        await self._ckpt.write(reason)

    async def _periodic_checkpoints(self) -> None:
        interval = self.config.daemon.checkpoint_interval_s
        while not self.draining_event.is_set():
            await trio.sleep(interval)
            if self.draining_event.is_set():
                return
            try:
                await self.checkpoint("periodic")
            except OSError as exc:  # disk full, permissions: keep running, say so
                self.log.error("periodic checkpoint failed", error=_describe(exc))

    async def _final_checkpoint(self) -> None:
        if self._forced:
            return
        with trio.CancelScope(shield=True) as scope:
            self._final_scope = scope
            try:
                await self.checkpoint("final")
            except OSError as exc:
                self._checkpoint_failed = True
                self.log.error("final checkpoint failed", error=_describe(exc),
                               exit_code=int(ExitCode.CHECKPOINT_FAILED))
        self._final_scope = None


"""What an actor sees of the kernel: `ActorContext`.

An actor is ``async def run(cfg: SomeConfig, ctx: ActorContext, *,
task_status=trio.TASK_STATUS_IGNORED)``: it validates and prepares, calls
``task_status.started(handle)`` once ready (actors that list it in ``after`` start only
then), and loops over ``ctx.inbox``. The handle is what other actors get from
``await ctx.handle(name)`` (the kernel keeps it; no module globals) and what the
control plane reads: its ``statistics()``, a frozen record, is shown under the actor
in /status and exported as ``fleetrl_actor_statistic`` in /metrics
(docs/guides/daemon.md, "Writing an actor"). The context gives it:

- identity: ``name``, ``run_id``, ``instance_id``, ``incarnation`` (1, 2, ... per restart)
- ``state_dir``: a private scratch directory under ``<state>/actors/NAME``
- ``inbox`` (bounded ``trio.MemoryReceiveChannel``; a fresh clone per incarnation, so
  messages queued while an actor restarts are kept) and ``sender(name)`` (a clone of
  another actor's inbox; closed by the kernel when this incarnation ends)
- ``await handle(name)``: the handle actor ``name`` started with (waits until it has
  started; after a restart, the new incarnation's); ``await handle(name, Kind)`` also
  checks it is a ``Kind`` (a class, or a ``runtime_checkable`` Protocol naming what the
  holder calls) and returns it typed, else `faults.WrongHandle` naming both actors. Holding it counts as a producer of
  ``name``'s inbox, so that actor's inbox ends at shutdown only once every holder has
  returned: an actor that serves through its handle drains by reading its inbox to
  the end. ``previous_handle``: what this actor's previous incarnation started with
  (None on the first), for state that should outlive a restart
- ``clock()`` and ``await run_blocking(fn, *args)``: the kernel's clock (seconds,
  monotonic) and its way of running blocking work (a worker thread). Tests that run
  the supervisor on Trio's autojump clock inject both (`Supervisor`'s ``clock`` and
  ``run_blocking``), so an actor's time budgets run on virtual time
- ``log``: structlog logger bound with ``actor`` and ``run_id``
- ``metrics``: Prometheus helpers that label with ``actor``
- ``paused`` / ``wait_unpaused()``: operator pause (POST /pause); check before taking work
- ``draining`` / ``wait_draining()``: shutdown has begun; stop admitting work, finish
  what is in flight and return. A consumer needs no check: its inbox ends
  (``EndOfChannel``) once every producer has returned.
- ``on_checkpoint(hook)``: ``async () -> bytes | msgspec-encodable``; the kernel writes
  its result into every periodic and the final checkpoint
- ``restored`` / ``restored_as(T)``: this actor's state from the newest checkpoint
  (at a restart after a crash: the state most recently checkpointed)
- ``mount(prefix, app, auth=True, roles=())``: serve an ASGI app on the control plane,
  open to the admin token and issued tokens of `roles` (daemon/credentials.py)
- ``credentials``: the daemon's token store, for an app mounted with ``auth=False`` that
  authenticates by itself (the fleet join: ``credentials.identify(token)``)
- ``report_version(key, value)``: shown under the actor in /status
- ``request_shutdown(reason)``: begin the daemon's graceful shutdown, as SIGTERM does
  (an actor that has finished the run's work, e.g. a trainer at its step budget)
- ``await request_checkpoint(reason)``: run every hook and write one checkpoint now
  (e.g. at a step boundary); returns once it is on disk
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar, overload

import msgspec
import trio

from .faults import WrongHandle

__all__ = ["ActorContext", "CheckpointHook", "Gate", "WrongHandle"]

H = TypeVar("H")


def _protocol_members(kind: type) -> list[str]:
    """The public attributes a Protocol asks for (empty for a plain class)."""
    if not getattr(kind, "_is_protocol", False):
        return []
    names: set[str] = set()
    for base in kind.__mro__:
        if base.__name__ in ("Protocol", "Generic", "object"):
            continue
        names.update(n for n in (*vars(base), *getattr(base, "__annotations__", {})) if not n.startswith("_"))
    return sorted(names)

T = TypeVar("T")
CheckpointHook = Callable[[], Awaitable[Any]]


class Gate:
    """Open/closed flag that tasks can wait on (used for pause/resume)."""

    def __init__(self) -> None:
        self._open = trio.Event()
        self._open.set()

    @property
    def closed(self) -> bool:
        return not self._open.is_set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        while not self._open.is_set():
            await self._open.wait()


class ActorContext:
    """The kernel's API for one incarnation of one actor (built by the supervisor)."""

    def __init__(self, *, name: str, kernel: Any, inbox: trio.MemoryReceiveChannel[Any],
                 state_dir: Path, restored: Any, incarnation: int, log: Any,
                 metrics: Any, previous_handle: Any = None) -> None:
        self.name = name
        self.previous_handle = previous_handle
        self._kernel = kernel
        self.inbox = inbox
        self.state_dir = state_dir
        self.restored = restored
        self.incarnation = incarnation
        self.log = log
        self.metrics = metrics
        self._senders: list[trio.MemorySendChannel[Any]] = []
        self._holding: set[str] = set()  # actors whose handle this incarnation holds

    @property
    def run_id(self) -> str:
        return self._kernel.run_id

    @property
    def instance_id(self) -> str:
        return self._kernel.instance_id

    @property
    def daemon_dir(self) -> Path:
        """The daemon's state directory (``ctx.state_dir`` is this actor's own subdirectory)."""
        return self._kernel.state.path

    def clock(self) -> float:
        """The kernel's monotonic clock in seconds (``time.monotonic`` unless injected)."""
        return self._kernel.clock()

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking `fn(*args)` the kernel's way (a worker thread unless injected)."""
        return await self._kernel.run_blocking(fn, *args)

    # -- messaging ----------------------------------------------------------------
    def sender(self, name: str) -> trio.MemorySendChannel[Any]:
        """A send channel into actor `name`'s inbox (closed when this incarnation ends).

        Raises KeyError for an unknown actor, ``trio.ClosedResourceError`` once the
        daemon is draining (no new producers then).
        """
        chan = self._kernel.inbox_sender(name).clone()
        self._senders.append(chan)
        return chan

    @overload
    async def handle(self, name: str) -> Any: ...

    @overload
    async def handle(self, name: str, kind: type[H]) -> H: ...

    async def handle(self, name: str, kind: type[Any] | None = None) -> Any:
        """The handle actor `name` passed to ``task_status.started(handle)``.

        Waits until that actor has started (again, while it restarts after a crash).
        From then on this incarnation counts as a producer of `name`'s inbox (see the
        module docstring). Raises KeyError for an unknown actor, and ValueError when
        `name` starts after this actor while this one is still starting (it would wait
        for ever: list `name` in this actor's ``after``). With `kind` (a class, or a
        ``runtime_checkable`` Protocol of what this actor calls), the handle must be one:
        else `faults.WrongHandle` naming both actors and what is missing.
        """
        handle = await self._kernel.wait_handle(name, asker=self.name)
        if kind is not None and not isinstance(handle, kind):
            missing = [a for a in _protocol_members(kind) if not hasattr(handle, a)]
            lacks = f" (it has no {', '.join(missing)})" if missing else ""
            raise WrongHandle(f"actor {self.name!r} needs actor {name!r} to be a {kind.__name__}, but its handle "
                              f"is a {type(handle).__name__}{lacks}: check which actor the config names here")
        if name not in self._holding:
            try:
                chan = self._kernel.inbox_sender(name).clone()
            except trio.ClosedResourceError:
                pass  # draining: no new producers; the handle is usable while it serves
            else:
                self._holding.add(name)
                self._senders.append(chan)
        return handle

    # -- pause and drain ----------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._kernel.gate.closed

    async def wait_unpaused(self) -> None:
        """Return at once when not paused; otherwise when resumed (or draining)."""
        if not self._kernel.gate.closed:
            await trio.lowlevel.checkpoint()
            return
        async with trio.open_nursery() as nursery:
            async def until_draining() -> None:
                await self._kernel.draining_event.wait()
                nursery.cancel_scope.cancel()
            nursery.start_soon(until_draining)
            await self._kernel.gate.wait_open()
            nursery.cancel_scope.cancel()

    @property
    def draining(self) -> bool:
        return self._kernel.draining_event.is_set()

    async def wait_draining(self) -> None:
        await self._kernel.draining_event.wait()

    # -- checkpoints --------------------------------------------------------------
    def on_checkpoint(self, hook: CheckpointHook) -> None:
        """Register (or replace) this actor's checkpoint hook."""
        self._kernel.set_hook(self.name, hook)

    def restored_as(self, typ: type[T]) -> T | None:
        """`restored` converted to `typ` (a msgspec Struct or any msgspec type)."""
        if self.restored is None:
            return None
        if isinstance(self.restored, bytes) and typ is not bytes:
            return msgspec.msgpack.decode(self.restored, type=typ)
        return msgspec.convert(self.restored, typ)

    # -- control plane ------------------------------------------------------------
    def mount(self, prefix: str, app: Any, *, auth: bool = True, roles: tuple[str, ...] = ()) -> None:
        self._kernel.mounts.add(prefix, app, auth=auth, owner=self.name, roles=roles)

    @property
    def credentials(self) -> Any:
        """The daemon's `CredentialStore` (None in a kernel without one)."""
        return getattr(self._kernel, "credentials", None)

    def report_version(self, key: str, value: Any) -> None:
        self._kernel.report_version(self.name, key, value)

    def daemon_status(self) -> dict[str, Any]:
        """The daemon's ``/status`` body (run, phase, checkpoint, every actor's state,
        restarts, last error, reports and statistics), as `fleetrl status` shows it."""
        return self._kernel.status()

    # -- asking the kernel ----------------------------------------------------------
    def request_shutdown(self, reason: str) -> None:
        """Begin the daemon's graceful shutdown (the same path as SIGTERM; idempotent).

        Returns at once; drain follows the supervisor's shutdown contract, so this
        actor's own inbox ends and ``draining`` becomes true like everyone else's.
        The log line ``shutdown requested`` names this actor and ``reason``.
        """
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"request_shutdown: reason must be a non-empty string, got {reason!r}")
        self._kernel.request_shutdown(f"requested by actor {self.name!r}: {reason}")

    def halt(self, reason: str) -> None:
        """Stop the run on an error no restart can fix (a restart would meet it again):
        the daemon drains as on SIGTERM, writes its final checkpoint and exits with
        ``ExitCode.HALTED`` (7); the log's ``run halted`` line and /status name this actor
        and ``reason``. Say what is wrong and how to fix it in ``reason``."""
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"halt: reason must be a non-empty string, got {reason!r}")
        self._kernel.halt(self.name, reason)

    async def request_checkpoint(self, reason: str) -> None:
        """Run every actor's checkpoint hook and write one daemon checkpoint now.

        Returns once the file is written (serialised with periodic checkpoints).
        Never call it while holding a lock that this actor's own hook takes.
        A write error (disk full) is raised as OSError; the previous checkpoint stays.
        """
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"request_checkpoint: reason must be a non-empty string, got {reason!r}")
        await self._kernel.checkpoint(f"requested by actor {self.name!r}: {reason}")

    # -- kernel side --------------------------------------------------------------
    def _close(self) -> None:
        for chan in self._senders:
            chan.close()
        self._senders.clear()
        self.inbox.close()

"""Collecting the actors' checkpoint hooks into one daemon checkpoint file.

`Checkpointer` holds each actor's hook and its last checkpointed state. `write` runs
the hooks (producers first, see `hooks_producers_first`) within the timeout and
writes one atomic file; a hook that raises, times out or returns something msgpack
cannot encode keeps its previous state, so nothing already checkpointed is lost.
`restore` reads the newest usable file at start.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from .actor import CheckpointHook
from .checkpoint import CheckpointStore

__all__ = ["Checkpointer"]

_encoder = msgspec.msgpack.Encoder()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Checkpointer:
    """The daemon's checkpoint hooks, states and writes (serialised by one lock)."""

    def __init__(self, store: CheckpointStore, *, run_id: str, order: list[str], timeout_s: float,
                 run_blocking: Callable[..., Awaitable[Any]], metrics: Any, log: Any) -> None:
        self.store = store
        self.run_id = run_id
        self.order = {name: i for i, name in enumerate(order)}
        self.timeout_s = timeout_s
        self._blocking = run_blocking
        self._metrics = metrics
        self._log = log
        self.hooks: dict[str, CheckpointHook] = {}
        self.states: dict[str, Any] = {}
        """Each actor's state in the newest checkpoint (what a restarted actor gets)."""
        self.last: dict[str, Any] | None = None
        """The newest checkpoint's seq, time and reason (shown in /status)."""
        self._lock = trio.Lock()

    async def restore(self) -> None:
        ckpt, problems = await self._blocking(self.store.load_latest)
        for problem in problems:
            self._log.warning("checkpoint unusable; falling back to an older one", problem=problem)
        if ckpt is not None:
            self.states = dict(ckpt.actors)
            self.last = {"seq": ckpt.seq, "written_at": ckpt.written_at, "restored": True}
            self._log.info("restored checkpoint", seq=ckpt.seq, actors=sorted(ckpt.actors))

    async def write(self, reason: str) -> None:
        """Run every hook and write one checkpoint (see the module docstring)."""
        async with self._lock:
            t0 = time.monotonic()
            states = dict(self.states)
            with trio.move_on_after(self.timeout_s) as scope:
                for name, hook in self.hooks_producers_first():
                    try:
                        value = await hook()
                        _encoder.encode(value)
                    except Exception as exc:
                        self._metrics.checkpoint_errors.labels(actor=name).inc()
                        self._log.error("checkpoint hook failed; keeping its previous state",
                                        failed_actor=name, error=_describe(exc))
                        continue
                    states[name] = value
            if scope.cancelled_caught:
                self._log.error("checkpoint hooks timed out; writing what was collected", timeout_s=self.timeout_s)
            ckpt = await self._blocking(self.store.write, self.run_id, states)
            self.states = states
            self.last = {"seq": ckpt.seq, "written_at": ckpt.written_at, "reason": reason}
            self._metrics.checkpoints.inc()
            self._metrics.checkpoint_seconds.observe(time.monotonic() - t0)
            self._log.info("checkpoint written", seq=ckpt.seq, reason=reason, actors=sorted(states))

    def hooks_producers_first(self) -> list[tuple[str, CheckpointHook]]:
        """Hooks in reverse start (``after``) order: an actor is captured before the
        actors it was started after. A producer is normally started after its consumer,
        so whatever a producer's state counts as sent was sent before the consumer's
        state is captured: it is in the consumer's snapshot, or still in its inbox
        (where the consumer's hook can take it), never in neither."""
        return sorted(self.hooks.items(), key=lambda item: -self.order.get(item[0], -1))

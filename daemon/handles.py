"""Actor handles, kept by the kernel.

An actor starts with ``task_status.started(handle)``; the supervisor publishes that
handle here for as long as the incarnation runs, and other actors reach it with
``await ctx.handle(name)`` (no module-level registries, so two daemons in one process,
as in tests, never see each other's actors). A handle may be any object; the kernel
reads one method of it, ``statistics()``, which returns a frozen record (a msgspec
Struct, a dataclass, or a mapping) of what the actor has done: /status shows it under
the actor, and /metrics exports its numeric fields as
``fleetrl_actor_statistic{actor="NAME", name="FIELD"}``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import trio

__all__ = ["HandleTable", "numeric_fields", "statistics_of"]


def statistics_of(handle: Any) -> dict[str, Any] | None:
    """``handle.statistics()`` as plain JSON-able data, or None when it has none.

    A ``statistics()`` that raises is reported as ``{"error": "..."}``: status pages
    must not fail because one actor's bookkeeping did.
    """
    fn = getattr(handle, "statistics", None)
    if fn is None:
        return None
    try:
        record = fn()
        if dataclasses.is_dataclass(record) and not isinstance(record, type):
            record = dataclasses.asdict(record)
        data = msgspec.to_builtins(record)
    except Exception as exc:  # noqa: BLE001 - foreign code; shown, not raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    return data if isinstance(data, dict) else {"value": data}


def numeric_fields(stats: Mapping[str, Any]) -> Iterable[tuple[str, float]]:
    """The (name, value) pairs of a statistics record that a gauge can hold."""
    for key, value in stats.items():
        if isinstance(value, bool):
            yield key, float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            yield key, float(value)


class HandleTable:
    """The handle of every running actor, and a way to wait for one."""

    def __init__(self, names: Iterable[str]) -> None:
        self._current: dict[str, Any] = {}
        self._previous: dict[str, Any] = {}
        self._ready = {name: trio.Event() for name in names}

    def publish(self, name: str, handle: Any) -> None:
        """Actor `name` has started with `handle` (None when it passed none)."""
        self._current[name] = handle
        self._ready[name].set()

    def retract(self, name: str) -> None:
        """Actor `name`'s incarnation has ended: waiters wait for the next one."""
        if name in self._current:
            self._previous[name] = self._current.pop(name)
        if self._ready[name].is_set():
            self._ready[name] = trio.Event()

    def previous(self, name: str) -> Any:
        """The handle of `name`'s last incarnation that started (None before any)."""
        return self._previous.get(name)

    async def wait(self, name: str) -> Any:
        while name not in self._current:
            await self._ready[name].wait()
        return self._current[name]

    def statistics(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, handle in self._current.items():
            stats = statistics_of(handle)
            if stats is not None:
                out[name] = stats
        return out

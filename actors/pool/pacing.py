"""Staleness pacing: admit new attempts only while they cannot end up too stale (pure).

The trainer consumes finished attempts ``attempts_per_step`` at a time; after consuming
them it moves to the next version. Attempt number ``i`` (in admission order, counting
from the pacer's start) is therefore trained on at version
``start_version + i // attempts_per_step``, provided finished attempts are released to
the trainer in admission order. Its tokens come from weights no older than
``oldest_version``, the oldest version any sampler that may serve it holds when it is
admitted. So its staleness is bounded by ``max_staleness`` exactly when

    start_version + i // attempts_per_step - oldest_version <= max_staleness.

`Pacer.try_admit` admits an attempt only if that holds (the AReaL-style capacity rule,
written with the fleet's oldest version instead of the trainer's). Nothing is dropped:
an attempt that finishes early waits in the pacer until every earlier one has finished
(or failed), then `Pacer.take_ready` hands it out. A failed attempt still occupies its
place in the order, so later attempts keep their bound.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec

__all__ = ["Admission", "Pacer", "PacingError"]


class PacingError(ValueError):
    """Misuse of the pacer: unknown or duplicate attempt ids, bad versions."""


class Admission(msgspec.Struct, frozen=True):
    """An admitted attempt: its place in the order and the version it will train at."""

    attempt_id: str
    ticket: int
    oldest_version: int
    train_version: int


class _Entry:
    __slots__ = ("admission", "done", "failed", "result")

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.done = False
        self.failed = False
        self.result: Any = None


class Pacer:
    """Admission control with a staleness bound; see the module docstring."""

    def __init__(self, *, max_staleness: int, attempts_per_step: int, start_version: int = 0) -> None:
        if max_staleness < 0:
            raise PacingError(f"max_staleness must be >= 0, got {max_staleness}")
        if attempts_per_step < 1:
            raise PacingError(f"attempts_per_step must be >= 1, got {attempts_per_step}")
        if start_version < 0:
            raise PacingError(f"start_version must be >= 0, got {start_version}")
        self.max_staleness = max_staleness
        self.attempts_per_step = attempts_per_step
        self.start_version = start_version
        self._next_ticket = 0
        self._open: OrderedDict[str, _Entry] = OrderedDict()  # admitted, not yet released
        self.trainer_version = start_version

    def train_version_of(self, ticket: int) -> int:
        return self.start_version + ticket // self.attempts_per_step

    def would_admit(self, oldest_version: int) -> bool:
        """Whether the next attempt, served by weights >= `oldest_version`, fits the bound."""
        return self.train_version_of(self._next_ticket) - oldest_version <= self.max_staleness

    def try_admit(self, attempt_id: str, oldest_version: int) -> Admission | None:
        """Admit `attempt_id` (its tokens come from versions >= `oldest_version`) or return
        None: admitting it now could exceed the bound; try again once the fleet is newer."""
        if attempt_id in self._open:
            raise PacingError(f"attempt {attempt_id!r} is already admitted")
        if oldest_version < 0:
            raise PacingError(f"oldest_version must be >= 0, got {oldest_version}")
        if not self.would_admit(oldest_version):
            return None
        adm = Admission(attempt_id, self._next_ticket, oldest_version, self.train_version_of(self._next_ticket))
        self._next_ticket += 1
        self._open[attempt_id] = _Entry(adm)
        return adm

    def finish(self, attempt_id: str, result: Any = None, *, failed: bool = False) -> None:
        """Record that an admitted attempt finished (or failed); its result is kept."""
        entry = self._open.get(attempt_id)
        if entry is None:
            raise PacingError(f"attempt {attempt_id!r} was not admitted (or was already released)")
        if entry.done:
            raise PacingError(f"attempt {attempt_id!r} already finished")
        entry.done, entry.failed, entry.result = True, failed, result

    def take_ready(self) -> list[tuple[Admission, Any, bool]]:
        """Finished attempts whose predecessors have all finished, in admission order:
        ``(admission, result, failed)``."""
        out = []
        while self._open:
            _, entry = next(iter(self._open.items()))
            if not entry.done:
                break
            self._open.popitem(last=False)
            out.append((entry.admission, entry.result, entry.failed))
        return out

    def advance(self, trainer_version: int) -> None:
        """The trainer reached `trainer_version` (never backwards)."""
        if trainer_version < self.trainer_version:
            raise PacingError(f"trainer version went back from {self.trainer_version} to {trainer_version}")
        self.trainer_version = trainer_version

    @property
    def in_flight(self) -> int:
        return sum(1 for e in self._open.values() if not e.done)

    @property
    def waiting(self) -> int:
        """Finished attempts held until earlier ones finish."""
        return sum(1 for e in self._open.values() if e.done)

"""Staleness pacing: admit new attempts only while they cannot end up too stale (pure).

The trainer consumes finished attempts ``attempts_per_step`` at a time; after consuming
them it moves to the next version. Failed attempts never reach it. So if ``i`` attempts
admitted before this one are not known to have failed, this one is trained on at
version at most ``start_version + i // attempts_per_step`` (exactly that when none of
them fails later), provided finished attempts are released to the trainer in admission
order. Its tokens come from weights no older than ``oldest_version``, which the caller
promises when it admits the attempt (the pool: the oldest version any sampler that may
serve it holds, and it keeps the promise by routing the attempt's requests only to
samplers at least that new, `floor`). So its staleness is bounded when

    start_version + i // attempts_per_step - oldest_version <= allowance <= max_staleness.

`Pacer.try_admit` admits an attempt only if that holds (the AReaL-style capacity rule,
written with the fleet's oldest version instead of the trainer's). Nothing is dropped:
an attempt that finishes early waits in the pacer until every earlier one has finished
(or failed), then `Pacer.take_ready` hands it out. A failed attempt keeps its place in
the release order but gives its training slot back (the trainer will not see it), so
the attempts admitted after it are neither held back by it nor wait for a step that a
missing attempt would never complete.

**The bound, exactly.** If (1) every attempt the trainer consumes was admitted here and
is consumed in release order, ``attempts_per_step`` successful attempts per version, the
version moving only when it consumes (so `advance` never rebases), and (2) every token
of an attempt comes from a version >= the ``oldest_version`` it was admitted with, then
every attempt is consumed at a version ``<= its Admission.train_version`` and its
staleness there, ``consumed version - oldest token version``, is ``<= allowance at its
admission <= max_staleness``, for any interleaving of admissions, completions, failures
and version advances (tests/pool/test_pacing.py checks it with Hypothesis for 4 and 8).

**The allowance.** ``allowance`` starts at ``max_staleness``. When the trainer still
refuses groups as too stale (its own bound may be tighter, the trainer may take fewer
attempts per step than ``attempts_per_step`` assumes, or other producers feed it),
`tighten` lowers it by the excess staleness (at least 1, not below 0): fewer attempts are
generated ahead of the trainer. After a cut, refusals at trainer versions up to the
predicted train version of the last attempt admitted before it are not new evidence
(those attempts were admitted under the old allowance and keep arriving for a while);
later ones cut again. The allowance comes back by one every ``restore_versions`` trainer
versions after the last cut, up to ``max_staleness``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import msgspec
from .errors import PacingError

__all__ = ["Admission", "Pacer", "PacingError"]



class Admission(msgspec.Struct, frozen=True):
    """An admitted attempt: its place in the order and the version it will train at."""

    attempt_id: str
    ticket: int
    """Place in admission order (0, 1, 2, ...)."""
    oldest_version: int
    train_version: int
    """The latest version the trainer can train it at (see the module docstring)."""


class _Entry:
    __slots__ = ("admission", "done", "failed", "result")

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.done = False
        self.failed = False
        self.result: Any = None


class Pacer:
    """Admission control with a staleness bound; see the module docstring."""

    def __init__(self, *, max_staleness: int, attempts_per_step: int, start_version: int = 0,
                 restore_versions: int = 4) -> None:
        if max_staleness < 0:
            raise PacingError(f"max_staleness must be >= 0, got {max_staleness}")
        if attempts_per_step < 1:
            raise PacingError(f"attempts_per_step must be >= 1, got {attempts_per_step}")
        if start_version < 0:
            raise PacingError(f"start_version must be >= 0, got {start_version}")
        if restore_versions < 1:
            raise PacingError(f"restore_versions must be >= 1, got {restore_versions}")
        self.max_staleness = max_staleness
        self.attempts_per_step = attempts_per_step
        self.start_version = start_version
        self.restore_versions = restore_versions
        self._next_ticket = 0
        self._slots = 0  # admitted attempts not known to have failed
        self._open: OrderedDict[str, _Entry] = OrderedDict()  # admitted, not yet released
        self._promised: dict[int, int] = {}  # oldest_version -> attempts in flight admitted with it
        self.trainer_version = start_version
        self.rebased = 0
        """Times `advance` found the prediction behind the trainer and moved it."""
        self.allowance = max_staleness
        """The staleness admissions are held to now (module docstring, "The allowance")."""
        self.cuts = 0
        """Times `tighten` lowered the allowance."""
        self._cut_at: int | None = None  # trainer version of the last cut
        self._after_cut = max_staleness  # the allowance right after it
        self._quiet_until = -1  # refusals at trainer versions up to this one predate the last cut

    def train_version_of(self, slot: int) -> int:
        """The version the trainer is at when it takes the attempt in training slot `slot`."""
        return self.start_version + slot // self.attempts_per_step

    def would_admit(self, oldest_version: int) -> bool:
        """Whether the next attempt, served by weights >= `oldest_version`, fits the bound."""
        return self.train_version_of(self._slots) - oldest_version <= self.allowance

    def try_admit(self, attempt_id: str, oldest_version: int) -> Admission | None:
        """Admit `attempt_id` (its tokens come from versions >= `oldest_version`) or return
        None: admitting it now could exceed the bound; try again once the fleet is newer."""
        if attempt_id in self._open:
            raise PacingError(f"attempt {attempt_id!r} is already admitted")
        if oldest_version < 0:
            raise PacingError(f"oldest_version must be >= 0, got {oldest_version}")
        if not self.would_admit(oldest_version):
            return None
        adm = Admission(attempt_id, self._next_ticket, oldest_version, self.train_version_of(self._slots))
        self._next_ticket += 1
        self._slots += 1
        self._open[attempt_id] = _Entry(adm)
        self._promised[oldest_version] = self._promised.get(oldest_version, 0) + 1
        return adm

    def finish(self, attempt_id: str, result: Any = None, *, failed: bool = False) -> None:
        """Record that an admitted attempt finished (or failed); its result is kept."""
        entry = self._open.get(attempt_id)
        if entry is None:
            raise PacingError(f"attempt {attempt_id!r} was not admitted (or was already released)")
        if entry.done:
            raise PacingError(f"attempt {attempt_id!r} already finished")
        entry.done, entry.failed, entry.result = True, failed, result
        v = entry.admission.oldest_version
        self._promised[v] -= 1
        if not self._promised[v]:
            del self._promised[v]
        if failed:
            self._slots -= 1  # the trainer will never take it: its slot goes to the next one

    @property
    def floor(self) -> int | None:
        """The newest ``oldest_version`` promised to an attempt still in flight (admitted,
        not finished): no request may be served by older weights while it lasts. None
        when no attempt is in flight."""
        return max(self._promised) if self._promised else None

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
        """The trainer reached `trainer_version` (never backwards).

        While every attempt the trainer consumes was admitted here, the prediction is
        never behind the trainer. It is after a restart (a pool started at version 0
        learns that a resumed trainer is at N) or when other producers feed the same
        trainer; then the prediction is rebased so that the next attempt trains no
        earlier than `trainer_version`. (Attempts admitted before the rebase keep their
        prediction; attempts still open here may put the next one a step later than
        predicted, which the trainer's own staleness check catches.) A lowered
        allowance comes back by one every ``restore_versions`` versions."""
        if trainer_version < self.trainer_version:
            raise PacingError(f"trainer version went back from {self.trainer_version} to {trainer_version}")
        self.trainer_version = trainer_version
        behind = trainer_version - self.train_version_of(self._slots)
        if behind > 0:
            self.start_version += behind
            self.rebased += 1
        if self._cut_at is not None:
            regained = (trainer_version - self._cut_at) // self.restore_versions
            self.allowance = min(self.max_staleness, self._after_cut + regained)

    def tighten(self, excess: int, refused_at: int) -> bool:
        """The trainer, at version `refused_at`, refused a group as `excess` versions
        staler than it accepts: lower the allowance by `excess` (at least 1, not below 0)
        and return True; False (nothing changes) when the refusal is no new evidence:
        `refused_at` is not after the predicted train version of the last attempt
        admitted before the last cut (module docstring)."""
        if refused_at <= self._quiet_until:
            return False
        self.allowance = max(0, self.allowance - max(1, excess))
        self._cut_at, self._after_cut = self.trainer_version, self.allowance
        last = self.train_version_of(self._slots - 1) if self._slots else self.trainer_version
        self._quiet_until = max(self.trainer_version, last)
        self.cuts += 1
        return True

    @property
    def in_flight(self) -> int:
        return sum(1 for e in self._open.values() if not e.done)

    @property
    def waiting(self) -> int:
        """Finished attempts held until earlier ones finish."""
        return sum(1 for e in self._open.values() if e.done)

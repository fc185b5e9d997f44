"""The task cursor: which tasks of the source are finished (pure; checkpointed).

Tasks are numbered in the order the source yields them and taken in that order, but
groups finish out of order (several run at once). The checkpointed state is
``floor`` (every task before it is finished) and ``done`` (finished tasks after it).
A restored cursor takes tasks from ``floor`` again, skipping those in ``done``: a
task whose group was still running (or was abandoned at shutdown) is run again; a
finished one never is.
"""

from __future__ import annotations

import msgspec

__all__ = ["CursorState", "TaskCursor"]


class CursorState(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The checkpointed cursor."""

    floor: int = 0
    done: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.floor < 0:
            raise ValueError(f"CursorState.floor must be >= 0, got {self.floor}")
        if any(d <= self.floor for d in self.done):
            raise ValueError(f"CursorState.done must only hold tasks after floor={self.floor}, got {self.done}")


class TaskCursor:
    """Hands out task numbers and records which are finished."""

    def __init__(self, state: CursorState | None = None) -> None:
        state = state or CursorState()
        self.floor = state.floor
        self.done: set[int] = set(state.done)
        self.next = state.floor
        self.taken: set[int] = set()

    def take(self) -> int:
        """The next task number to run."""
        self.next = max(self.next, self.floor)
        while self.next in self.done:
            self.next += 1
        i = self.next
        self.next += 1
        self.taken.add(i)
        return i

    def finish(self, i: int) -> None:
        """Task `i` is finished (its group was emitted or reported)."""
        if i not in self.taken:
            raise ValueError(f"task {i} was not taken (or finished twice)")
        self.taken.discard(i)
        self.done.add(i)
        while self.floor in self.done:
            self.done.remove(self.floor)
            self.floor += 1

    def release(self, i: int) -> None:
        """Task `i` will not finish in this run (abandoned): it stays due."""
        self.taken.discard(i)

    def state(self) -> CursorState:
        return CursorState(floor=self.floor, done=tuple(sorted(self.done)))

"""Which remote worker holds which task (pure; the actor's bookkeeping).

Tasks are numbered by the `TaskCursor` (checkpointed: a task is finished once its group
reached the trainer, or too many of its attempts failed). A task handed to a worker is
*held* by it until the worker reports it; when the worker is lost (its connection ends)
every task it held is *requeued*: handed out again, before any new task, to whichever
worker asks next. A requeued task keeps its number, so its group keeps its id
(`group_id_of`) and a copy that reaches the trainer twice is refused there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from fleetrl.actors.envworker.cursor import TaskCursor

__all__ = ["Held", "TaskBook"]


@dataclass
class Held:
    """One task out on a worker."""

    index: int
    task: Any
    group_id: str
    worker: str
    paced: Any = None
    """Its place in the pool's pacer (`pacing.Paced`), when groups are paced."""


@dataclass
class TaskBook:
    cursor: TaskCursor
    held: dict[int, Held] = field(default_factory=dict)
    requeued: deque[tuple[int, Any]] = field(default_factory=deque)
    reruns: int = 0
    """Tasks requeued (to be handed out again) after their worker was lost or gave them up."""

    def next_index(self) -> tuple[int, Any]:
        """The next task to hand out: ``(index, task)`` of a requeued one, else ``(index,
        None)`` for the cursor's next number (the caller looks its task up, then calls
        `hold`, `exhausted` or `put_back`)."""
        if self.requeued:
            return self.requeued.popleft()
        return self.cursor.take(), None

    def put_back(self, index: int, task: Any = None) -> None:
        """A task taken with `next_index` but never held (its worker went away while its
        task was being looked up): it is the next one handed out."""
        self.requeued.appendleft((index, task))

    def hold(self, index: int, task: Any, group_id: str, worker: str) -> Held:
        if index in self.held:
            raise ValueError(f"task {index} is already held by {self.held[index].worker}")
        h = Held(index=index, task=task, group_id=group_id, worker=worker)
        self.held[index] = h
        return h

    def exhausted(self, index: int) -> None:
        """The source has no task `index`: it stays due (a restart looks again)."""
        self.cursor.release(index)

    def of_group(self, group_id: str, worker: str) -> Held | None:
        """The task `worker` holds whose group is `group_id`, or None."""
        for h in self.held.values():
            if h.group_id == group_id and h.worker == worker:
                return h
        return None

    def finish(self, index: int, worker: str) -> Held | None:
        """`worker` is done with task `index` (given up, or its group delivered): finished
        in the cursor. None (and nothing changes) when `worker` does not hold it."""
        h = self.hand_in(index, worker)
        if h is not None:
            self.cursor.finish(index)
        return h

    def hand_in(self, index: int, worker: str) -> Held | None:
        """`worker` handed in task `index`'s group: no longer held (a loss of the worker
        does not requeue it), but finished in the cursor only once the group is delivered
        (`cursor.finish`); until then a restart runs it again (its copy is a duplicate)."""
        h = self.held.get(index)
        if h is None or h.worker != worker:
            return None
        del self.held[index]
        return h

    def requeue(self, index: int, worker: str) -> Held | None:
        """`worker` gave task `index` up unfinished: it is handed out again."""
        h = self.held.get(index)
        if h is None or h.worker != worker:
            return None
        del self.held[index]
        self.requeued.append((index, h.task))
        self.reruns += 1
        return h

    def lost(self, worker: str) -> list[Held]:
        """`worker` is gone: every task it held is requeued (in task order)."""
        gone = sorted((h for h in self.held.values() if h.worker == worker), key=lambda h: h.index)
        for h in gone:
            self.requeue(h.index, worker)
        return gone

    def held_by(self, worker: str) -> int:
        return sum(1 for h in self.held.values() if h.worker == worker)

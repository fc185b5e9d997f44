"""The remote workers' task book (actors/workers/book.py, pure): a lost worker's tasks
are handed out again before new ones, keep their numbers (so their group ids), and every
task is finished exactly once however workers come, go and report."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.envworker.cursor import CursorState, TaskCursor
from fleetrl.actors.workers.book import TaskBook


def _take(book: TaskBook, worker: str) -> int:
    index, task = book.next_index()
    task = task or f"task-{index}"
    book.hold(index, task, f"{task}#{index}@remote", worker)
    return index


def test_a_lost_worker_s_tasks_go_out_again_first_with_the_same_group_ids():
    book = TaskBook(TaskCursor())
    assert [_take(book, "a") for _ in range(3)] == [0, 1, 2]
    assert _take(book, "b") == 3
    assert book.finish(1, "a") is not None
    gone = book.lost("a")
    assert [h.index for h in gone] == [0, 2] and book.held_by("a") == 0
    assert book.next_index() == (0, "task-0") and book.next_index() == (2, "task-2")
    assert book.next_index() == (4, None)
    assert book.reruns == 2


def test_a_report_from_a_worker_that_does_not_hold_the_task_changes_nothing():
    book = TaskBook(TaskCursor())
    _take(book, "a")
    assert book.finish(0, "b") is None and book.requeue(0, "b") is None
    assert book.of_group("task-0#0@remote", "b") is None
    assert book.of_group("task-0#0@remote", "a").index == 0
    assert book.finish(0, "a") is not None and book.finish(0, "a") is None
    assert book.cursor.state() == CursorState(floor=1)


def test_unfinished_tasks_stay_due_in_the_checkpointed_cursor():
    book = TaskBook(TaskCursor())
    for w in "aab":
        _take(book, w)
    book.finish(2, "b")
    book.lost("a")  # 0 and 1 requeued, not finished
    state = book.cursor.state()
    assert state == CursorState(floor=0, done=(2,))
    restored = TaskCursor(state)
    assert [restored.take(), restored.take(), restored.take()] == [0, 1, 3]


def test_an_exhausted_source_leaves_the_number_due():
    book = TaskBook(TaskCursor())
    index, _ = book.next_index()
    book.exhausted(index)
    assert book.cursor.state() == CursorState(floor=0)


events = st.lists(st.tuples(st.sampled_from(["take", "finish", "abandon", "lose"]), st.integers(0, 2),
                            st.integers(0, 50)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(events)
def test_every_task_finishes_exactly_once_whatever_workers_do(evs):
    book = TaskBook(TaskCursor())
    finished: list[int] = []
    for kind, w, pick in evs:
        worker = f"w{w}"
        mine = sorted(i for i, h in book.held.items() if h.worker == worker)
        if kind == "take":
            _take(book, worker)
        elif kind in ("finish", "abandon") and mine:
            i = mine[pick % len(mine)]
            if kind == "finish":
                assert book.finish(i, worker) is not None
                finished.append(i)
            else:
                assert book.requeue(i, worker) is not None
        elif kind == "lose":
            book.lost(worker)
    # the survivors finish everything that was handed out (requeued tasks too)
    while book.held or book.requeued:
        for i, h in list(book.held.items()):
            book.finish(i, h.worker)
            finished.append(i)
        while book.requeued:
            i = _take(book, "closer")
            book.finish(i, "closer")
            finished.append(i)
    assert len(finished) == len(set(finished))  # never twice
    taken = book.cursor.next
    assert sorted(finished) == list(range(taken))  # nothing lost
    assert book.cursor.state() == CursorState(floor=taken)


def test_a_task_put_back_before_it_was_held_goes_out_next_and_is_not_a_rerun():
    book = TaskBook(TaskCursor())
    index, task = book.next_index()
    assert task is None
    book.put_back(index)
    assert _take(book, "a") == 0 and book.reruns == 0  # the same number, looked up again
    assert _take(book, "a") == 1
    assert book.finish(0, "a") and book.finish(1, "a")
    assert book.cursor.state() == CursorState(floor=2)


def test_a_handed_in_group_is_neither_requeued_nor_finished_until_it_is_delivered():
    book = TaskBook(TaskCursor())
    _take(book, "a")
    assert book.hand_in(0, "a") is not None and book.hand_in(0, "a") is None
    assert book.lost("a") == [] and not book.requeued  # the worker went away: its group is on its way
    assert book.cursor.state() == CursorState(floor=0)  # a restart now would run it again
    book.cursor.finish(0)  # delivered to the trainer
    assert book.cursor.state() == CursorState(floor=1)

"""Task sources: task number i -> `Task` (the worker's cursor counts task numbers).

* synthetic: ``make_task(seed, "train", i)``, infinite and deterministic;
* tool_lookup: ``make_tool_task(seed, "train", i)``, likewise;
* jsonl / humaneval: the i-th task of the loaded list, modulo its length when
  ``repeat`` (so an epoch is one pass), else None past the end (the source is done).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetrl.harness.humaneval_tasks import load_humaneval_tasks
from fleetrl.harness.synthetic import make_task
from fleetrl.harness.synthetic_tools import make_tool_task
from fleetrl.harness.tasks import Task, load_tasks_jsonl

from .config import HumanEvalTasks, JsonlTasks, SyntheticTasks, TaskSourceConfig, ToolLookupTasks

__all__ = ["TaskSource", "open_task_source"]


class TaskSource:
    """Numbered tasks of one configured source."""

    def __init__(self, describe: str, *, seed: int | None = None, tasks: list[Task] | None = None,
                 repeat: bool = True, make: Callable[[int, str, int], Task] = make_task) -> None:
        self.describe = describe
        self._seed = seed
        self._make = make
        self._tasks = tasks
        self._repeat = repeat

    def get(self, i: int) -> Task | None:
        """Task number `i`, or None when the source has no more tasks."""
        if self._tasks is None:
            assert self._seed is not None
            return self._make(self._seed, "train", i)
        if not self._tasks:
            return None
        if i >= len(self._tasks) and not self._repeat:
            return None
        return self._tasks[i % len(self._tasks)]


def open_task_source(cfg: TaskSourceConfig, log: Any) -> TaskSource:
    """Load the configured source (blocking: reads files). Invalid JSONL records are
    logged one by one and counted; a file with no valid task is an error."""
    if isinstance(cfg, SyntheticTasks):
        return TaskSource(f"synthetic(seed={cfg.seed})", seed=cfg.seed)
    if isinstance(cfg, ToolLookupTasks):
        return TaskSource(f"tool_lookup(seed={cfg.seed})", seed=cfg.seed, make=make_tool_task)
    if isinstance(cfg, JsonlTasks):
        report = load_tasks_jsonl(cfg.path)
        for err in report.errors:
            log.warning("invalid task record skipped", error=str(err))
        log.info("tasks loaded", path=cfg.path, valid=report.n_valid, invalid=report.n_invalid)
        if not report.tasks:
            raise ValueError(f"tasks.path {cfg.path!r}: no valid task ({report.n_invalid} invalid record(s))")
        return TaskSource(f"jsonl({cfg.path})", tasks=list(report.tasks), repeat=cfg.repeat)
    assert isinstance(cfg, HumanEvalTasks)
    tasks = load_humaneval_tasks(ids=cfg.ids)
    log.info("tasks loaded", source="humaneval", valid=len(tasks))
    return TaskSource("humaneval", tasks=tasks, repeat=cfg.repeat)

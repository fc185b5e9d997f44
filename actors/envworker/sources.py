"""Task sources: task number i -> `Task` (the worker's cursor counts task numbers).

* synthetic: ``make_task(seed, "train", i)``, infinite and deterministic;
* tool_lookup: ``make_tool_task(seed, "train", i)``, likewise;
* ingested: tasks posted to the ingest actor while the daemon runs, first, then a base
  source's (`ingested.IngestedSource`; the worker awaits its ``wait_get``);
* jsonl / humaneval / harbor: the i-th task of the loaded list, modulo its length
  when ``repeat`` (so an epoch is one pass), else None past the end (the source is
  done). Harbor task directories are read and their images built at load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetrl.harness.humaneval_tasks import load_humaneval_tasks
from fleetrl.harness.synthetic import make_task
from fleetrl.harness.synthetic_tools import make_tool_task
from fleetrl.harness.tasks import Task, load_tasks_jsonl

from .config import HarborTasks, HumanEvalTasks, IngestedTasks, JsonlTasks, SyntheticTasks, TaskSourceConfig, ToolLookupTasks

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


def open_task_source(cfg: TaskSourceConfig, log: Any, *, daemon_dir: Any = None, state_dir: Any = None) -> Any:
    """Load the configured source (blocking: reads files). Invalid JSONL records are
    logged one by one and counted; a file with no valid task is an error. ``ingested``
    needs the daemon's and the worker's state directories (`ingested.IngestedSource`)."""
    if isinstance(cfg, IngestedTasks):
        return _open_ingested(cfg, log, daemon_dir, state_dir)
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
    if isinstance(cfg, HarborTasks):
        return _open_harbor(cfg, log)
    assert isinstance(cfg, HumanEvalTasks)
    tasks = load_humaneval_tasks(ids=cfg.ids)
    log.info("tasks loaded", source="humaneval", valid=len(tasks))
    return TaskSource("humaneval", tasks=tasks, repeat=cfg.repeat)


def _open_harbor(cfg: HarborTasks, log: Any) -> TaskSource:
    """Read every Harbor task directory of `cfg` and build its image (blocking: Docker).
    A directory that cannot be read or whose image cannot be had is logged and skipped;
    none left is an error."""
    import docker

    from fleetrl.harness.errors import TaskError
    from fleetrl.harness.harbor import find_harbor_dirs
    from fleetrl.harness.harbor_load import load_built_harbor_task
    from fleetrl.sandboxes.harbor_image import HarborImageError

    client = docker.from_env()
    tasks: list[Task] = []
    dirs = find_harbor_dirs(cfg.paths)
    for path in dirs:
        try:
            task, image = load_built_harbor_task(path, cfg.image_map, client=client)
            if image is not None:  # None: an exported fleetrl task, which keeps its image
                if log is not None:
                    log.info("harbor image ready", task=task.id, image=image.tag, built=image.built,
                             seconds=round(image.seconds, 1))
        except (TaskError, HarborImageError) as exc:
            if log is not None:
                log.warning("harbor task skipped", path=path, error=str(exc))
            continue
        tasks.append(task)
    if log is not None:
        log.info("tasks loaded", source="harbor", valid=len(tasks), skipped=len(dirs) - len(tasks))
    if not tasks:
        raise ValueError(f"tasks.paths {list(cfg.paths)!r}: no usable Harbor task ({len(dirs)} directories tried)")
    return TaskSource(f"harbor({', '.join(cfg.paths)})", tasks=tasks, repeat=cfg.repeat)


def _open_ingested(cfg: IngestedTasks, log: Any, daemon_dir: Any, state_dir: Any) -> Any:
    """The ingested tasks of ``<daemon_dir>/<store_dir>``, then ``cfg.base``'s; the
    schedule lives in the worker's ``state_dir``."""
    from pathlib import Path

    from .ingested import IngestedSource

    if daemon_dir is None or state_dir is None:
        raise ValueError("tasks.kind = 'ingested' needs the daemon's state directory (run it in a worker actor)")
    base = open_task_source(cfg.base, log) if cfg.base is not None else None
    source = IngestedSource(Path(daemon_dir) / cfg.store_dir, Path(state_dir) / "ingested-schedule.jsonl",
                            base=base, poll_s=cfg.poll_s, log=log)
    if log is not None:
        log.info("tasks loaded", source="ingested", stored=len(source.tasks), pending=len(source.pending),
                 scheduled=len(source.schedule.entries))
    return source

"""The repository-task actor: makes sure a validated set of repository bug-fix tasks
exists before the environment workers read it.

``fleetrl.actors.repo_tasks:run`` builds the tasks of the configured packages of a bug
file (docs/guides/tasks.md, "Repository tasks from source distributions"): it finds each
sdist in ``sdist_dir`` (downloading it with pip the first time), builds the tasks,
checks each in a sandbox (doing nothing scores 0, the reference fix 1) and writes the
kept ones to ``out`` with a key beside it (``out`` + ``.key``: the hash of the sdists,
the bug file, the image and ``validate``). A later start whose key matches reuses the
file, so a restart costs no sandbox. It reports started only once the file is there,
holds no state, reads no messages and idles until the daemon drains. A set with no task
kept is an error (the reasons are logged).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Never

import msgspec
import trio

from fleetrl.daemon.actor import ActorContext
from fleetrl.daemon.files import write_atomic
from fleetrl.harness.repo_tasks import RepoTask, build_repo_tasks
from fleetrl.harness.repo_tasks_check import Rejected, validate_repo_tasks
from fleetrl.harness.repo_tasks_sdist import bundled_bug_text, fetch_sdist, load_bug_file, read_sdist
from fleetrl.harness.task_codec import dump_tasks_jsonl
from fleetrl.sandboxes import Engine, Ownership

from .config import RepoTasksConfig

__all__ = ["Inbox", "RepoTasksHandle", "RepoTasksStatistics", "run"]

Inbox = Never
"""The repository-task actor takes no messages."""

_FORMAT = "fleetrl-repo-tasks-1"


class RepoTasksStatistics(msgspec.Struct, frozen=True, kw_only=True):
    tasks: int
    """Tasks in the file."""
    rejected: int
    """Tasks left out by the check (0 when the file was reused)."""
    reused: bool
    """The file of an earlier start was reused (its key matched)."""
    seconds: float


class RepoTasksHandle:
    def __init__(self, tasks: int, rejected: int, reused: bool, seconds: float) -> None:
        self.tasks, self.rejected, self.reused, self.seconds = tasks, rejected, reused, seconds

    def statistics(self) -> RepoTasksStatistics:
        return RepoTasksStatistics(tasks=self.tasks, rejected=self.rejected, reused=self.reused,
                                   seconds=round(self.seconds, 3))


def _build(cfg: RepoTasksConfig) -> tuple[list[RepoTask], str]:
    """Every task of the configured packages, and the key of the set (blocking)."""
    specs = load_bug_file(cfg.bugs)
    names = cfg.packages if cfg.packages is not None else tuple(specs)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise ValueError(f"repo_tasks.packages: {', '.join(unknown)} not in the bug file "
                         f"{cfg.bugs or '(bundled)'}, which declares {', '.join(specs)}")
    h = hashlib.sha256(_FORMAT.encode())
    h.update((bundled_bug_text() if cfg.bugs is None else Path(cfg.bugs).read_text(encoding="utf-8")).encode())
    h.update(f"\0{cfg.image}\0{cfg.validate}\0{','.join(names)}".encode())
    built: list[RepoTask] = []
    for name in names:
        spec = specs[name]
        path = fetch_sdist(spec.name, spec.version, cfg.sdist_dir)
        h.update(hashlib.sha256(path.read_bytes()).digest())
        built += build_repo_tasks(read_sdist(path), spec, image=cfg.image)
    return built, h.hexdigest()


def _count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


async def run(cfg: RepoTasksConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[RepoTasksHandle] = trio.TASK_STATUS_IGNORED) -> None:
    """Ensure the task file, start, idle until drained."""
    t0 = trio.current_time()
    out = Path(cfg.out)
    key_file = out.with_name(out.name + ".key")
    built, key = await trio.to_thread.run_sync(_build, cfg, abandon_on_cancel=True)
    rejected: list[Rejected] = []
    reused = out.is_file() and key_file.is_file() and key_file.read_text().strip() == key
    if reused:
        n = await trio.to_thread.run_sync(_count_lines, out)
    else:
        kept = built
        if cfg.validate:
            ctx.log.info("checking repository tasks in sandboxes", tasks=len(built), concurrency=cfg.concurrency)
            ownership = Ownership.for_state_dir(ctx.daemon_dir, owner=ctx.instance_id, run=ctx.run_id)
            result = await validate_repo_tasks(built, Engine(), ownership=ownership, concurrency=cfg.concurrency)
            kept, rejected = result.kept, result.rejected
            for r in rejected:
                ctx.log.warning("repository task rejected", task_id=r.task_id, reason=r.reason)
        if not kept:
            raise ValueError(f"repo_tasks: no task of {len(built)} was kept (the reasons are in the log)")
        out.parent.mkdir(parents=True, exist_ok=True)
        n = await trio.to_thread.run_sync(dump_tasks_jsonl, [rt.task for rt in kept], out)
        await trio.to_thread.run_sync(write_atomic, key_file, (key + "\n").encode())
    seconds = trio.current_time() - t0
    ctx.report_version("repo_tasks", key[:16])
    ctx.log.info("repository tasks ready", out=str(out), tasks=n, rejected=len(rejected), reused=reused,
                 seconds=round(seconds, 1))
    task_status.started(RepoTasksHandle(n, len(rejected), reused, seconds))
    await ctx.wait_draining()



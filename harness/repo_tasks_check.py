"""Which repository tasks are kept: each is checked in a real sandbox when the set is built.

A `repo_tasks.RepoTask` is kept only if, in a fresh sandbox built by its setup, the
evaluator scores exactly 0 when the agent does nothing, and exactly 1 after the
reference fix (the bug's file written back with its original text) in the same
sandbox. Every other outcome (a setup command failed, an evaluator output that is no
reward, a partial score) rejects the task with the reason. One sandbox per task, at
most ``concurrency`` at a time; every sandbox is removed, also on cancellation.
"""

from __future__ import annotations

import posixpath

import msgspec
import trio

from fleetrl.sandboxes import Engine, Limits as SandboxLimits, Ownership, open_sandbox

from .errors import EvaluatorOutputError, SetupFailed
from .protocol import evaluate_in_sandbox, prepare_sandbox
from .repo_tasks import RepoTask

__all__ = ["Rejected", "Validation", "check_repo_task", "validate_repo_tasks"]


class Rejected(msgspec.Struct, frozen=True, kw_only=True):
    """A task left out of the set, and why."""

    task_id: str
    reason: str


class Validation(msgspec.Struct, frozen=True, kw_only=True):
    """The tasks kept (in input order) and the ones rejected."""

    kept: list[RepoTask]
    rejected: list[Rejected]


async def check_repo_task(rt: RepoTask, engine: Engine, *, ownership: Ownership,
                          limits: SandboxLimits | None = None) -> str | None:
    """Why ``rt`` must be rejected, or None when it is kept (module docstring)."""
    task = rt.task
    limits = limits or SandboxLimits(workdir=task.workdir)
    async with open_sandbox(engine, image=task.image, limits=limits, ownership=ownership) as sb:
        try:
            await prepare_sandbox(task, sb)
        except SetupFailed as err:
            return f"setup failed: {err}"
        try:
            untouched, _, out = await evaluate_in_sandbox(task, sb)
            if untouched != 0.0:
                return f"doing nothing scores {untouched:g}, must be 0: {out.strip().splitlines()[-1:]}"
            await sb.write_files({posixpath.join(task.workdir, p): text for p, text in rt.fix.items()})
            fixed, _, out = await evaluate_in_sandbox(task, sb)
        except EvaluatorOutputError as err:
            return f"the evaluator printed no reward: {err}"
        if fixed != 1.0:
            return f"the reference fix scores {fixed:g}, must be 1: {out.strip().splitlines()[-1:]}"
    return None


async def validate_repo_tasks(tasks: list[RepoTask], engine: Engine, *, ownership: Ownership,
                              concurrency: int = 2) -> Validation:
    """Check every task (`check_repo_task`); keep those that pass."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    reasons: dict[int, str | None] = {}
    limiter = trio.CapacityLimiter(concurrency)

    async def one(i: int, rt: RepoTask) -> None:
        async with limiter:
            reasons[i] = await check_repo_task(rt, engine, ownership=ownership)

    async with trio.open_nursery() as nursery:
        for i, rt in enumerate(tasks):
            nursery.start_soon(one, i, rt)
    kept = [rt for i, rt in enumerate(tasks) if reasons[i] is None]
    rejected = [Rejected(task_id=rt.task.id, reason=reasons[i] or "") for i, rt in enumerate(tasks)
                if reasons[i] is not None]
    return Validation(kept=kept, rejected=rejected)

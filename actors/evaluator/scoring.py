"""Scoring evaluation completions inside one Docker sandbox (model code never runs on
the host).

The recipe's batched checker driver (`fleetrl.actors.recipe.evaluate`: one
``python3 -I -S`` process that forks once per task and runs the task's own checker in
its directory) runs *inside* a leased sandbox. `bundle_files` lays out every task's
setup files and ``solution.py`` (prompt + completion) under ``e/<i>/``, plus the driver
and a small wrapper; `score_in_sandbox` writes them (one tar) and runs the wrapper (one
exec), which prints one JSON line: per task, the checker's exit status and the tail of
its stdout. `rewards_from_report` turns that into rewards with the task's own
`reward_from_evaluator`, as the environment workers' evaluator does.

A checker killed at its timeout (status -9) or whose output cannot be read scores 0.0
and is counted in `SandboxScores.errors` (a completion that hangs fails its task).
"""

from __future__ import annotations

from importlib import resources

import json
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from fleetrl.actors.recipe.evaluate import CHECKER_DRIVER, CHECKER_STDOUT_FILE
from fleetrl.harness.synthetic import CHECK_FILE, SOLUTION_FILE, solution_text
from fleetrl.harness.tasks import EvaluatorOutputError, Task, reward_from_evaluator

from .errors import ScoringError

__all__ = ["SandboxScores", "ScoringError", "bundle_files", "rewards_from_report", "score_in_sandbox"]

ROOT: Final = "e"
DRIVER_FILE: Final = "driver.py"
WRAPPER_FILE: Final = "score.py"
STDOUT_TAIL: Final = 2000

WRAPPER: Final = (resources.files(__package__) / "programs" / "score.py").read_text(encoding="utf-8")
"""The wrapper program run in the sandbox (`programs/score.py`; its docstring has its argv)."""


class SandboxScores(msgspec.Struct, frozen=True, kw_only=True):
    rewards: tuple[float, ...]
    errors: int
    """Tasks whose checker timed out or printed unreadable output (scored 0.0)."""
    seconds: float = 0.0


def bundle_files(tasks: Sequence[Task], completions: Sequence[str]) -> dict[str, str]:
    """Every file the sandbox needs, relative to its work dir (pure)."""
    if len(tasks) != len(completions):
        raise ValueError(f"{len(tasks)} tasks but {len(completions)} completions")
    files: dict[str, str] = {DRIVER_FILE: CHECKER_DRIVER, WRAPPER_FILE: WRAPPER}
    for i, (task, completion) in enumerate(zip(tasks, completions, strict=True)):
        if task.evaluator.command != f"python3 -I -S {CHECK_FILE}" or CHECK_FILE not in task.setup.files:
            raise ValueError(f"task {task.id!r} is not a synthetic task (its evaluator is "
                             f"{task.evaluator.command!r}); the evaluator scores synthetic tasks only")
        for rel, content in task.setup.files.items():
            files[f"{ROOT}/{i}/{rel}"] = content
        files[f"{ROOT}/{i}/{SOLUTION_FILE}"] = solution_text(task, completion)
    return files


def wrapper_argv(n: int, *, parallel: int, timeout_s: float) -> list[str]:
    return ["python3", "-I", "-S", WRAPPER_FILE, ROOT, str(n), str(parallel), repr(timeout_s), CHECK_FILE,
            CHECKER_STDOUT_FILE, str(STDOUT_TAIL)]


def rewards_from_report(tasks: Sequence[Task], stdout: str) -> SandboxScores:
    """Rewards from the wrapper's JSON line (pure). Raises ScoringError when the line is
    missing or malformed, or the driver failed."""
    lines = [x for x in stdout.splitlines() if x.strip()]
    if not lines:
        raise ScoringError("the scoring run printed nothing")
    try:
        report: Any = json.loads(lines[-1])
    except ValueError:
        raise ScoringError(f"the scoring run's output is not JSON: {lines[-1][:300]!r}") from None
    if isinstance(report, dict):
        raise ScoringError(f"the scoring run failed: {report.get('error', report)}")
    if not isinstance(report, list) or len(report) != len(tasks):
        raise ScoringError(f"the scoring run reported {len(report) if isinstance(report, list) else '?'} "
                           f"results for {len(tasks)} tasks")
    rewards: list[float] = []
    errors = 0
    for task, (status, out) in zip(tasks, report, strict=True):
        if not isinstance(status, int) or status == -9:
            rewards.append(0.0)
            errors += 1
            continue
        try:
            rewards.append(reward_from_evaluator(task, status, out))
        except EvaluatorOutputError:
            rewards.append(0.0)
            errors += 1
    return SandboxScores(rewards=tuple(rewards), errors=errors)


async def score_in_sandbox(sandbox: Any, tasks: Sequence[Task], completions: Sequence[str], *,
                           parallel: int = 2, timeout_s: float = 600.0) -> SandboxScores:
    """Write the bundle into ``sandbox`` and run the checker driver there (one exec)."""
    import trio

    if not tasks:
        return SandboxScores(rewards=(), errors=0)
    t0 = trio.current_time()
    per_task = max(t.evaluator.timeout_s for t in tasks)
    await sandbox.write_files(bundle_files(tasks, completions))
    r = await sandbox.exec(wrapper_argv(len(tasks), parallel=parallel, timeout_s=per_task), timeout=timeout_s,
                           workdir=sandbox.limits.workdir, final=True)
    if r.timed_out:
        raise ScoringError(f"scoring {len(tasks)} tasks in the sandbox took longer than {timeout_s:g} s")
    if r.stdout_truncated:
        raise ScoringError("the scoring run's output was cut at the sandbox's stdout cap")
    scores = rewards_from_report(tasks, r.stdout.decode("utf-8", errors="replace"))
    if r.exit_code != 0:
        raise ScoringError(f"the scoring run exited {r.exit_code}: {r.stderr.decode(errors='replace')[-500:]}")
    return msgspec.structs.replace(scores, seconds=trio.current_time() - t0)

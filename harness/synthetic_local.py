"""A synthetic task's checker run on this machine, as a sandbox would run it.

For tests and quick evaluations (the warm-up's pass@1): the real rewards are computed
in Docker sandboxes by the environment workers. `run_check_locally` writes the task's
setup files and a solution into a temporary directory and runs the evaluator command
there; `score_completion_locally` reads the reward from its output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import SyntheticTaskError
from .synthetic_tasks import SOLUTION_FILE, solution_text, target_of
from .tasks import Task, reward_from_evaluator

__all__ = ["LocalCheck", "run_check_locally", "score_completion_locally"]


@dataclass(frozen=True, slots=True)
class LocalCheck:
    """What the evaluator command did when run locally: exit code and stdout."""

    exit_code: int
    stdout: str


def run_check_locally(task: Task, solution: str, *, python: str | None = None) -> LocalCheck:
    """Run a synthetic task's evaluator as the sandbox would, in a temporary
    directory on this machine: setup files written, `solution` written to
    SOLUTION_FILE, the evaluator command run there with `sh -c`.

    `python3` in the command is `python` (default: the interpreter running this code,
    symlinked under a private bin directory first on PATH, so no version-manager
    shim slows each call). Raises SyntheticTaskError for a task that is not
    synthetic or a checker that overruns the evaluator's timeout.
    """
    target_of(task)
    interpreter = os.path.realpath(python if python is not None else sys.executable)
    with tempfile.TemporaryDirectory(prefix="fleetrl-synthetic-") as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        (bin_dir / "python3").symlink_to(interpreter)
        root = Path(tmp) / "work"
        root.mkdir()
        for rel, content in task.setup.files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")
        (root / SOLUTION_FILE).write_text(solution, encoding="utf-8")
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        try:
            done = subprocess.run(
                ["sh", "-c", task.evaluator.command],
                cwd=root,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=task.evaluator.timeout_s,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise SyntheticTaskError(
                f"task {task.id!r}: the checker ran past the evaluator timeout "
                f"({task.evaluator.timeout_s} s)"
            ) from None
    return LocalCheck(done.returncode, done.stdout.decode("utf-8", errors="replace"))


def score_completion_locally(task: Task, completion: str, *, python: str | None = None) -> float:
    """The reward of a model's `completion` for `task`, computed by the task's own
    evaluator in a local subprocess (see `run_check_locally`): the harness's
    SOLUTION_FILE (prompt + completion) is checked and the last stdout line,
    `passed/total`, read by `reward_from_evaluator`.

    For tests and quick evaluations; the real rewards are computed in Docker
    sandboxes by the environment workers. Raises `EvaluatorOutputError` if the
    checker's output is malformed (a checker bug, never the model's fault).
    """
    done = run_check_locally(task, solution_text(task, completion), python=python)
    return reward_from_evaluator(task, done.exit_code, done.stdout)

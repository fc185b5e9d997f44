"""Sampled pass@1 of a model on the synthetic evaluation sets.

pass@1 here: one completion per task, sampled by the torch sampler backend with the
RL phase's sampling settings (temperature 1.0, top_p 0.95 by default), stopped at the
EOS id; a task counts as solved when its completion passes *every* hidden test
(reward 1.0). The evaluation sets are `generate_tasks(n, split="fresh" | "general",
seed=...)` (docs/reference/synthetic-tasks.md). The rate comes with a Wilson 95% interval
(`pass_rate_with_ci`), so comparisons (warm-up vs random init, RL vs warm-up) can
be made with a statistical margin.

Scoring runs each task's own checker (`.synthetic_check.py` from the task's setup)
locally, exactly as the sandbox would run it, but batched: one small driver process
(`python3 -I -S`, like the evaluator command) forks once per task, changes into a
directory holding the task's setup files and `solution.py` (prompt + completion), and
executes the checker script there as `__main__`; its stdout and exit status are read
with `reward_from_evaluator`, as `score_completion_locally` does. A fork of a warm
interpreter costs about a millisecond instead of a ~35 ms interpreter start, so 200
tasks score in about a second. A task whose evaluator command is not the synthetic
checker's is scored with `score_completion_locally`. The daemon computes its rewards
in Docker sandboxes; this is for the recipe's own measurements.
"""

from __future__ import annotations

from importlib import resources

import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgspec
from transformers import PreTrainedTokenizerFast

from fleetrl.actors.model.byte_tokenizer import EOS_ID, build_byte_tokenizer
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.daemon.messages import SamplingParams
from fleetrl.harness.synthetic import (
    CHECK_FILE,
    SOLUTION_FILE,
    Split,
    SyntheticTaskError,
    generate_tasks,
    score_completion_locally,
    solution_text,
)
from fleetrl.harness.tasks import Task, reward_from_evaluator

__all__ = [
    "CHECKER_DRIVER",
    "CHECKER_STDOUT_FILE",
    "EvalResult",
    "EvalSampling",
    "PassRate",
    "evaluate_pass_at_1",
    "pass_rate_with_ci",
    "sample_completions",
    "score_completions",
]

Z_95: Final = 1.959963984540054
"""Standard normal quantile of 0.975 (two-sided 95%)."""

_CHECKER_COMMAND: Final = f"python3 -I -S {CHECK_FILE}"
CHECKER_STDOUT_FILE: Final = ".checker-stdout"

CHECKER_DRIVER: Final = (resources.files(__package__) / "programs" / "checker_driver.py").read_text(encoding="utf-8")
"""The batch driver program (`programs/checker_driver.py`, read at import): runs many
checkers in one sandbox exec; see its docstring for its arguments and output."""


class PassRate(msgspec.Struct, frozen=True, kw_only=True):
    """A pass rate with its Wilson score interval."""

    successes: int
    n: int
    rate: float
    low: float
    high: float
    confidence: float = 0.95

    def __str__(self) -> str:
        return f"{100 * self.rate:.1f}% [{100 * self.low:.1f}, {100 * self.high:.1f}] ({self.successes}/{self.n})"


def pass_rate_with_ci(successes: int, n: int, *, z: float = Z_95) -> PassRate:
    """`successes / n` with its Wilson score interval (95% for the default z).

    Wilson rather than the normal approximation: it stays inside [0, 1] and is
    sensible at 0 or n successes, which a weak model's evaluation often hits.
    Raises ValueError for n < 1, successes outside [0, n] or z <= 0.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if isinstance(successes, bool) or not isinstance(successes, int) or not 0 <= successes <= n:
        raise ValueError(f"successes must be an int in [0, n={n}], got {successes!r}")
    if not (math.isfinite(z) and z > 0):
        raise ValueError(f"z must be finite and > 0, got {z!r}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = (z / (1 + z2 / n)) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    low, high = max(0.0, centre - half), min(1.0, centre + half)
    if successes == 0:
        low = 0.0
    if successes == n:
        high = 1.0
    confidence = math.erf(z / math.sqrt(2))
    return PassRate(successes=successes, n=n, rate=p, low=low, high=high, confidence=confidence)


class EvalSampling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How completions are sampled for pass@1 (defaults: the RL phase's settings)."""

    temperature: float = 1.0
    top_p: float = 0.95
    max_tokens: int = 48
    """Enough for the longest reference body (`    return abs(x - 9)` is 22 bytes)
    plus slack; a completion cut here without <eos> is scored as it is."""
    seed: int = 0
    """Seed of the sampling RNG (chunk i of the batch uses seed + i)."""
    batch_size: int = 100
    """Prompts decoded together by the backend."""

    def __post_init__(self) -> None:
        SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p)
        if self.batch_size < 1:
            raise ValueError(f"EvalSampling.batch_size must be >= 1, got {self.batch_size!r}")
        if not 0 <= self.seed < 2**62:
            raise ValueError(f"EvalSampling.seed must be in [0, 2**62), got {self.seed!r}")


def sample_completions(
    backend: TorchBackend,
    tasks: Sequence[Task],
    sampling: EvalSampling = EvalSampling(),
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
) -> list[tuple[str, bool]]:
    """One sampled completion per task: `<bos>` + prompt bytes in; out, the generated
    text up to (not including) the first EOS, and whether the EOS was generated."""
    tok = tokenizer if tokenizer is not None else build_byte_tokenizer()
    out: list[tuple[str, bool]] = []
    for chunk, start in enumerate(range(0, len(tasks), sampling.batch_size)):
        part = tasks[start:start + sampling.batch_size]
        prompts = []
        for task in part:
            if task.prompt is None:
                raise ValueError(f"task {task.id!r} has no prompt")
            prompts.append(tok(task.prompt, add_special_tokens=True)["input_ids"])
        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop_ids=(EOS_ID,),
            seed=sampling.seed + chunk,
        )
        for gen in backend.generate(prompts, params):
            ids = gen.token_ids.to_numpy().tolist()
            stopped = EOS_ID in ids
            if stopped:
                ids = ids[: ids.index(EOS_ID)]
            out.append((tok.decode(ids, skip_special_tokens=False), stopped))
    return out


def score_completions(
    tasks: Sequence[Task], completions: Sequence[str], *, parallel: int = 2, python: str | None = None
) -> list[float]:
    """The reward of each completion, from its task's own checker run locally.

    Same result as `score_completion_locally(task, completion)` for every task, but
    the synthetic checkers run from one forking driver (module docstring). Raises
    SyntheticTaskError if a checker overruns its evaluator timeout and
    EvaluatorOutputError if a checker's output is malformed.
    """
    if len(tasks) != len(completions):
        raise ValueError(f"{len(tasks)} tasks but {len(completions)} completions")
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel!r}")
    rewards: list[float | None] = [None] * len(tasks)
    batched = [i for i, t in enumerate(tasks) if t.evaluator.command == _CHECKER_COMMAND and CHECK_FILE in t.setup.files]
    for i in sorted(set(range(len(tasks))) - set(batched)):
        rewards[i] = score_completion_locally(tasks[i], completions[i], python=python)
    if batched:
        interpreter = os.path.realpath(python if python is not None else sys.executable)
        timeout = max(tasks[i].evaluator.timeout_s for i in batched)
        with tempfile.TemporaryDirectory(prefix="fleetrl-score-") as tmp:
            dirs = []
            for i in batched:
                task = tasks[i]
                root = Path(tmp) / str(i)
                root.mkdir()
                for rel, content in task.setup.files.items():
                    path = root / rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(content, encoding="utf-8")
                (root / SOLUTION_FILE).write_text(solution_text(task, completions[i]), encoding="utf-8")
                dirs.append(str(root))
            done = subprocess.run(
                [interpreter, "-I", "-S", "-c", CHECKER_DRIVER, str(parallel), repr(timeout), CHECK_FILE],
                input="\n".join(dirs) + "\n",
                capture_output=True,
                text=True,
                check=False,
                timeout=timeout * len(batched) + 60,
            )
            if done.returncode != 0:
                raise RuntimeError(f"the batch checker driver failed (exit {done.returncode}): {done.stderr[-2000:]}")
            statuses = dict(tuple(map(int, line.split())) for line in done.stdout.splitlines() if line.strip())
            for k, i in enumerate(batched):
                status = statuses.get(k)
                if status is None:
                    raise RuntimeError(f"the batch checker driver reported nothing for task {tasks[i].id!r}")
                if status == -9:
                    raise SyntheticTaskError(
                        f"task {tasks[i].id!r}: the checker ran past the evaluator timeout "
                        f"({tasks[i].evaluator.timeout_s} s)"
                    )
                stdout = (Path(dirs[k]) / CHECKER_STDOUT_FILE).read_text(encoding="utf-8", errors="replace")
                rewards[i] = reward_from_evaluator(tasks[i], status, stdout)
    return [r for r in rewards if r is not None]


class EvalResult(msgspec.Struct, frozen=True, kw_only=True):
    """pass@1 of one model on one evaluation set."""

    split: str
    task_seed: int
    pass_at_1: PassRate
    """Tasks whose completion passed every hidden test."""
    mean_reward: float
    """Mean fraction of hidden tests passed (the RL reward)."""
    stopped: float
    """Fraction of completions that ended with EOS (learnt the format)."""
    sample_seconds: float
    score_seconds: float
    rewards: tuple[float, ...]
    completions: tuple[str, ...]


def evaluate_pass_at_1(
    model_dir: str | os.PathLike[str],
    *,
    split: Split,
    n: int,
    task_seed: int,
    sampling: EvalSampling = EvalSampling(),
    backend: TorchBackend | None = None,
) -> EvalResult:
    """Sampled pass@1 of the model saved in `model_dir` (or an already loaded
    `backend`) on `generate_tasks(n, split=split, seed=task_seed)`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if split == "train":
        raise ValueError("split must be an evaluation split ('fresh' or 'general'), not 'train'")
    tasks = generate_tasks(n, split=split, seed=task_seed)
    if backend is None:
        backend = TorchBackend(TorchBackendConfig(model_dir=os.fspath(model_dir)))
    tok = build_byte_tokenizer()
    t0 = time.perf_counter()
    sampled = sample_completions(backend, tasks, sampling, tokenizer=tok)
    completions = [text for text, _ in sampled]
    t1 = time.perf_counter()
    rewards = score_completions(tasks, completions)
    t2 = time.perf_counter()
    solved = sum(1 for r in rewards if r == 1.0)
    return EvalResult(
        split=split,
        task_seed=task_seed,
        pass_at_1=pass_rate_with_ci(solved, n),
        mean_reward=sum(rewards) / n,
        stopped=sum(1 for _, s in sampled if s) / n,
        sample_seconds=t1 - t0,
        score_seconds=t2 - t1,
        rewards=tuple(rewards),
        completions=tuple(completions),
    )

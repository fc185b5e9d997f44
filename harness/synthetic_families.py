"""The families of the synthetic coding tasks and the pure logic that draws one task.

A synthetic task asks for the body of `def f(x):` given a few input/output examples
(see `fleetrl.harness.synthetic` for the Task, the prompt and the evaluator). This
module knows nothing about tasks or sandboxes: it defines the function families, the
split of their parameters between training and the generalisation set, and how the
shown and hidden inputs of one task are drawn from a `random.Random`.

Design points (measured with a prototype on a 2-core CPU; see docs/reference/synthetic-tasks.md):

- Families are one-line integer functions of `x` with one or two small constant
  parameters, so a ~2M-parameter byte-level model can learn them on CPU.
- Look-alike families (abs(x - a), a - x and max(x, a) all give f(0) = a) make the
  reward noisy when the shown examples cannot tell them apart. So every task's shown
  examples are chosen such that exactly one (family, parameters) pair among ALL pairs
  in range -- training and held-out alike -- satisfies them: the answer is always
  identifiable from the prompt (`identifying_candidates` checks this by brute force
  over the small candidate table). x = 0 and x = 1 are always shown, inputs sorted.
  The hidden inputs identify the pair too, so no look-alike earns a full reward.
- The generalisation set uses (family, parameters) pairs that the training
  distribution never draws: each family holds out a few parameter tuples, chosen so
  that every constant still appears in training with other families.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

Split = Literal["train", "fresh", "general"]
SPLITS: Final[tuple[Split, ...]] = ("train", "fresh", "general")

X_MIN: Final = 0
"""Smallest input x of any example (shown or hidden)."""
X_MAX: Final = 20
"""Largest input x of any example (inclusive)."""
ALWAYS_SHOWN: Final[tuple[int, ...]] = (0, 1)
"""Inputs shown in every prompt: they separate the look-alikes and anchor the offset."""
N_SHOWN: Final = 5
"""Number of shown examples per task (ALWAYS_SHOWN plus random distinct inputs)."""
N_HIDDEN: Final = 8
"""Number of hidden tests per task; hidden inputs are never among the shown ones."""
MAX_DRAWS: Final = 1000
"""Attempts at drawing identifying shown inputs before giving up (never reached in
practice: any candidate is identified by some input set; see the tests)."""


@dataclass(frozen=True, slots=True)
class TaskFamilySpec:
    """One family of target functions f(x) = fn(x, *params).

    `expr` is the Python expression (in x, with the parameters as `{a}`, `{b}`) that
    the reference solution returns; `fn` computes the same values directly and is
    checked against `expr` in the tests, so the expected outputs and the reference
    solution come from two independent definitions. `param_ranges` are inclusive
    (lo, hi) per parameter; `held_out` lists the parameter tuples reserved for the
    generalisation set (never drawn for training or fresh tasks).
    """

    name: str
    expr: str
    fn: Callable[..., int] = field(repr=False)
    param_names: tuple[str, ...]
    param_ranges: tuple[tuple[int, int], ...]
    held_out: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.param_names) != len(self.param_ranges):
            raise ValueError(f"family {self.name!r}: {len(self.param_names)} parameter names but "
                             f"{len(self.param_ranges)} ranges")
        for lo, hi in self.param_ranges:
            if lo > hi:
                raise ValueError(f"family {self.name!r}: empty parameter range ({lo}, {hi})")
        all_params = set(self.all_params())
        for params in self.held_out:
            if params not in all_params:
                raise ValueError(f"family {self.name!r}: held-out parameters {params} are out of range")
        if not self.train_params():
            raise ValueError(f"family {self.name!r}: every parameter tuple is held out")

    def all_params(self) -> list[tuple[int, ...]]:
        """Every parameter tuple in range, in lexicographic order."""
        return list(itertools.product(*(range(lo, hi + 1) for lo, hi in self.param_ranges)))

    def train_params(self) -> list[tuple[int, ...]]:
        """Parameter tuples of the training distribution (train and fresh splits)."""
        held = set(self.held_out)
        return [p for p in self.all_params() if p not in held]

    def params_for(self, split: Split) -> list[tuple[int, ...]]:
        """Parameter tuples a task of `split` may use."""
        return list(self.held_out) if split == "general" else self.train_params()

    def expression(self, params: Sequence[int]) -> str:
        """The reference expression with the parameters filled in, e.g. 'x + 3'."""
        return self.expr.format(**dict(zip(self.param_names, params, strict=True)))

    def __call__(self, x: int, params: Sequence[int]) -> int:
        return self.fn(x, *params)


FAMILIES: Final[tuple[TaskFamilySpec, ...]] = (
    TaskFamilySpec("add", "x + {a}", lambda x, a: x + a, ("a",), ((1, 9),), ((7,), (2,))),
    TaskFamilySpec("sub", "x - {a}", lambda x, a: x - a, ("a",), ((1, 9),), ((4,), (8,))),
    TaskFamilySpec("rsub", "{a} - x", lambda x, a: a - x, ("a",), ((1, 9),), ((6,), (1,))),
    TaskFamilySpec("mul", "x * {a}", lambda x, a: x * a, ("a",), ((2, 9),), ((5,),)),
    TaskFamilySpec("absdiff", "abs(x - {a})", lambda x, a: abs(x - a), ("a",), ((3, 9),), ((4,), (9,))),
    TaskFamilySpec("max", "max(x, {a})", lambda x, a: x if x > a else a, ("a",), ((2, 9),), ((8,), (5,))),
    TaskFamilySpec("min", "min(x, {a})", lambda x, a: x if x < a else a, ("a",), ((1, 9),), ((2,), (6,))),
    TaskFamilySpec("mod", "x % {a}", lambda x, a: x - a * (x // a), ("a",), ((2, 9),), ((7,),)),
    TaskFamilySpec("floordiv", "x // {a}", lambda x, a: (x - x % a) // a, ("a",), ((2, 9),), ((3,),)),
    TaskFamilySpec(
        "affine",
        "{a} * x + {b}",
        lambda x, a, b: a * x + b,
        ("a", "b"),
        ((2, 5), (1, 9)),
        ((2, 7), (3, 3), (4, 9), (5, 1), (3, 6)),
    ),
)
"""The task families (10). Parameters are small positive constants. Identity-like
members (x + 0, x * 1, x % 1 ...) are excluded, and so are abs(x - a) for a < 3 and
max(x, 1): those equal x - a or another max on every input x >= 2, the hidden tests'
range, so hidden tests could not tell them apart. No two candidates agree on all of
2..X_MAX (tested)."""

FAMILY_BY_NAME: Final[dict[str, TaskFamilySpec]] = {f.name: f for f in FAMILIES}

Candidate = tuple[str, tuple[int, ...]]


def _candidate_table() -> tuple[tuple[Candidate, ...], tuple[tuple[int, ...], ...]]:
    cands: list[Candidate] = []
    rows: list[tuple[int, ...]] = []
    for fam in FAMILIES:
        for params in fam.all_params():
            cands.append((fam.name, params))
            rows.append(tuple(fam(x, params) for x in range(X_MIN, X_MAX + 1)))
    return tuple(cands), tuple(rows)


CANDIDATES, CANDIDATE_VALUES = _candidate_table()
"""Every (family, parameters) pair in range, and its outputs on X_MIN..X_MAX."""


def _index_by_example() -> tuple[dict[int, frozenset[int]], ...]:
    index: list[dict[int, set[int]]] = [{} for _ in range(X_MIN, X_MAX + 1)]
    for i, row in enumerate(CANDIDATE_VALUES):
        for col, y in enumerate(row):
            index[col].setdefault(y, set()).add(i)
    return tuple({y: frozenset(ids) for y, ids in col.items()} for col in index)


_BY_EXAMPLE = _index_by_example()
"""_BY_EXAMPLE[x - X_MIN][y]: indices of the candidates with f(x) == y."""


def identifying_candidates(examples: Sequence[tuple[int, int]]) -> list[Candidate]:
    """All (family, parameters) pairs in range whose function satisfies every example,
    in CANDIDATES order. A task's shown examples are valid when this returns exactly
    its own pair."""
    alive = frozenset(range(len(CANDIDATES)))
    for x, y in examples:
        if not X_MIN <= x <= X_MAX:
            raise ValueError(f"example input {x} is outside [{X_MIN}, {X_MAX}]")
        alive = alive & _BY_EXAMPLE[x - X_MIN].get(y, frozenset())
    return [CANDIDATES[i] for i in sorted(alive)]


@dataclass(frozen=True, slots=True)
class DrawnTask:
    """The pure content of one synthetic task: the target and its examples."""

    family: str
    params: tuple[int, ...]
    shown: tuple[tuple[int, int], ...]
    """(x, f(x)) pairs shown in the prompt, sorted by x, starting with x = 0, 1."""
    hidden: tuple[tuple[int, int], ...]
    """(x, f(x)) pairs of the hidden tests, sorted by x, disjoint from the shown inputs;
    like the shown ones, they identify the target among all candidates."""


def draw_task(rng: random.Random, split: Split) -> DrawnTask:
    """Draw one task of `split`: family uniform, then parameters uniform among the
    split's tuples, then the examples (`draw_examples`)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    fam = rng.choice(FAMILIES)
    params = rng.choice(fam.params_for(split))
    return draw_examples(rng, fam, params)


def draw_examples(rng: random.Random, fam: TaskFamilySpec, params: tuple[int, ...]) -> DrawnTask:
    """The examples of one target: shown inputs ALWAYS_SHOWN plus random distinct
    ones, and N_HIDDEN hidden inputs from the rest of the range, redrawn together
    until each set alone identifies (fam, params) among all candidates. So the
    prompt determines the answer, and every other candidate fails at least one
    hidden test (reward 1.0 is never earned by a look-alike)."""
    pool = [x for x in range(X_MIN, X_MAX + 1) if x not in ALWAYS_SHOWN]
    target: Candidate = (fam.name, params)
    for _ in range(MAX_DRAWS):
        xs = sorted((*ALWAYS_SHOWN, *rng.sample(pool, N_SHOWN - len(ALWAYS_SHOWN))))
        shown = tuple((x, fam(x, params)) for x in xs)
        if identifying_candidates(shown) != [target]:
            continue
        rest = [x for x in pool if x not in xs]
        hidden = tuple((x, fam(x, params)) for x in sorted(rng.sample(rest, N_HIDDEN)))
        if identifying_candidates(hidden) == [target]:
            break
    else:  # pragma: no cover - guarded by test_every_candidate_is_identifiable
        raise RuntimeError(f"no identifying examples found for {target} after {MAX_DRAWS} draws")
    return DrawnTask(fam.name, params, shown, hidden)

"""Pure numbers behind the report: the summary table and the series the plots draw.

Everything here takes parsed records (`StepMetrics`, `EvalRow`) and returns plain values;
nothing reads files or draws.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec

from fleetrl.actors.weights.metrics import binary_entropy

from fleetrl.actors.trainer.step import StepMetrics

from .records import EvalRow

__all__ = [
    "BF16_BITS", "SPLITS", "Summary", "bound_ratio_band", "eval_series", "kl_series",
    "last_eval", "first_eval", "breaks_total", "staleness_total", "summarize", "window_mean",
]

SPLITS = ("fresh", "general")
BF16_BITS = 16
#: steps averaged for the "start" and "end" training reward
REWARD_WINDOW = 5


def bound_ratio_band(density: float) -> tuple[float, float] | None:
    """The entropy bound on ``bf16 bytes / delta bytes`` for a change density, as a band.

    actors/weights/metrics.py bounds a delta that changes k of n bf16 elements by
    ``n * H2(k/n) + k * H(xor)`` bits. The trainer logs only the density ``d = k/n``, not
    the XOR patterns' entropy ``H(xor)``, which lies in ``[0, 16]`` bits. So the bound's
    ratio lies between ``16 / (H2(d) + 16 d)`` (patterns incompressible) and
    ``16 / H2(d)`` (patterns free): returns ``(low, high)``, or None for ``d`` outside
    ``(0, 1)`` (nothing changed, or everything did).
    """
    if not 0.0 < density < 1.0 or math.isnan(density):
        return None
    h = binary_entropy(density)
    return BF16_BITS / (h + BF16_BITS * density), BF16_BITS / h


def window_mean(values: Sequence[float], *, head: bool, k: int = REWARD_WINDOW) -> float | None:
    """Mean of the first (``head``) or last ``k`` finite values; None when there are none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    part = finite[:k] if head else finite[-k:]
    return sum(part) / len(part)


def _by_split(evals: Sequence[EvalRow], split: str) -> list[EvalRow]:
    """Rows of one split, one per version (the last written wins: a restarted evaluator
    may evaluate a version again), ordered by version."""
    latest: dict[int, EvalRow] = {}
    for r in evals:
        if r.split == split:
            latest[r.version] = r
    return [latest[v] for v in sorted(latest)]


def first_eval(evals: Sequence[EvalRow], split: str) -> EvalRow | None:
    rows = _by_split(evals, split)
    return rows[0] if rows else None


def last_eval(evals: Sequence[EvalRow], split: str) -> EvalRow | None:
    rows = _by_split(evals, split)
    return rows[-1] if rows else None


def eval_series(evals: Sequence[EvalRow], split: str) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, pass@1, ci_low, ci_high) of one split, by version."""
    rows = _by_split(evals, split)
    return ([r.step for r in rows], [r.pass_at_1 for r in rows], [r.ci_low for r in rows],
            [r.ci_high for r in rows])


def kl_series(steps: Sequence[StepMetrics]) -> dict[str, tuple[list[int], list[float]]]:
    """Mismatch KL per sampler kind (``"backend/dtype"``): (steps, kl) of the steps in
    which that kind generated tokens."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for row in steps:
        m = row
        for key, kl in sorted(m.mismatch_kl_by_sampler.items()):
            if m.tokens_by_sampler.get(key, 1) == 0:
                continue  # the kind was known but produced nothing in this batch
            xs, ys = out.setdefault(key, ([], []))
            xs.append(m.step)
            ys.append(kl)
    return out


def staleness_total(steps: Sequence[StepMetrics]) -> dict[int, int]:
    """Trained groups by staleness, summed over every step."""
    total: dict[int, int] = {}
    for row in steps:
        for s, n in row.staleness_hist.items():
            total[s] = total.get(s, 0) + n
    return dict(sorted(total.items()))


def breaks_total(steps: Sequence[StepMetrics]) -> dict[str, int]:
    """Retokenisation breaks of the trained trajectories by cause, summed over every step."""
    total: dict[str, int] = {}
    for row in steps:
        for cause, n in row.retokenization_breaks.items():
            total[cause] = total.get(cause, 0) + n
    return dict(sorted(total.items()))


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """The report's summary table."""

    steps: int
    """Optimizer steps taken (the last logged ``step``)."""
    skipped_steps: int
    groups: int
    trajectories: int
    reward_start: float | None
    reward_end: float | None
    """Mean training reward of the first / last `REWARD_WINDOW` logged steps."""
    heldout_start: Mapping[str, EvalRow]
    heldout_end: Mapping[str, EvalRow]
    """Per split: the evaluation of the lowest / highest version."""
    wall_clock_s: float | None
    """Seconds from the first to the last held-out evaluation (None: fewer than two)."""
    trainer_busy_s: float
    """Sum of the steps' ``step_s + publish_s``."""
    training_s: float | None = None
    """The trainer's wall clock at its last logged step (``elapsed_s``, restarts summed:
    what ``time_budget_s`` counts); None for metrics written before it was logged."""
    usd_per_rollout: float | None
    """Sampling cost of every logged step / their rollouts (None: no step had a cost)."""
    truncated: tuple[str, ...] = ()
    """Files whose cut-short last line was left out."""
    retokenization_breaks: Mapping[str, int] = {}
    """Breaks in the trained trajectories' token streams, by cause, summed over the steps."""


def _usd(steps: Sequence[StepMetrics]) -> float | None:
    """Total sampling cost / rollouts; None when no step carried a cost (no prices set)."""
    if not any(r.cost_usd > 0 for r in steps):
        return None
    n = sum(r.trajectories for r in steps)
    return sum(r.cost_usd for r in steps) / n if n else None


def summarize(steps: Sequence[StepMetrics], evals: Sequence[EvalRow], *,
              truncated: Sequence[str] = ()) -> Summary:
    rewards = [r.reward_mean for r in steps]
    times = sorted(r.time for r in evals)
    return Summary(
        steps=max((r.step for r in steps), default=0),
        skipped_steps=sum(1 for r in steps if r.skipped),
        groups=sum(r.groups for r in steps),
        trajectories=sum(r.trajectories for r in steps),
        reward_start=window_mean(rewards, head=True),
        reward_end=window_mean(rewards, head=False),
        heldout_start={s: r for s in SPLITS if (r := first_eval(evals, s)) is not None},
        heldout_end={s: r for s in SPLITS if (r := last_eval(evals, s)) is not None},
        wall_clock_s=times[-1] - times[0] if len(times) >= 2 else None,
        trainer_busy_s=sum(r.step_s + r.publish_s for r in steps),
        training_s=max((r.elapsed_s for r in steps), default=0.0) or None,
        usd_per_rollout=_usd(steps),
        truncated=tuple(truncated),
        retokenization_breaks=breaks_total(steps),
    )

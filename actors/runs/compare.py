"""The ablation's numbers for one run: pure functions of its logs.

Per run (one arm, one seed, one regime): the last held-out pass@1 of each split with its
interval, the reward-curve area, the gradient norm's standard deviation and maximum, the
fraction of logged steps that were skipped, the mismatch KL (all samplers and per
sampler kind), staleness, masked tokens, and whether it collapsed (`collapse`). The
paired comparison of arms across seeds is `paired`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import msgspec

from fleetrl.actors.report.records import EvalRow
from fleetrl.actors.report.summary import first_eval, last_eval
from fleetrl.actors.trainer.step import StepMetrics

from .collapse import NO_COLLAPSE, Collapse, detect_collapse

__all__ = ["PassAt1", "RunStats", "grad_norm_max", "grad_norm_std", "mean_kl", "mean_kl_by_sampler",
           "pass_at_1", "reward_auc", "run_collapse", "run_stats", "skipped_fraction", "staleness",
           "tokens_by_sampler"]

NONFINITE = "non-finite gradient"
"""The trainer's ``skipped_reason`` for a step whose loss or gradient was not finite."""


def _trained(steps: Sequence[StepMetrics]) -> list[StepMetrics]:
    return [m for m in steps if not m.skipped]


def reward_auc(steps: Sequence[StepMetrics]) -> float | None:
    """Area under the training-reward curve, normalised by its length: the trapezoid
    area of ``reward_mean`` over batch number (1, 2, ... in log order), divided by the
    number of intervals, so it is the curve's mean height (in reward units) and
    comparable across arms of the same budget. A single batch gives its reward; none,
    or only non-finite rewards, None."""
    ys = [m.reward_mean for m in steps if math.isfinite(m.reward_mean)]
    if not ys:
        return None
    if len(ys) == 1:
        return ys[0]
    area = sum((a + b) / 2 for a, b in zip(ys, ys[1:]))
    return area / (len(ys) - 1)


def _grad_norms(steps: Sequence[StepMetrics]) -> list[float]:
    return [m.grad_norm for m in _trained(steps) if math.isfinite(m.grad_norm)]


def grad_norm_std(steps: Sequence[StepMetrics]) -> float | None:
    """Population standard deviation of the gradient norm over the steps that trained
    (skipped steps and non-finite norms left out); None for fewer than two."""
    xs = _grad_norms(steps)
    return statistics.pstdev(xs) if len(xs) >= 2 else None


def grad_norm_max(steps: Sequence[StepMetrics]) -> float | None:
    """Largest (pre-clip) gradient norm of a step that trained; None for none. A
    non-finite norm is not a maximum: it is a collapse (`run_collapse`)."""
    xs = _grad_norms(steps)
    return max(xs) if xs else None


def skipped_fraction(steps: Sequence[StepMetrics]) -> float | None:
    """Skipped lines over all lines of ``metrics.jsonl`` (None: nothing logged)."""
    return sum(m.skipped for m in steps) / len(steps) if steps else None


def mean_kl(steps: Sequence[StepMetrics]) -> float | None:
    """Mean over trained steps of ``mismatch_kl_k3`` (k3 KL per token, all samplers)."""
    xs = [m.mismatch_kl_k3 for m in _trained(steps) if math.isfinite(m.mismatch_kl_k3)]
    return statistics.fmean(xs) if xs else None


def mean_kl_by_sampler(steps: Sequence[StepMetrics]) -> dict[str, float]:
    """Per sampler kind (``mismatch_kl_by_sampler`` keys): the mean over the trained steps
    in which that kind produced tokens."""
    acc: dict[str, list[float]] = {}
    for m in _trained(steps):
        for key, kl in m.mismatch_kl_by_sampler.items():
            if m.tokens_by_sampler.get(key, 1) > 0 and math.isfinite(kl):
                acc.setdefault(key, []).append(kl)
    return {k: statistics.fmean(v) for k, v in sorted(acc.items())}


def tokens_by_sampler(steps: Sequence[StepMetrics]) -> dict[str, int]:
    """Generated tokens per sampler kind over the trained steps (who served the run)."""
    out: dict[str, int] = {}
    for m in _trained(steps):
        for key, n in m.tokens_by_sampler.items():
            out[key] = out.get(key, 0) + n
    return dict(sorted(out.items()))


def staleness(steps: Sequence[StepMetrics]) -> tuple[float | None, int | None]:
    """(mean, max) staleness of the trained groups, from each step's ``staleness_hist``."""
    total = count = 0
    top = None
    for m in _trained(steps):
        for s, n in m.staleness_hist.items():
            if n > 0:
                total, count = total + s * n, count + n
                top = s if top is None else max(top, s)
    return (total / count if count else None), top


def run_collapse(steps: Sequence[StepMetrics], *, timed_out: bool = False, budget: int | None = None) -> Collapse:
    """`detect_collapse` of a run's batches (reward ``reward_mean`` of every logged line,
    in log order; a step skipped as non-finite, or a trained one with a non-finite loss
    or gradient norm, counts as non-finite). A run stopped by its timeout before its step budget has *stalled*: the
    ablation's arms stall when every group's rewards are equal (all attempts fail), so no
    batch has a gradient left; that is reported as a collapse too."""
    nonfinite = [m.step for m in steps if m.skipped and m.skipped_reason == NONFINITE]
    nonfinite += [m.step for m in _trained(steps) if not (math.isfinite(m.loss) and math.isfinite(m.grad_norm))]
    found = detect_collapse([m.step for m in steps], [m.reward_mean for m in steps], nonfinite_steps=nonfinite)
    if found.collapsed:
        return found
    done = max((m.step for m in steps), default=0)
    if timed_out and budget is not None and done < budget:
        return Collapse(collapsed=True, step=done + 1,
                        reason=f"stalled: timed out after {done} of {budget} steps (no group with a gradient, "
                               "or too slow: see serve.log)")
    return NO_COLLAPSE


class PassAt1(msgspec.Struct, frozen=True, kw_only=True):
    """One held-out evaluation, without its per-task rewards."""

    step: int
    n: int
    passed: int
    pass_at_1: float
    ci_low: float
    ci_high: float


def pass_at_1(row: EvalRow | None) -> PassAt1 | None:
    if row is None:
        return None
    return PassAt1(step=row.step, n=row.n, passed=row.passed, pass_at_1=row.pass_at_1, ci_low=row.ci_low,
                   ci_high=row.ci_high)


class RunStats(msgspec.Struct, frozen=True, kw_only=True):
    """One run of the ablation: one arm, one seed, one regime."""

    regime: str
    seed: int
    key: str
    name: str
    label: str
    exit_code: int | None
    """The `fleetrl serve` exit code (None: it did not start)."""
    wall_s: float
    """Seconds from starting `fleetrl serve` to its exit."""
    steps: int
    """Optimizer steps taken."""
    budget: int | None
    fresh_start: PassAt1 | None
    """The first held-out evaluation (the warm model) of the fresh split."""
    fresh: PassAt1 | None
    """The last one (after the final step)."""
    general: PassAt1 | None
    reward_auc: float | None
    grad_norm_std: float | None
    grad_norm_max: float | None
    frac_skipped: float | None
    kl_mean: float | None
    kl_by_sampler: dict[str, float]
    tokens_by_sampler: dict[str, int]
    """Tokens each sampler kind generated in the trained steps."""
    staleness_mean: float | None
    staleness_max: int | None
    masked_mean: float | None
    collapse: Collapse
    error: str = ""
    reused_from: str = ""
    """The run these numbers were read from when this one was not run again (the
    reference arm of a seed is the same run in every regime)."""


def run_stats(*, regime: str, seed: int, key: str, name: str, label: str, exit_code: int | None, wall_s: float,
              steps: Sequence[StepMetrics], evals: Sequence[EvalRow], budget: int | None, timed_out: bool = False,
              error: str = "", reused_from: str = "") -> RunStats:
    trained = _trained(steps)
    masked = [m.frac_masked_tokens for m in trained if math.isfinite(m.frac_masked_tokens)]
    st_mean, st_max = staleness(steps)
    return RunStats(
        regime=regime, seed=seed, key=key, name=name, label=label, exit_code=exit_code, wall_s=wall_s,
        steps=max((m.step for m in steps), default=0), budget=budget,
        fresh_start=pass_at_1(first_eval(evals, "fresh")), fresh=pass_at_1(last_eval(evals, "fresh")),
        general=pass_at_1(last_eval(evals, "general")), reward_auc=reward_auc(steps),
        grad_norm_std=grad_norm_std(steps), grad_norm_max=grad_norm_max(steps),
        frac_skipped=skipped_fraction(steps), kl_mean=mean_kl(steps), kl_by_sampler=mean_kl_by_sampler(steps),
        tokens_by_sampler=tokens_by_sampler(steps),
        staleness_mean=st_mean, staleness_max=st_max, masked_mean=statistics.fmean(masked) if masked else None,
        collapse=run_collapse(steps, timed_out=timed_out, budget=budget), error=error, reused_from=reused_from,
    )

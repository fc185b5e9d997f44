"""Paired comparison of each ablation arm against the reference arm (a), over seeds.

Within a seed every arm starts from the same warm model, trains on the same task stream
and is evaluated on the same held-out tasks with the same sampling seed, so arm X and
the reference form a pair per seed, and their final evaluations a pair per task.

* Held-out pass@1: per seed, the mean over tasks of ``pass_X(task) - pass_ref(task)``
  (a task passes when its reward is 1.0), with a 95% paired bootstrap interval over
  tasks. Across seeds: the mean of the per-seed differences, with a 95% interval from
  resampling the task indices (the same indices in every seed, since the tasks are the
  same: the task-level correlation between seeds is kept). This interval covers the
  choice of tasks and the sampling noise of the evaluation, not the spread between
  seeds; the per-seed differences show that spread.
* Per-run numbers (reward AUC, grad-norm std and max, fraction of steps skipped,
  mismatch KL): per seed ``X - ref``; across seeds the mean with a Student-t 95%
  interval over seeds (none for one seed; wide for two: t = 12.7).

Bootstraps use a fixed generator seed, so the same logs give the same intervals.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence

import msgspec
import numpy as np

from fleetrl.actors.report.records import EvalRow
from fleetrl.actors.report.summary import last_eval

from .compare import RunStats

__all__ = ["ArmComparison", "Diff", "SeedDiff", "compare_arms", "paired_interval", "paired_pass_diff", "scalar_diff",
           "t_interval", "T_975"]

#: two-sided 95% quantiles of Student's t for 1..30 degrees of freedom
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)
RESAMPLES = 2000
BOOTSTRAP_SEED = 20_260_101


class SeedDiff(msgspec.Struct, frozen=True, kw_only=True):
    seed: int
    diff: float
    """Arm minus reference."""
    low: float | None = None
    high: float | None = None
    """95% interval within the seed (pass@1: paired bootstrap over tasks)."""


class Diff(msgspec.Struct, frozen=True, kw_only=True):
    """Arm minus reference of one number, per seed and across seeds."""

    mean: float | None
    """Mean of the per-seed differences (None: no seed has both)."""
    low: float | None
    high: float | None
    method: str
    seeds: tuple[SeedDiff, ...] = ()
    missing: tuple[int, ...] = ()
    """Seeds left out: the arm or the reference has no value there."""


def t_interval(xs: Sequence[float]) -> tuple[float, float | None, float | None]:
    """(mean, low, high): the mean and its Student-t 95% interval; no interval for one value."""
    if not xs:
        raise ValueError("t_interval of no values")
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, None, None
    df = len(xs) - 1
    t = T_975[df - 1] if df <= len(T_975) else 1.96
    half = t * statistics.stdev(xs) / math.sqrt(len(xs))
    return m, m - half, m + half


def _bootstrap(diffs: Sequence[np.ndarray], joint: bool, rng: np.random.Generator) -> tuple[float, float]:
    """95% percentile interval of the mean over seeds of the per-seed mean difference."""
    if joint:
        d = np.stack(diffs)  # [seeds, tasks]
        idx = rng.integers(0, d.shape[1], size=(RESAMPLES, d.shape[1]))
        stats = d[:, idx].mean(axis=2).mean(axis=0)  # [resamples]
    else:
        per = [x[rng.integers(0, len(x), size=(RESAMPLES, len(x)))].mean(axis=1) for x in diffs]
        stats = np.mean(per, axis=0)
    lo, hi = np.quantile(stats, [0.025, 0.975])
    return float(lo), float(hi)


def paired_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high) of ``a[i] - b[i]`` over paired items (per task: 1.0 passed, 0.0
    not), with a 95% bootstrap interval over the items (fixed generator seed)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_interval needs two equal, non-empty sequences, got {len(a)} and {len(b)} items")
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    lo, hi = _bootstrap([d], True, np.random.default_rng(BOOTSTRAP_SEED))
    return float(d.mean()), lo, hi


def _passes(row: EvalRow) -> np.ndarray:
    return np.array([1.0 if r == 1.0 else 0.0 for r in row.rewards])


def paired_pass_diff(pairs: Mapping[int, tuple[EvalRow | None, EvalRow | None]]) -> Diff:
    """pass@1 of arm minus reference, paired per task (module docstring). ``pairs``:
    seed -> (arm's last evaluation, reference's last evaluation) of one split. A seed is
    left out where either is missing, has no per-task rewards, or they differ in size."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    seeds, diffs, missing = [], [], []
    for seed in sorted(pairs):
        x, ref = pairs[seed]
        if x is None or ref is None or not x.rewards or not ref.rewards or len(x.rewards) != len(ref.rewards):
            missing.append(seed)
            continue
        d = _passes(x) - _passes(ref)
        lo, hi = _bootstrap([d], True, rng)
        seeds.append(SeedDiff(seed=seed, diff=float(d.mean()), low=lo, high=hi))
        diffs.append(d)
    method = "paired per task; 95% bootstrap over tasks"
    if not diffs:
        return Diff(mean=None, low=None, high=None, method=method, missing=tuple(missing))
    joint = len({len(d) for d in diffs}) == 1
    lo, hi = _bootstrap(diffs, joint, rng)
    return Diff(mean=float(np.mean([s.diff for s in seeds])), low=lo, high=hi, method=method, seeds=tuple(seeds),
                missing=tuple(missing))


def scalar_diff(pairs: Mapping[int, tuple[float | None, float | None]]) -> Diff:
    """A per-run number of arm minus reference, per seed, and its mean over seeds with a
    Student-t 95% interval (module docstring)."""
    seeds, missing = [], []
    for seed in sorted(pairs):
        x, ref = pairs[seed]
        if x is None or ref is None or not (math.isfinite(x) and math.isfinite(ref)):
            missing.append(seed)
        else:
            seeds.append(SeedDiff(seed=seed, diff=x - ref))
    method = "per seed; 95% Student-t interval over seeds"
    if not seeds:
        return Diff(mean=None, low=None, high=None, method=method, missing=tuple(missing))
    m, lo, hi = t_interval([s.diff for s in seeds])
    return Diff(mean=m, low=lo, high=hi, method=method, seeds=tuple(seeds), missing=tuple(missing))


class ArmComparison(msgspec.Struct, frozen=True, kw_only=True):
    """One arm against the reference over the seeds of one regime."""

    key: str
    name: str
    label: str
    reference: str
    """The reference arm's key."""
    fresh: Diff
    general: Diff
    reward_auc: Diff
    grad_norm_std: Diff
    grad_norm_max: Diff
    frac_skipped: Diff
    kl_mean: Diff
    collapsed_seeds: tuple[int, ...]
    reference_collapsed_seeds: tuple[int, ...]


_SCALARS: dict[str, Callable[[RunStats], float | None]] = {
    "reward_auc": lambda r: r.reward_auc,
    "grad_norm_std": lambda r: r.grad_norm_std,
    "grad_norm_max": lambda r: r.grad_norm_max,
    "frac_skipped": lambda r: r.frac_skipped,
    "kl_mean": lambda r: r.kl_mean,
}


def compare_arms(runs: Sequence[RunStats], evals: Mapping[tuple[int, str], Sequence[EvalRow]], *,
                 reference: str) -> list[ArmComparison]:
    """Every arm of ``runs`` (one regime) but ``reference`` against it, in the order the
    arms first appear. ``evals[(seed, key)]``: that run's held-out rows (with per-task
    rewards)."""
    by = {(r.seed, r.key): r for r in runs}
    seeds = sorted({r.seed for r in runs})
    keys = list(dict.fromkeys(r.key for r in runs if r.key != reference))
    if not any(r.key == reference for r in runs):
        raise ValueError(f"no run of the reference arm {reference!r}")
    out = []
    for key in keys:
        present = [s for s in seeds if (s, key) in by and (s, reference) in by]
        arm = by[(present[0], key)] if present else next(r for r in runs if r.key == key)

        def split_pairs(split: str) -> dict[int, tuple[EvalRow | None, EvalRow | None]]:
            return {s: (last_eval(evals.get((s, key), ()), split), last_eval(evals.get((s, reference), ()), split))
                    for s in present}

        scal = {name: scalar_diff({s: (get(by[(s, key)]), get(by[(s, reference)])) for s in present})
                for name, get in _SCALARS.items()}
        out.append(ArmComparison(
            key=key, name=arm.name, label=arm.label, reference=reference,
            fresh=paired_pass_diff(split_pairs("fresh")), general=paired_pass_diff(split_pairs("general")),
            **scal,
            collapsed_seeds=tuple(s for s in present if by[(s, key)].collapse.collapsed),
            reference_collapsed_seeds=tuple(s for s in present if by[(s, reference)].collapse.collapsed),
        ))
    return out

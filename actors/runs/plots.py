"""The ablation's comparison plots: one PNG per metric, one band per arm over seeds.

For each arm the line is the mean over seeds at each step, and the shaded band runs
from the lowest to the highest seed there (with one seed: the line alone). Held-out
pass@1 is drawn at the evaluated steps the same way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from fleetrl.actors.report.plots import save
from fleetrl.actors.report.records import EvalRow
from fleetrl.actors.report.summary import eval_series
from fleetrl.actors.trainer.step import StepMetrics

__all__ = ["COMPARISONS", "band", "write_comparisons"]

#: file name -> (title, y label)
COMPARISONS: dict[str, tuple[str, str]] = {
    "compare_reward.png": ("Training reward", "mean reward of the batch"),
    "compare_heldout_fresh.png": ("Held-out pass@1, fresh tasks", "pass@1"),
    "compare_heldout_general.png": ("Held-out pass@1, generalisation tasks", "pass@1"),
    "compare_grad_norm.png": ("Gradient norm (before clipping)", "L2 norm"),
    "compare_mismatch_kl.png": ("Sampler-trainer mismatch KL (all samplers)", "KL per token (k3)"),
    "compare_masked.png": ("Tokens masked by the corrections", "fraction of tokens"),
}

_STEP_FIELDS = {
    "compare_reward.png": "reward_mean",
    "compare_grad_norm.png": "grad_norm",
    "compare_mismatch_kl.png": "mismatch_kl_k3",
    "compare_masked.png": "frac_masked_tokens",
}

Series = Sequence[tuple[int, float]]


def band(series: Sequence[Series]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(xs, mean, low, high) over the seeds' series, at every x some series has; a
    series without that x does not count there."""
    at: dict[int, list[float]] = {}
    for s in series:
        for x, y in s:
            at.setdefault(x, []).append(y)
    xs = sorted(at)
    return (xs, [statistics.fmean(at[x]) for x in xs], [min(at[x]) for x in xs], [max(at[x]) for x in xs])


def _draw(ax, label: str, series: Sequence[Series], marker: str) -> list[float]:
    xs, mean, lo, hi = band([s for s in series if s])
    if not xs:
        return []
    line, = ax.plot(xs, mean, marker=marker, label=f"{label} (n={sum(1 for s in series if s)})")
    if sum(1 for s in series if s) > 1:
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2)
    return lo + hi


def _finish(ax, drawn: bool, title: str, ylabel: str, empty: str) -> None:
    if drawn:
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(ylabel)


def _step_plot(name: str, runs: Mapping[str, Sequence[Sequence[StepMetrics]]], path: Path) -> Path:
    title, ylabel = COMPARISONS[name]
    field = _STEP_FIELDS[name]
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    drawn: list[float] = []
    for label, seeds in runs.items():
        series = [[(m.step, getattr(m, field)) for m in steps if not m.skipped and math.isfinite(getattr(m, field))]
                  for steps in seeds]
        drawn += _draw(ax, label, series, ".")
    if field == "mismatch_kl_k3" and drawn and min(drawn) > 0:
        ax.set_yscale("log")  # precisions differ by orders of magnitude
    _finish(ax, bool(drawn), title + " (mean over seeds; band: min to max)", ylabel, "no steps logged")
    return save(fig, path)


def _eval_plot(name: str, split: str, runs: Mapping[str, Sequence[Sequence[EvalRow]]], path: Path) -> Path:
    title, ylabel = COMPARISONS[name]
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    drawn = False
    for label, seeds in runs.items():
        series = []
        for evals in seeds:
            xs, p, _, _ = eval_series(evals, split)
            series.append(list(zip(xs, p)))
        drawn = bool(_draw(ax, label, series, "o")) or drawn
    ax.set_ylim(0, 1)
    _finish(ax, drawn, title + " (mean over seeds; band: min to max)", ylabel, "no held-out evaluation logged")
    return save(fig, path)


def write_comparisons(steps: Mapping[str, Sequence[Sequence[StepMetrics]]],
                      evals: Mapping[str, Sequence[Sequence[EvalRow]]], out_dir: Path) -> list[Path]:
    """Write every comparison PNG into ``out_dir``: arms keyed by their labels, each with
    one sequence of steps (or evaluations) per seed."""
    paths = [_step_plot(n, steps, out_dir / n) for n in _STEP_FIELDS]
    paths.append(_eval_plot("compare_heldout_fresh.png", "fresh", evals, out_dir / "compare_heldout_fresh.png"))
    paths.append(_eval_plot("compare_heldout_general.png", "general", evals,
                            out_dir / "compare_heldout_general.png"))
    return paths

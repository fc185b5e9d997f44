"""The ablation's comparison plots: one PNG per metric, one line per arm."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from fleetrl.actors.report.plots import save
from fleetrl.actors.report.records import EvalRow
from fleetrl.actors.report.summary import eval_series
from fleetrl.actors.trainer.step import StepMetrics

__all__ = ["COMPARISONS", "write_comparisons"]

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


def _step_plot(name: str, runs: Mapping[str, Sequence[StepMetrics]], path: Path) -> Path:
    title, ylabel = COMPARISONS[name]
    field = _STEP_FIELDS[name]
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    drawn = []
    for label, steps in runs.items():
        pts = [(m.step, getattr(m, field)) for m in steps
               if not m.skipped and math.isfinite(getattr(m, field))]
        if pts:
            drawn += [p[1] for p in pts]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
    if field == "mismatch_kl_k3" and drawn and min(drawn) > 0:
        ax.set_yscale("log")  # precisions differ by orders of magnitude
    if drawn:
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no steps logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(title)
    ax.set_xlabel("trainer step")
    ax.set_ylabel(ylabel)
    return save(fig, path)


def _eval_plot(name: str, split: str, runs: Mapping[str, Sequence[EvalRow]], path: Path) -> Path:
    title, ylabel = COMPARISONS[name]
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    drawn = False
    for label, evals in runs.items():
        xs, p, lo, hi = eval_series(evals, split)
        if xs:
            drawn = True
            line, = ax.plot(xs, p, marker="o", label=label)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    if drawn:
        ax.legend(loc="best", fontsize="small")
    else:
        ax.text(0.5, 0.5, "no held-out evaluation logged", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_ylim(0, 1)
    ax.set_title(title + " (bands: confidence intervals)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel(ylabel)
    return save(fig, path)


def write_comparisons(steps: Mapping[str, Sequence[StepMetrics]], evals: Mapping[str, Sequence[EvalRow]],
                      out_dir: Path) -> list[Path]:
    """Write every comparison PNG into ``out_dir`` (arms keyed by their labels)."""
    paths = [_step_plot(n, steps, out_dir / n) for n in _STEP_FIELDS]
    paths.append(_eval_plot("compare_heldout_fresh.png", "fresh", evals, out_dir / "compare_heldout_fresh.png"))
    paths.append(_eval_plot("compare_heldout_general.png", "general", evals,
                            out_dir / "compare_heldout_general.png"))
    return paths

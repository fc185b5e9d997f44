"""The report's PNG plots (matplotlib's object API on the Agg canvas; no pyplot state).

Each ``plot_*`` function draws one figure from parsed records and writes it to the
given path. A figure with nothing to draw yet says so on the canvas, so the report's
links always resolve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from fleetrl.actors.trainer.step import StepMetrics

from .records import EvalRow
from .summary import SPLITS, bound_ratio_band, eval_series, kl_series, sampler_kl_series, staleness_total

__all__ = [
    "PLOTS", "plot_delta_ratio", "plot_grad_norm", "plot_learning", "plot_mismatch_kl",
    "plot_staleness", "save",
]

COLORS = {"fresh": "tab:blue", "general": "tab:orange"}


def save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    return path


def _empty(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} logged", ha="center", va="center", transform=ax.transAxes,
            color="gray")


def _finite(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_learning(steps: Sequence[StepMetrics], evals: Sequence[EvalRow], path: Path) -> Path:
    """Top: training reward and pass rate per step. Bottom: held-out pass@1 per split
    with its confidence band, against the trainer step it evaluated."""
    fig = Figure(figsize=(8, 7))
    top, bottom = fig.subplots(2, 1, sharex=True)
    if steps:
        xs = [r.step for r in steps]
        top.plot(*_finite(xs, [r.reward_mean for r in steps]), label="mean reward")
        top.plot(*_finite(xs, [r.pass_rate for r in steps]), label="pass rate", alpha=0.7)
        top.legend(loc="best")
    else:
        _empty(top, "training steps")
    top.set_ylabel("training batch")
    top.set_title("Reward and held-out pass@1")
    drawn = False
    for split in SPLITS:
        sx, p, lo, hi = eval_series(evals, split)
        if not sx:
            continue
        drawn = True
        bottom.plot(sx, p, marker="o", color=COLORS[split], label=f"{split} pass@1")
        bottom.fill_between(sx, lo, hi, color=COLORS[split], alpha=0.2, label=f"{split} CI")
    if drawn:
        bottom.legend(loc="best")
    else:
        _empty(bottom, "held-out evaluation")
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("held-out pass@1")
    bottom.set_xlabel("trainer step")
    return save(fig, path)


def plot_grad_norm(steps: Sequence[StepMetrics], path: Path) -> Path:
    """Global gradient norm before clipping, per step (non-finite ones are left out)."""
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    xs, ys = _finite([r.step for r in steps], [r.grad_norm for r in steps])
    if xs:
        ax.plot(xs, ys)
    else:
        _empty(ax, "gradient norm")
    ax.set_title("Gradient norm (before clipping)")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("L2 norm")
    return save(fig, path)


def _kl_axis(ax: Axes, series: dict[str, tuple[list[int], list[float]]], title: str, *,
             fleet: tuple[list[int], list[float]] | None = None) -> None:
    values = [y for _, ys, *_ in series.values() for y in ys if math.isfinite(y)]
    for key, (xs, ys, *_) in series.items():
        fx, fy = _finite(xs, ys)
        if fx:
            ax.plot(fx, fy, marker=".", label=key)
    if fleet is not None and fleet[0]:
        fx, fy = _finite(*fleet)
        ax.plot(fx, fy, color="black", linestyle="--", linewidth=1, label="fleet (all tokens)")
    if values:
        if min(values) > 0:
            ax.set_yscale("log")
        else:
            ax.set_yscale("symlog", linthresh=1e-6)
        ax.legend(loc="best", title=title, fontsize="small")
    else:
        _empty(ax, f"sampler mismatch {title}")
    ax.set_ylabel("KL per token (k3)")


def plot_mismatch_kl(steps: Sequence[StepMetrics], path: Path) -> Path:
    """k3 estimate of KL(sampler || trainer) per token: per sampler kind with the whole
    fleet's (top), per sampler (middle); the fraction of each sampler's tokens whose
    ratio is outside the correction band (bottom)."""
    fig = Figure(figsize=(8, 10))
    top, mid, bottom = fig.subplots(3, 1, sharex=True)
    measured = [r for r in steps if sum(r.tokens_by_sampler.values())]
    _kl_axis(top, kl_series(steps), "backend/dtype",
             fleet=([r.step for r in measured], [r.mismatch_kl_k3 for r in measured]))
    top.set_title("Sampler-trainer mismatch KL by sampler precision")
    samplers = sampler_kl_series(steps)
    _kl_axis(mid, samplers, "sampler")
    mid.set_title("Sampler-trainer mismatch KL by sampler")
    drawn = False
    for key, (xs, _, band) in samplers.items():
        fx, fy = _finite(xs, [100 * b for b in band])
        if fx:
            drawn = True
            bottom.plot(fx, fy, marker=".", label=key)
    if drawn:
        bottom.legend(loc="best", title="sampler", fontsize="small")
    else:
        _empty(bottom, "per-sampler mismatch")
    bottom.set_title("Tokens outside the correction band")
    bottom.set_ylabel("% of the sampler's tokens")
    bottom.set_xlabel("trainer step")
    return save(fig, path)


def plot_staleness(steps: Sequence[StepMetrics], path: Path) -> Path:
    """Trained groups by staleness (trainer version - oldest token version), whole run."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    hist = staleness_total(steps)
    if hist:
        ax.bar([str(s) for s in hist], list(hist.values()))
    else:
        _empty(ax, "staleness")
    ax.set_title("Staleness of trained groups")
    ax.set_xlabel("versions behind the trainer")
    ax.set_ylabel("groups")
    return save(fig, path)


def plot_delta_ratio(steps: Sequence[StepMetrics], path: Path) -> Path:
    """Measured bf16 bytes / step-delta bytes per published version, against the band in
    which the entropy bound lies for that version's change density."""
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    pts = [(r.step, r.delta_ratio, bound_ratio_band(r.delta_density))
           for r in steps if not r.skipped and r.delta_ratio > 0]
    pts = [p for p in pts if math.isfinite(p[1])]
    if pts:
        xs = [p[0] for p in pts]
        ax.plot(xs, [p[1] for p in pts], marker=".", label="delta (measured)")
        band = [(x, b) for x, _, b in pts if b is not None]
        if band:
            ax.fill_between([x for x, _ in band], [b[0] for _, b in band], [b[1] for _, b in band],
                            color="tab:green", alpha=0.25,
                            label="entropy bound (XOR patterns 16 bits .. free)")
        ax.set_yscale("log")
        ax.legend(loc="best")
    else:
        _empty(ax, "weight delta")
    ax.set_title("Weight delta compression vs the entropy bound")
    ax.set_xlabel("trainer step")
    ax.set_ylabel("bf16 bytes / delta bytes")
    return save(fig, path)


#: file name -> (title, what it shows); the HTML page lists them in this order
PLOTS: dict[str, tuple[str, str]] = {
    "learning.png": ("Reward and held-out pass@1",
                     "Training reward and pass rate per step; held-out pass@1 on fresh and "
                     "generalisation tasks with confidence bands."),
    "grad_norm.png": ("Gradient norm", "Global gradient norm before clipping."),
    "mismatch_kl.png": ("Mismatch by sampler",
                        "How far each sampler kind's and each sampler's distribution is from the "
                        "trainer's (k3 KL per token; the dashed line is the whole fleet), and how many of "
                        "each sampler's tokens fall outside the correction band."),
    "staleness.png": ("Staleness", "Trained groups by versions behind the trainer."),
    "delta_ratio.png": ("Delta ratio vs entropy bound",
                        "Weight-delta compression against the entropy bound's band."),
}

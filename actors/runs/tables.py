"""The ablation's tables (markdown), from `RunStats` and `ArmComparison` records.

Per regime: the arms (mean over seeds, with the seeds' range), the paired differences
against the reference arm with their intervals, and every run. `text_table` is a
plain-text view of the runs for the terminal.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

from .compare import PassAt1, RunStats
from .paired import ArmComparison, Diff

__all__ = ["DEFINITIONS", "arms_table", "diff_table", "runs_table", "text_table"]

DEFINITIONS = (
    "Definitions. pass@1: the last held-out evaluation (after the final step), fresh or general tasks; "
    "Δ: arm minus (a), paired per seed (same warm model, task stream and held-out tasks); Δ pass@1 is paired "
    "per task, its 95% interval a bootstrap over the held-out tasks (resampled together across seeds), in "
    "points; the other Δ intervals are Student-t over seeds (none for one seed). reward AUC: trapezoid mean of "
    "the batches' training reward. grad-norm std / max: over the steps that trained, before clipping. "
    "skipped: skipped lines of metrics.jsonl over all lines. mismatch KL: mean k3 KL(q || p) per token over "
    "trained steps, all samplers. staleness: trainer version minus the oldest token version, over trained "
    "groups. collapse: a non-finite loss, gradient or reward; or the batch reward, smoothed over 5 steps, "
    "falling below half its peak and staying there to the end (3 steps or more); or a run stalled at its "
    "timeout before its budget.")


def _num(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def _spread(values: Sequence[float | None], spec: str, scale: float = 1.0) -> str:
    """Mean over seeds, with the [min, max] of the seeds when there are several."""
    xs = [v * scale for v in values if v is not None]
    if not xs:
        return "n/a"
    mean = format(statistics.fmean(xs), spec)
    return mean if len(xs) == 1 else f"{mean} [{format(min(xs), spec)}, {format(max(xs), spec)}]"


def _pass(p: PassAt1 | None) -> float | None:
    return None if p is None else p.pass_at_1


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


ARMS_HEADER = ("arm", "fresh pass@1 %", "general pass@1 %", "reward AUC", "grad-norm std", "grad-norm max",
               "skipped", "mismatch KL", "staleness mean / max", "masked", "collapsed")


def arms_table(runs: Sequence[RunStats]) -> str:
    """One row per arm: mean over seeds [min, max over seeds]."""
    keys = list(dict.fromkeys(r.key for r in runs))
    rows = []
    for key in keys:
        mine = [r for r in runs if r.key == key]

        def col(get: Callable[[RunStats], float | None], spec: str, scale: float = 1.0) -> str:
            return _spread([get(r) for r in mine], spec, scale)

        top = [r.staleness_max for r in mine if r.staleness_max is not None]
        collapsed = [f"seed {r.seed} (step {r.collapse.step})" for r in mine if r.collapse.collapsed]
        rows.append((
            mine[0].label, col(lambda r: _pass(r.fresh), ".1f", 100), col(lambda r: _pass(r.general), ".1f", 100),
            col(lambda r: r.reward_auc, ".3f"), col(lambda r: r.grad_norm_std, ".3f"),
            col(lambda r: r.grad_norm_max, ".3f"), col(lambda r: r.frac_skipped, ".2f"),
            col(lambda r: r.kl_mean, ".2e"),
            f"{col(lambda r: r.staleness_mean, '.2f')} / {max(top) if top else 'n/a'}",
            col(lambda r: r.masked_mean, ".4f"), ", ".join(collapsed) or "none",
        ))
    return _table(ARMS_HEADER, rows)


def _diff(d: Diff, spec: str, scale: float = 1.0, sign: bool = True) -> str:
    if d.mean is None:
        return "n/a"
    fmt = ("+" if sign else "") + spec
    text = format(d.mean * scale, fmt)
    if d.low is not None and d.high is not None:
        text += f" [{format(d.low * scale, fmt)}, {format(d.high * scale, fmt)}]"
    if d.missing:
        text += f" (without seed {', '.join(map(str, d.missing))})"
    return text


def _per_seed(d: Diff, scale: float) -> str:
    return ", ".join(f"{s.seed}: {s.diff * scale:+.1f}" for s in d.seeds) or "n/a"


DIFF_HEADER = ("arm", "Δ fresh pass@1 (points)", "Δ general pass@1 (points)", "Δ reward AUC", "Δ grad-norm std",
               "Δ grad-norm max", "Δ skipped", "Δ fresh by seed")


def diff_table(comparisons: Sequence[ArmComparison]) -> str:
    """Each arm minus the reference: mean over seeds [95% interval]."""
    rows = [(c.label, _diff(c.fresh, ".1f", 100), _diff(c.general, ".1f", 100), _diff(c.reward_auc, ".3f"),
             _diff(c.grad_norm_std, ".3f"), _diff(c.grad_norm_max, ".3f"), _diff(c.frac_skipped, ".2f"),
             _per_seed(c.fresh, 100)) for c in comparisons]
    return _table(DIFF_HEADER, rows)


RUNS_HEADER = ("seed", "arm", "exit", "steps", "wall-clock", "fresh pass@1 [CI]", "fresh pass@1 at step 0",
               "collapse", "note")


def _pass_ci(p: PassAt1 | None) -> str:
    if p is None:
        return "n/a"
    return f"{100 * p.pass_at_1:.1f}% [{100 * p.ci_low:.1f}, {100 * p.ci_high:.1f}]"


def _run_row(r: RunStats) -> tuple[str, ...]:
    note = r.error or (f"same run as {r.reused_from}" if r.reused_from else "")
    return (str(r.seed), r.label, "-" if r.exit_code is None else str(r.exit_code),
            f"{r.steps}" + (f"/{r.budget}" if r.budget else ""), f"{r.wall_s:.0f} s", _pass_ci(r.fresh),
            _pass_ci(r.fresh_start), r.collapse.reason or "none", note)


def runs_table(runs: Sequence[RunStats]) -> str:
    return _table(RUNS_HEADER, [_run_row(r) for r in runs])


def text_table(runs: Sequence[RunStats]) -> str:
    """The runs as aligned plain text (for the terminal)."""
    rows = [RUNS_HEADER, *(_run_row(r) for r in runs)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(RUNS_HEADER))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out) + "\n"

"""The ablation's numbers and table: pure functions of each arm's logs.

Per arm: the final held-out pass@1 (fresh, general) with its CI, the reward-curve area,
the gradient-norm standard deviation, steps and wall-clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import msgspec

from fleetrl.actors.report.records import EvalRow
from fleetrl.actors.report.summary import last_eval
from fleetrl.actors.trainer.step import StepMetrics

__all__ = ["ArmResult", "grad_norm_std", "markdown_table", "reward_auc", "arm_result", "text_table"]


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


def grad_norm_std(steps: Sequence[StepMetrics]) -> float | None:
    """Population standard deviation of the gradient norm over the steps that trained
    (skipped steps and non-finite norms left out); None for fewer than two."""
    xs = [m.grad_norm for m in steps if not m.skipped and math.isfinite(m.grad_norm)]
    return statistics.pstdev(xs) if len(xs) >= 2 else None


class ArmResult(msgspec.Struct, frozen=True, kw_only=True):
    """One arm of the ablation (or one run of the async benchmark)."""

    key: str
    name: str
    label: str
    exit_code: int | None
    """The `fleetrl serve` exit code (None: it did not start)."""
    wall_s: float
    """Seconds from starting `fleetrl serve` to its exit."""
    steps: int
    fresh: EvalRow | None
    general: EvalRow | None
    reward_auc: float | None
    grad_norm_std: float | None
    error: str = ""


def arm_result(*, key: str, name: str, label: str, exit_code: int | None, wall_s: float,
               steps: Sequence[StepMetrics], evals: Sequence[EvalRow], error: str = "") -> ArmResult:
    return ArmResult(
        key=key, name=name, label=label, exit_code=exit_code, wall_s=wall_s,
        steps=max((m.step for m in steps), default=0),
        fresh=last_eval(evals, "fresh"), general=last_eval(evals, "general"),
        reward_auc=reward_auc(steps), grad_norm_std=grad_norm_std(steps), error=error,
    )


def _pass(row: EvalRow | None) -> str:
    if row is None:
        return "n/a"
    return f"{100 * row.pass_at_1:.1f}% [{100 * row.ci_low:.1f}, {100 * row.ci_high:.1f}]"


def _num(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


HEADER = ("variant", "fresh pass@1 [CI]", "general pass@1 [CI]", "reward AUC", "grad-norm std",
          "steps", "wall-clock", "exit")


def table_rows(arms: Sequence[ArmResult]) -> list[tuple[str, ...]]:
    return [(a.label, _pass(a.fresh), _pass(a.general), _num(a.reward_auc, ".3f"),
             _num(a.grad_norm_std, ".3f"), str(a.steps), f"{a.wall_s:.0f} s",
             "-" if a.exit_code is None else str(a.exit_code)) for a in arms]


def markdown_table(arms: Sequence[ArmResult]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(arms)]
    return "\n".join(lines) + "\n"


def text_table(arms: Sequence[ArmResult]) -> str:
    rows = [HEADER, *table_rows(arms)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out) + "\n"

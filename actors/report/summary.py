"""Pure numbers behind the report: the summary table and the series the plots draw.

Everything here takes parsed records (`StepMetrics`, `EvalRow`) and returns plain values;
nothing reads files or draws.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import msgspec

from fleetrl.actors.weights.metrics import binary_entropy

from fleetrl.actors.trainer.step import MismatchFigures, StepMetrics, combine_figures

from .records import EvalRow

__all__ = [
    "BF16_BITS", "FP32_REFERENCE", "SPLITS", "MismatchMultiple", "MismatchRow", "Summary", "bound_ratio_band",
    "eval_series", "fleet_kl", "fleet_mismatch_multiple", "kl_series", "last_eval", "first_eval", "breaks_total",
    "mismatch_table", "run_mismatch_multiple", "sampler_kl_series", "staleness_total", "summarize", "window_mean",
]

SPLITS = ("fresh", "general")
FP32_REFERENCE = "torch/float32"
"""The sampler kind whose own mismatch is the homogeneous-fp32 reference: a torch
sampler computing in fp32, the trainer's own precision (what is left is staleness and
the two forwards' rounding)."""
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


def sampler_kl_series(steps: Sequence[StepMetrics]) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """Per sampler id: (steps, k3 KL, out-of-band fraction) of the steps in which it
    generated tokens (from ``mismatch_by_sampler_id``; empty for older metrics files)."""
    out: dict[str, tuple[list[int], list[float], list[float]]] = {}
    for row in steps:
        for sid, f in sorted(row.mismatch_by_sampler_id.items()):
            if f.tokens == 0:
                continue
            xs, kl, band = out.setdefault(sid, ([], [], []))
            xs.append(row.step)
            kl.append(f.kl_k3)
            band.append(f.frac_out_of_band)
    return out


class MismatchRow(msgspec.Struct, frozen=True, kw_only=True):
    """One sampler kind's (or sampler's) mismatch over a whole run: its figures over
    every token it produced in the logged steps (`combine_figures`)."""

    key: str
    """``"backend/dtype"``, or the sampler id."""
    label: str = ""
    """For a sampler: ``"backend/device kind/dtype"``."""
    steps: int
    """Steps in which it produced tokens."""
    figures: MismatchFigures


def mismatch_table(steps: Sequence[StepMetrics], *, by: str = "kind") -> list[MismatchRow]:
    """The run's mismatch per sampler kind (``by="kind"``) or per sampler id
    (``by="sampler"``), sorted by key: every step's figures combined, token-weighted."""
    if by not in ("kind", "sampler"):
        raise ValueError(f"mismatch_table: by must be 'kind' or 'sampler', got {by!r}")
    parts: dict[str, list[MismatchFigures]] = {}
    labels: dict[str, str] = {}
    for row in steps:
        table = row.mismatch_by_kind if by == "kind" else row.mismatch_by_sampler_id
        for key, f in table.items():
            if f.tokens:
                parts.setdefault(key, []).append(f)
        for ident in row.sampler_identities:
            labels.setdefault(ident.sampler_id, f"{ident.backend}/{ident.device_kind}/{ident.dtype}")
    return [MismatchRow(key=k, label=labels.get(k, "") if by == "sampler" else "", steps=len(fs),
                        figures=combine_figures(fs)) for k, fs in sorted(parts.items())]


def fleet_kl(steps: Sequence[StepMetrics]) -> tuple[float, int]:
    """The fleet's mismatch over ``steps``: the k3 KL of all their measured tokens, every
    sampler together, token-weighted (from ``mismatch_kl_by_sampler`` and
    ``tokens_by_sampler``, so older metrics files count too); and those tokens. A step
    skipped before its forward measured nothing and counts for nothing. (nan, 0) when
    nothing was measured."""
    total, tokens = 0.0, 0
    for row in steps:
        for key, kl in row.mismatch_kl_by_sampler.items():
            n = row.tokens_by_sampler.get(key, 0)
            if n:
                total += kl * n
                tokens += n
    return (total / tokens if tokens else math.nan), tokens


class MismatchMultiple(msgspec.Struct, frozen=True, kw_only=True):
    """The fleet's mismatch as a multiple of a homogeneous fp32 fleet's."""

    fleet_kl: float
    """Token-weighted k3 KL of every sampler's tokens in the steps compared."""
    fleet_tokens: int
    reference_kl: float
    """The reference's k3 KL in its steps (see ``reference``)."""
    reference_tokens: int
    steps: int
    """Steps compared."""
    multiple: float | None
    """``fleet_kl / reference_kl``; None when the reference measured exactly 0."""
    reference: str
    """What the reference is, in words."""


def _multiple(fleet: tuple[float, int], ref: tuple[float, int], steps: int, reference: str) -> MismatchMultiple:
    return MismatchMultiple(fleet_kl=fleet[0], fleet_tokens=fleet[1], reference_kl=ref[0], reference_tokens=ref[1],
                            steps=steps, multiple=fleet[0] / ref[0] if ref[0] > 0 else None, reference=reference)


def fleet_mismatch_multiple(steps: Sequence[StepMetrics], reference: str = FP32_REFERENCE) -> MismatchMultiple | None:
    """Within one run: the fleet's k3 KL over the steps in which a ``reference`` sampler
    (an fp32 torch sampler, by default) produced tokens, divided by that sampler kind's
    own k3 KL in the same steps. Both saw the same trainer versions and staleness, so the
    multiple is what the fleet's precisions add on top of a homogeneous fp32 fleet.
    None when no step had tokens of the reference kind."""
    same = [r for r in steps if r.tokens_by_sampler.get(reference, 0) > 0 and reference in r.mismatch_kl_by_sampler]
    if not same:
        return None
    ref = [msgspec.structs.replace(r, mismatch_kl_by_sampler={reference: r.mismatch_kl_by_sampler[reference]})
           for r in same]
    return _multiple(fleet_kl(same), fleet_kl(ref), len(same), f"its {reference} samplers in the same steps")


def run_mismatch_multiple(run: Sequence[StepMetrics], reference_run: Sequence[StepMetrics], *,
                          reference: str = "the reference run") -> MismatchMultiple | None:
    """Between two runs (an ablation arm and its homogeneous-fp32 ``sync_fp32`` arm): the
    fleet k3 KL of ``run`` divided by the fleet k3 KL of ``reference_run``, both over
    the optimizer steps that both runs measured (the same step numbers: mismatch moves
    as training goes). None when they measured no step in common."""
    def measured(rows: Sequence[StepMetrics]) -> dict[int, StepMetrics]:
        return {r.step: r for r in rows if any(r.tokens_by_sampler.get(k, 0) for k in r.mismatch_kl_by_sampler)}

    a, b = measured(run), measured(reference_run)
    common = sorted(set(a) & set(b))
    if not common:
        return None
    return _multiple(fleet_kl([a[s] for s in common]), fleet_kl([b[s] for s in common]), len(common), reference)


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
    mismatch_by_kind: tuple[MismatchRow, ...] = ()
    """The run's measured sampler-trainer mismatch per sampler kind (`mismatch_table`)."""
    mismatch_by_sampler: tuple[MismatchRow, ...] = ()
    """The same per sampler id."""
    fleet_mismatch_kl: float | None = None
    """Token-weighted k3 KL of every measured token of the run (None: nothing measured)."""
    mismatch_multiple: MismatchMultiple | None = None
    """The fleet's mismatch as a multiple of its fp32 torch samplers' (`fleet_mismatch_multiple`)."""


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
    fleet = fleet_kl(steps)
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
        mismatch_by_kind=tuple(mismatch_table(steps, by="kind")),
        mismatch_by_sampler=tuple(mismatch_table(steps, by="sampler")),
        fleet_mismatch_kl=fleet[0] if fleet[1] else None,
        mismatch_multiple=fleet_mismatch_multiple(steps),
    )

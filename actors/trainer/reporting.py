"""What the trainer actor reports besides its metrics file: its handle and /status record
(`TrainerHandle`, `TrainerStatistics`), its Prometheus series
(`TrainerMetrics`: gauges of the last step, alarms, group outcomes, the per-sampler
mismatch), the `SamplerMismatch` report the sampler pool gets after each step
(`mismatch_report`), and the terminal's progress bar (`Progress`)."""

from __future__ import annotations

import math
import sys
from typing import Any

import msgspec

from fleetrl.daemon.actor import ActorContext
from fleetrl.daemon.messages import MismatchFigures, SamplerMismatch
from fleetrl.grpo import CorrectionConfig

from .alarms import Alarm
from .core import Trainer
from .rank_engine import RankEngine, RanksStatus
from .step import StepMetrics

__all__ = ["Progress", "TrainerHandle", "TrainerMetrics", "TrainerStatistics", "mismatch_report"]


class TrainerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    """Newest published weight version."""
    step: int
    """Optimizer steps taken (over restarts)."""
    queued: int
    """Groups waiting in the rollout buffer."""
    groups: dict[str, int]
    """Groups received, by outcome (admitted, stale, zero_variance, duplicate, malformed, ...)."""
    elapsed_s: float
    """Seconds trained, over restarts (what ``time_budget_s`` counts)."""
    done: bool
    """A budget is spent: no more steps."""
    ranks: RanksStatus | None = None
    """The rank processes (``ranks`` configured): pids, restarts, last failure; None in-process."""
    alarms: dict[str, int] = {}
    """Alarms raised so far by this incarnation, by kind (`alarms.ALARM_KINDS`)."""
    last_alarm: str | None = None
    """The latest alarm: its step, kind and message."""
    halted: str | None = None
    """Why training stopped for good (a step masked every token), or None."""


class TrainerHandle:
    """The trainer's handle: what /status and /metrics read of it."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.groups: dict[str, int] = {}
        self.alarms: dict[str, int] = {}
        self.last_alarm: str | None = None

    def count(self, outcome: str) -> None:
        self.groups[outcome] = self.groups.get(outcome, 0) + 1

    def statistics(self) -> TrainerStatistics:
        t = self.trainer
        ranks = t.engine.status() if isinstance(t.engine, RankEngine) else None
        return TrainerStatistics(version=t.version, step=t.step, queued=len(t.buffer), groups=dict(self.groups),
                                 elapsed_s=round(t.elapsed_s, 3), done=t.done, ranks=ranks, alarms=dict(self.alarms),
                                 last_alarm=self.last_alarm, halted=t.halted)

_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32, 64)

_FIGURES = (("kl", "kl_k3", "k3 mismatch KL"),
            ("out_of_band", "frac_out_of_band", "Fraction of tokens whose ratio is outside the correction band"),
            ("log_ratio_std", "log_ratio_std", "Standard deviation of log p - log q"),
            ("log_ratio_max_abs", "log_ratio_max_abs", "Largest |log p - log q|"))
"""(gauge name part, `MismatchFigures` field, what it is) of the per-sampler mismatch gauges."""


def _measured(f: MismatchFigures) -> bool:
    return f.tokens > 0 and not any(math.isnan(getattr(f, name)) for name in (
        "kl_k3", "frac_out_of_band", "log_ratio_mean", "log_ratio_std", "log_ratio_max_abs"))


def mismatch_report(m: StepMetrics, corrections: CorrectionConfig) -> SamplerMismatch | None:
    """The `SamplerMismatch` the pool gets for step ``m``: its per-kind and per-sampler
    figures, leaving out any entry with a NaN figure (a diverged forward measured
    nothing); None when nothing was measured (a step skipped before its forward)."""
    idents = {s.sampler_id: s for s in m.sampler_identities}
    by_sampler = tuple((idents[sid], f) for sid, f in m.mismatch_by_sampler_id.items()
                       if sid in idents and _measured(f))
    by_kind = {k: f for k, f in m.mismatch_by_kind.items() if _measured(f)}
    if not by_sampler and not by_kind:
        return None
    return SamplerMismatch(step=m.step, version=m.version, mask_low=corrections.mask_low,
                           mask_high=corrections.mask_high, by_kind=by_kind, by_sampler=by_sampler)


class TrainerMetrics:
    """The trainer's Prometheus series (labelled actor=<name> by the kernel)."""

    def __init__(self, ctx: ActorContext, handle: TrainerHandle) -> None:
        mx = ctx.metrics
        self.mx = mx
        self.handle = handle
        self.version = mx.gauge("trainer_version", "Newest published weight version")
        self.step = mx.gauge("trainer_step", "Optimizer steps taken")
        self.queued = mx.gauge("trainer_buffer_groups", "Rollout groups queued in the buffer")
        self.staleness = mx.histogram("trainer_group_staleness", "Staleness of admitted groups (versions)",
                                      buckets=_STALENESS_BUCKETS)
        self.gauges = {name: mx.gauge(f"trainer_{name}", doc) for name, doc in (
            ("loss", "Policy loss of the last step"),
            ("grad_norm", "Gradient L2 norm before clipping, last step"),
            ("reward_mean", "Mean reward of the last batch"),
            ("pass_rate", "Fraction of passed attempts in the last batch"),
            ("frac_masked_tokens", "Fraction of tokens masked by the corrections, last step"),
            ("frac_masked_sequences", "Fraction of sequences masked by the corrections, last step"),
            ("frac_excluded_rows", "Fraction of model calls left out of the last step (greedy calls)"),
            ("mismatch_kl_k3", "k3 KL(sampler || trainer) per token, last step"),
            ("frac_out_of_band", "Fraction of tokens whose ratio p/q is outside the correction band, last step"),
            ("log_ratio_std", "Standard deviation of log p - log q over the tokens, last step"),
            ("log_ratio_max_abs", "Largest |log p - log q| of the last step"),
            ("tokens_per_s", "Generated tokens trained per second, last step"),
            ("delta_ratio", "bf16 bytes / delta bytes of the last published version"),
            ("delta_density", "Fraction of bf16 weights changed by the last version"),
            ("usd_per_rollout", "Sampling dollars per trajectory of the last batch"),
            ("vocabulary_tokens", "Tokens of the last batch drawn from the whole vocabulary"),
            ("tail_mass_mean", "Mean sampler mass outside the listed members of whole-vocabulary tokens, last step"),
            ("centering_bound_max", "Largest bound on the centering gradient left out on whole-vocabulary tokens, "
                                    "last step"),
        )}
        self.rank_restarts = mx.gauge("trainer_rank_restarts", "Restarts of the trainer's rank group")
        self.cost = mx.counter("trainer_cost_usd_total", "Sampling dollars of the trained batches")

    def alarm(self, a: Alarm) -> None:
        self.handle.alarms[a.kind] = self.handle.alarms.get(a.kind, 0) + 1
        self.handle.last_alarm = f"step {a.step}: {a.kind}: {a.message}"
        self.mx.counter("trainer_alarms_total", "Correction alarms raised by train steps, by kind",
                        {"alarm": a.kind}).inc()

    def mismatch_reports(self, result: str) -> None:
        self.mx.counter("trainer_mismatch_reports_total", "SamplerMismatch reports to the pool, by result",
                        {"result": result}).inc()

    def group(self, outcome: str) -> None:
        self.handle.count(outcome)
        self.mx.counter("trainer_groups_total", "Rollout groups by outcome", {"outcome": outcome}).inc()

    def observe(self, m: StepMetrics) -> None:
        for name, g in self.gauges.items():
            g.set(getattr(m, name))
        ranks = self.handle.statistics().ranks
        if ranks is not None:
            self.rank_restarts.set(ranks.restarts)
        for key, f in m.mismatch_by_kind.items():
            for part, field, doc in _FIGURES:
                self.mx.gauge(f"trainer_mismatch_{part}_by_sampler",
                              f"{doc} per sampler kind (backend/dtype), last step with its tokens",
                              {"sampler": key}).set(getattr(f, field))
        for sid, f in m.mismatch_by_sampler_id.items():
            for part, field, doc in _FIGURES:
                self.mx.gauge(f"trainer_mismatch_{part}_by_sampler_id",
                              f"{doc} per sampler, last step with its tokens", {"sampler_id": sid}
                              ).set(getattr(f, field))
        self.mx.counter("trainer_steps_total", "Train steps by result",
                        {"result": "skipped" if m.skipped else "trained"}).inc()
        self.cost.inc(m.cost_usd)


class Progress:
    """A tqdm bar on stderr: steps of the budget, last reward and pass rate."""

    def __init__(self, enabled: bool, total: int | None, initial: int) -> None:
        self.bar: Any = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="training", unit="step", file=sys.stderr,
                            dynamic_ncols=True, mininterval=0.5)

    def step(self, m: StepMetrics, time_left_s: float | None = None) -> None:
        if self.bar is None:
            return
        extra = {} if time_left_s is None else {"time_left": f"{time_left_s / 60:.1f}min"}
        self.bar.set_postfix(version=m.version, reward=f"{m.reward_mean:.3f}", pass_rate=f"{m.pass_rate:.3f}",
                             **extra, refresh=False)
        self.bar.update(0 if m.skipped else 1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

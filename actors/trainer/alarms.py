"""When a train step says the samplers' tokens are not what the trainer can learn from (pure).

`step_alarms` reads one step's `StepMetrics` against the trainer's `CorrectionAlarms` and
returns the alarms it raises, each with its figure, its threshold, what it means and the
fix. The trainer writes their kinds into the step's metrics line (``alarms``), and the
actor logs each as a warning event (the terminal, the daemon log, the dashboard's event
list), counts it (``trainer_alarms_total``) and keeps the latest in /status. An
``all_masked`` alarm is an error: the trainer stops training and halts the run
(docs/reference/corrections.md, "Alarms"), since every following step would be the same
zero-gradient step with a loss that reads 0.
"""

from __future__ import annotations

import msgspec

from .config import CorrectionAlarms
from .step import ALL_MASKED_REASON, StepMetrics

__all__ = ["ALARM_KINDS", "ALL_MASKED_REASON", "Alarm", "step_alarms"]

ALARM_KINDS = ("all_masked", "masked_tokens", "masked_sequences", "excluded_rows", "tail_mass")

class Alarm(msgspec.Struct, frozen=True, kw_only=True):
    """One alarm of one step."""

    kind: str
    """One of `ALARM_KINDS`."""
    step: int
    value: float
    """The figure that raised it (a fraction)."""
    threshold: float
    """The configured share it exceeded (1.0 for ``all_masked``)."""
    message: str
    fix: str

    @property
    def fatal(self) -> bool:
        """Training cannot go on (``all_masked``)."""
        return self.kind == "all_masked"


_MISMATCH_FIX = ("compare the samplers' mismatch in metrics.jsonl (mismatch_by_kind, frac_out_of_band per "
                 "sampler): a sampler in another precision or far behind the trainer, or a band "
                 "(corrections.mask_low/mask_high, seq_mask) narrower than the mismatch it must absorb")


def step_alarms(m: StepMetrics, cfg: CorrectionAlarms) -> list[Alarm]:
    """The alarms step ``m`` raises under ``cfg`` (module docstring), in `ALARM_KINDS` order."""
    out: list[Alarm] = []
    if m.skipped and m.skipped_reason == ALL_MASKED_REASON:
        out.append(Alarm(kind="all_masked", step=m.step, value=1.0, threshold=1.0,
                         message=f"the corrections masked every one of the step's {m.tokens} tokens: the step "
                                 "trained on nothing (its loss reads 0)",
                         fix=_MISMATCH_FIX))
    else:
        if m.tokens and m.frac_masked_tokens > cfg.masked_tokens:
            out.append(Alarm(kind="masked_tokens", step=m.step, value=m.frac_masked_tokens,
                             threshold=cfg.masked_tokens,
                             message=f"the corrections masked {m.frac_masked_tokens:.1%} of the step's {m.tokens} "
                                     f"tokens (alarm above {cfg.masked_tokens:.0%}): the masked tokens carry "
                                     "no gradient", fix=_MISMATCH_FIX))
        if m.tokens and m.frac_masked_sequences > cfg.masked_sequences:
            out.append(Alarm(kind="masked_sequences", step=m.step, value=m.frac_masked_sequences,
                             threshold=cfg.masked_sequences,
                             message=f"the sequence mask dropped {m.frac_masked_sequences:.1%} of the step's "
                                     f"sequences (alarm above {cfg.masked_sequences:.0%})", fix=_MISMATCH_FIX))
    if m.frac_excluded_rows > cfg.excluded_rows:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(m.excluded_rows.items()))
        out.append(Alarm(kind="excluded_rows", step=m.step, value=m.frac_excluded_rows, threshold=cfg.excluded_rows,
                         message=f"{m.frac_excluded_rows:.1%} of the step's model calls were left out of the loss "
                                 f"because they cannot carry a gradient ({reasons})",
                         fix='a greedy harness (temperature 0 or top_k 1) trains nothing: set the endpoint\'s '
                             '[sampling] policy = "override" to sample its calls at the run\'s settings, or have '
                             'the harness sample at a temperature > 0'))
    if m.vocabulary_tokens and m.tail_mass_mean > cfg.tail_mass:
        out.append(Alarm(kind="tail_mass", step=m.step, value=m.tail_mass_mean, threshold=cfg.tail_mass,
                         message=f"the step's {m.vocabulary_tokens} whole-vocabulary tokens left on average "
                                 f"{m.tail_mass_mean:.1%} of the sampler's mass outside their listing (alarm above "
                                 f"{cfg.tail_mass:.0%}): centering over the listing is approximate (bound "
                                 f"{m.centering_bound_max:.3g} per token at worst)",
                         fix="raise the samplers' max_support, or sample with top_p < 1 or a top_k (a listed "
                             "support: exact centering) instead of the whole vocabulary"))
    return out

"""The doctor's hazards and the figures it reads (pure): what the checks share.

`Hazard` is one finding: its stable id (`HAZARDS`, every id and its meaning in one line),
the key path or figure it is about (``where``), what is wrong and the fix. The
thresholds of the measured rules are the constants below. `MetricsLine`,
`TrainerFigures`, `SupportFigures` and `RunFigures` hold a run's recent figures (read by
`state.read_run`, checked by `run_checks.check_run`). `locate(hazards, text)` fills in
the line of each config hazard from the config's text (`fleetrl.daemon.config.key_line`,
the lines config errors name). docs/guides/doctor.md states every rule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec

from fleetrl.actors.trainer.config import CorrectionAlarms
from fleetrl.actors.trainer.step import ALL_MASKED_REASON as ALL_MASKED
from fleetrl.daemon.config import key_line

from .wiring import KeyPath

__all__ = [
    "ALL_MASKED", "BAND_NEAR_ONE", "CAP_SHARE", "HAZARDS", "TAIL_MASS", "Hazard", "MetricsLine", "RunFigures",
    "SupportFigures", "TrainerFigures", "locate",
]

HAZARDS: dict[str, str] = {
    # sampling
    "evaluator-sampling-mismatch": "the evaluator samples with other settings than the trained calls",
    "greedy-harness": "a built-in harness samples greedily (temperature 0) or from one token (top_k 1)",
    "endpoint-admits-greedy": "an endpoint's refuse policy lets greedy calls through",
    "trainer-temperature-mismatch": "the trainer's temperature differs from the calls' temperature",
    "top-k-above-cap": "a top_k above the samplers' max_support, which silently lowers it",
    "single-token-support": "max_support = 1: every token is drawn from one token",
    "harness-config-invalid": "a built-in harness's harness_config fails when the worker starts",
    # staleness and pacing
    "pool-staleness-above-trainer": "the pool generates staler attempts than the trainer accepts",
    "pacing-step-size": "the pool's attempts_per_step is not groups_per_step x group_size",
    "pacing-zero-variance-mirror": "the worker's trainer_skips_zero_variance contradicts the trainer",
    "pacing-shared-pool": "two workers pace through one pool",
    "announce-missing": "the trainer does not announce its versions to a pool or evaluator that needs them",
    "unknown-actor": "a setting names an actor the config does not have (or one of another kind)",
    # corrections and alarms
    "corrections-weighting-none": "corrections.weighting = none: no importance weighting",
    "corrections-centering-off": "corrections.centering = false",
    "corrections-mask-band": "a mask band that excludes the ratio 1 or is absurdly tight",
    "corrections-uncapped-weights": "importance weights without an upper bound",
    "alarms-off": "a correction alarm set to 1.0 (never)",
    # measured (--state-dir)
    "masked-tokens-above-alarm": "recent steps masked more of their tokens than the alarm threshold",
    "masked-sequences-above-alarm": "recent steps masked more of their sequences than the alarm threshold",
    "excluded-rows-above-alarm": "recent steps excluded more of their rows than the alarm threshold",
    "out-of-band-unmasked": "weighting none trained on tokens outside the band above the alarm threshold",
    "skipped-steps": "recent steps took no optimizer step",
    "unrecorded-rows": "rows scored at the trainer's temperature although the calls may have used another",
    "support-cap-binds": "the support cap, not top_p, chose the recorded supports",
    "support-tail-mass": "whole-vocabulary draws whose listing misses much of the sampler's mass",
}
"""Every hazard id and what it means in one line (docs/guides/doctor.md has the rules)."""

BAND_NEAR_ONE = (0.9, 1.1)
"""A token mask band must contain these ratios: a band narrower than +-10% around 1
drops tokens that ordinary staleness and 16-bit rounding move that far."""
CAP_SHARE = 0.05
"""``support-cap-binds``: more than this share of the recorded positions of calls with
``top_p < 1`` have exactly ``max_support`` members."""
TAIL_MASS = 0.05
"""``support-tail-mass``: the token-weighted mean tail mass of whole-vocabulary draws
above which the listing leaves too much of q out of centering."""
_DEFAULT_ALARMS = CorrectionAlarms()
"""The ``skipped_reason`` of a step whose corrections kept no token."""


class Hazard(msgspec.Struct, frozen=True, kw_only=True):
    """One hazard: its id (`HAZARDS`), where (a config key path, or a figure of a
    state file), what is wrong, the fix; ``file`` and ``line`` locate it."""

    id: str
    where: str
    message: str
    fix: str
    file: str = ""
    line: int | None = None

    def __post_init__(self) -> None:
        if self.id not in HAZARDS:
            raise ValueError(f"unknown hazard id {self.id!r}")


class MetricsLine(msgspec.Struct, frozen=True, kw_only=True):
    """One line of a trainer's ``metrics.jsonl`` (a `StepMetrics` as JSON, read as a
    dict so that fields of other releases are neither required nor refused)."""

    line: int
    data: dict[str, Any]


class TrainerFigures(msgspec.Struct, frozen=True, kw_only=True):
    """A trainer's recent steps: the last lines of its ``metrics.jsonl``."""

    trainer: str
    path: str
    lines: tuple[MetricsLine, ...]


class SupportFigures(msgspec.Struct, frozen=True, kw_only=True):
    """The supports recorded in a worker's ATIF files (``atif = {support = true}``)."""

    worker: str
    path: str
    """The directory of the files."""
    files: int
    listed: dict[int, int]
    """Positions whose support was the listed one (rule ``"listed"``), by its size."""
    vocabulary: int = 0
    """Positions drawn from the whole vocabulary (rule ``"vocabulary"``)."""


class RunFigures(msgspec.Struct, frozen=True, kw_only=True):
    """What `state.read_run` found in a run's state directory."""

    state_dir: str
    trainers: tuple[TrainerFigures, ...] = ()
    supports: tuple[SupportFigures, ...] = ()


def _key(path: KeyPath) -> str:
    return ".".join(path)


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


class _Found:
    def __init__(self, source: str) -> None:
        self.source = source
        self.out: list[Hazard] = []

    def add(self, hid: str, path: KeyPath, message: str, fix: str) -> None:
        h = Hazard(id=hid, where=_key(path), message=message, fix=fix, file=self.source)
        if h not in self.out:  # two workers wired alike find the same hazard once
            self.out.append(h)


# -- lines --------------------------------------------------------------------------------

def locate(hazards: Sequence[Hazard], text: str, source: str) -> list[Hazard]:
    """``hazards`` with the line of each hazard of the config ``source`` (``file`` =
    ``source``) found in ``text``, its TOML; the others as they are."""
    out = []
    for h in hazards:
        if h.line is None and h.file == source:
            line = key_line(text, [p for p in h.where.split(".") if p])
            h = msgspec.structs.replace(h, line=line)
        out.append(h)
    return out

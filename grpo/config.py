"""CorrectionConfig: which off-policy corrections :func:`policy_loss` applies.

A frozen msgspec Struct so it can sit inside the daemon's TOML config and be decoded
with ``msgspec.convert`` (validation errors then surface as ``msgspec.ValidationError``
naming the field); constructing it directly raises :class:`BadLossInput` (a
``ValueError``). Every field is checked at construction, including its type, since
direct construction of a msgspec Struct does not type-check.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from .errors import BadLossInput

__all__ = ["CorrectionConfig", "Weighting", "Normalization"]

Weighting = Literal["none", "tis", "mask", "tis+mask"]
Normalization = Literal["token", "sequence"]
_WEIGHTINGS = ("none", "tis", "mask", "tis+mask")
_NORMALIZATIONS = ("token", "sequence")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadLossInput(f"CorrectionConfig.{name} must be a number, got {value!r}")
    if math.isnan(value):
        raise BadLossInput(f"CorrectionConfig.{name} must not be NaN")
    return float(value)


class CorrectionConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Off-policy corrections for the GRPO token loss (see docs/reference/corrections.md).

    weighting:
        How the importance ratio ``rho = p^S(a) / q^S(a)`` weights a token.
        ``"none"``: weight 1 (plain GRPO, samples treated as on-policy).
        ``"tis"``: truncated IS, ``min(rho, tis_cap)``.
        ``"mask"``: ``rho`` inside the band ``[mask_low, mask_high]``, token dropped
        outside it (masked IS / IcePop).
        ``"tis+mask"``: dropped outside the band, ``min(rho, tis_cap)`` inside.
    tis_cap:
        ``C`` of truncated IS; > 0, may be ``inf`` (untruncated IS).
    mask_low, mask_high:
        The band ``[L, U]`` on ``rho``; ``0 <= L < U``, ``U`` may be ``inf``.
    seq_mask:
        ``None`` or ``(low, high)``: drop a whole sequence when the geometric mean of
        its ``rho`` over counted tokens, ``exp(mean log rho)``, is outside the interval.
    centering:
        Subtract the exact expected weighted score under the sampler's support
        (needs ``support_logprobs``).
    normalization:
        ``"token"``: mean over every kept token of the batch. ``"sequence"``: mean over
        sequences of their kept-token mean; sequences with no kept token left out.
    """

    weighting: Weighting = "mask"
    tis_cap: float = 2.0
    mask_low: float = 0.5
    mask_high: float = 5.0
    seq_mask: tuple[float, float] | None = None
    centering: bool = True
    normalization: Normalization = "token"

    def __post_init__(self) -> None:
        if self.weighting not in _WEIGHTINGS:
            raise BadLossInput(f"CorrectionConfig.weighting must be one of {_WEIGHTINGS}, got {self.weighting!r}")
        if self.normalization not in _NORMALIZATIONS:
            raise BadLossInput(
                f"CorrectionConfig.normalization must be one of {_NORMALIZATIONS}, got {self.normalization!r}"
            )
        if not isinstance(self.centering, bool):
            raise BadLossInput(f"CorrectionConfig.centering must be a bool, got {self.centering!r}")
        cap = _number("tis_cap", self.tis_cap)
        if cap <= 0:
            raise BadLossInput(f"CorrectionConfig.tis_cap must be > 0 (inf allowed), got {cap!r}")
        low = _number("mask_low", self.mask_low)
        high = _number("mask_high", self.mask_high)
        if not (0 <= low < high) or math.isinf(low):
            raise BadLossInput(
                f"CorrectionConfig.mask_low/mask_high must satisfy 0 <= mask_low < mask_high "
                f"(mask_high may be inf), got [{low!r}, {high!r}]"
            )
        if self.seq_mask is not None:
            pair = self.seq_mask
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise BadLossInput(f"CorrectionConfig.seq_mask must be None or a (low, high) pair, got {pair!r}")
            s_low = _number("seq_mask[0]", pair[0])
            s_high = _number("seq_mask[1]", pair[1])
            if not (0 <= s_low < s_high) or math.isinf(s_low):
                raise BadLossInput(
                    f"CorrectionConfig.seq_mask must satisfy 0 <= low < high (high may be inf), got {pair!r}"
                )

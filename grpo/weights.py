"""Importance weights in log space: truncated IS, two-sided masks, sequence mask.

All functions take log-ratios ``log rho = log p^S - log q^S`` (no gradient) and
return log-weights, ``-inf`` meaning "masked". Working in log space keeps every weight
finite for log-ratios far outside the float range of ``rho`` itself.

Sources: truncated IS (TIS) and masked IS (MIS) for the rollout/training mismatch,
Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training"; the two-sided token band, "IcePop" (Ring-1T, arXiv 2510.18855); the
geometric-mean sequence mask, verl's rollout-correction notes (rollout_corr_math.md).
Departure: IcePop drops tokens outside the band but keeps weight 1 inside it; here
``"mask"`` keeps the IS weight ``rho`` inside the band (MIS), as docs/reference/corrections.md asks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import CorrectionConfig

__all__ = ["log_weights", "in_band", "kept_tokens", "sequence_keep"]


def _log(x: float) -> float:
    return -math.inf if x == 0 else math.log(x)


def in_band(log_ratio: Tensor, low: float, high: float) -> Tensor:
    """Boolean: ``low <= exp(log_ratio) <= high``, decided in log space."""
    return (log_ratio >= _log(low)) & (log_ratio <= _log(high))


def log_weights(log_ratio: Tensor, config: CorrectionConfig) -> Tensor:
    """Log of the token weight ``f(rho)`` chosen by ``config.weighting``; ``-inf`` = masked.

    none: 0. tis: ``min(log rho, log C)``. mask: ``log rho`` inside ``[L, U]``.
    tis+mask: ``min(log rho, log C)`` inside ``[L, U]``.
    """
    lr = log_ratio.detach()
    w = config.weighting
    if w == "none":
        return torch.zeros_like(lr)
    capped = lr.clamp(max=_log(config.tis_cap)) if w in ("tis", "tis+mask") else lr
    if w == "tis":
        return capped
    return capped.masked_fill(~in_band(lr, config.mask_low, config.mask_high), -math.inf)


def sequence_keep(log_ratio_BT: Tensor, mask_BT: Tensor, config: CorrectionConfig) -> Tensor:
    """Sequences [B] kept by the geometric-mean mask (all True when ``seq_mask`` is None).

    The geometric mean ``exp(mean_t log rho_t)`` runs over the sequence's loss-mask
    tokens (token-level masking does not change it). A sequence without such tokens
    is kept; it contributes nothing anyway.
    """
    B = log_ratio_BT.shape[0]
    if config.seq_mask is None:
        return torch.ones(B, dtype=torch.bool, device=log_ratio_BT.device)
    m = mask_BT.to(log_ratio_BT.dtype)
    n = m.sum(-1)
    mean_lr = (log_ratio_BT.detach() * m).sum(-1) / n.clamp(min=1)
    low, high = config.seq_mask
    return in_band(mean_lr, low, high) | (n == 0)


def kept_tokens(log_ratio_BT: Tensor, mask_BT: Tensor, config: CorrectionConfig) -> Tensor:
    """Tokens [B, T] the loss keeps: loss-mask positions whose weight is finite (not
    masked by the token band) in sequences the sequence mask keeps. The loss-mask
    positions outside it are the *masked* tokens (`policy_loss`'s ``tokens_masked``)."""
    logw = log_weights(log_ratio_BT, config)
    return mask_BT & torch.isfinite(logw) & sequence_keep(log_ratio_BT, mask_BT, config).unsqueeze(-1)

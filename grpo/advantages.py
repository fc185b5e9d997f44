"""Group-relative advantages (GRPO, Shao et al. 2024, "DeepSeekMath").

For ``G`` attempts at one task with rewards ``r_1..r_G``: ``A_i = r_i - mean(r)``,
optionally divided by ``std(r) + eps``; or, with ``leave_one_out``, the baseline of
attempt ``i`` is the mean of the *other* attempts (RLOO, Ahmadian et al. 2024), which
equals ``G / (G - 1) * (r_i - mean(r))``.

Departures, on purpose: the std is the population std (``correction=0``), so it is
defined for every ``G >= 1``; a group whose rewards are all equal gets exactly zero
advantages (not rounding noise); a single attempt (``G == 1``) has no baseline and gets
zero. Works on the last dimension, so ``rewards_NG`` (N groups) is the batched form.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import BadLossInput

__all__ = ["group_advantages"]


def group_advantages(
    rewards_G: Tensor, *, std_normalize: bool = False, leave_one_out: bool = False, eps: float = 1e-6
) -> Tensor:
    """Advantages for each attempt of a group; groups along the last dimension.

    ``rewards_G`` is ``[G]`` or ``[..., G]``; the result has the same shape and a
    floating dtype (float32 for integer rewards). No gradient flows to the rewards.
    """
    if not isinstance(rewards_G, Tensor):
        raise BadLossInput(f"rewards must be a torch.Tensor, got {type(rewards_G).__name__}")
    if rewards_G.dim() == 0:
        raise BadLossInput("rewards must have a group dimension (shape [G] or [..., G]), got a scalar")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps >= 0 and math.isfinite(eps)):
        raise BadLossInput(f"eps must be a finite number >= 0, got {eps!r}")
    r = rewards_G.detach()
    if not r.is_floating_point():
        r = r.float()
    if not torch.isfinite(r).all():
        idx = tuple((~torch.isfinite(r)).nonzero()[0].tolist())
        raise BadLossInput(f"rewards must be finite; found {float(r[idx])} at index {idx}")
    G = r.shape[-1]
    if G == 0:
        return r.clone()
    equal = (r == r[..., :1]).all(-1, keepdim=True)
    centred = r - r.mean(-1, keepdim=True)
    if leave_one_out:
        centred = centred * (G / (G - 1)) if G > 1 else torch.zeros_like(r)
    if std_normalize:
        centred = centred / (r.std(-1, correction=0, keepdim=True) + eps)
    return torch.where(equal, torch.zeros_like(centred), centred)

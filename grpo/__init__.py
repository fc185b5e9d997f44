"""fleetrl.grpo: the GRPO math of fleetrl, pure functions on torch tensors.

Group advantages, sampling supports and their replay by the trainer, importance
weights in log space, exact score centering, and the corrected policy loss. No I/O,
no globals; see docs/reference/corrections.md for the user guide and refs/corrections.md for
the math.
"""

from .advantages import group_advantages
from .config import CorrectionConfig, Normalization, Weighting
from .errors import BadLossInput
from .loss import policy_loss
from .support import replay_logprobs, sample_from_support, sampler_support
from .weights import log_weights

__all__ = [
    "BadLossInput",
    "CorrectionConfig",
    "Normalization",
    "Weighting",
    "group_advantages",
    "log_weights",
    "policy_loss",
    "replay_logprobs",
    "sample_from_support",
    "sampler_support",
]

"""fleetrl.grpo: the GRPO math of fleetrl, pure functions on torch tensors.

Group advantages, sampling supports and their replay by the trainer, importance
weights in log space, exact score centering, and the corrected policy loss. No I/O,
no globals; see docs/reference/corrections.md for the user guide and the math.
"""

from .advantages import group_advantages
from .config import CorrectionConfig, Normalization, Weighting
from .errors import BadLossInput
from .loss import SupportLogits, policy_loss, policy_loss_gathered, replay_sampled
from .support import replay_logprobs, sample_from_support, sample_from_vocabulary, sampler_support, vocabulary_listing
from .weights import log_weights

__all__ = [
    "BadLossInput",
    "CorrectionConfig",
    "SupportLogits",
    "Normalization",
    "Weighting",
    "group_advantages",
    "log_weights",
    "policy_loss",
    "policy_loss_gathered",
    "replay_logprobs",
    "replay_sampled",
    "sample_from_support",
    "sample_from_vocabulary",
    "sampler_support",
    "vocabulary_listing",
]

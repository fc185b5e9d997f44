"""fleetrl.actors.buffer: the rollout buffer with staleness admission (pure logic).

See `admission` for the policy and docs/reference/trainer.md for how the trainer actor uses it.
"""

from .admission import (
    Admitted,
    BufferConfig,
    BufferCounters,
    BufferState,
    Duplicate,
    Outcome,
    RolloutBuffer,
    StaleGroup,
    ZeroVariance,
    staleness_of,
)
from .errors import BadGroup, BufferFull, RolloutBufferError

__all__ = [
    "Admitted",
    "BadGroup",
    "BufferConfig",
    "BufferCounters",
    "BufferFull",
    "BufferState",
    "Duplicate",
    "Outcome",
    "RolloutBuffer",
    "RolloutBufferError",
    "StaleGroup",
    "ZeroVariance",
    "staleness_of",
]

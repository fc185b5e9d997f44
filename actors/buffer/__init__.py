"""fleetrl.actors.buffer: the rollout buffer with staleness admission (pure logic).

See `admission` for the policy and docs/reference/trainer.md for how the trainer actor uses it.
"""

from .admission import (
    Admitted,
    BadGroup,
    BufferConfig,
    BufferCounters,
    BufferFull,
    BufferState,
    Duplicate,
    Outcome,
    RolloutBuffer,
    StaleGroup,
    ZeroVariance,
    staleness_of,
)

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
    "StaleGroup",
    "ZeroVariance",
    "staleness_of",
]

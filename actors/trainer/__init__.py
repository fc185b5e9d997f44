"""fleetrl.actors.trainer: the GRPO trainer actor and its pure parts.

`batch` (RolloutGroups -> padded tensors), `step` (one train step, `StepMetrics`),
`checkpoint` (exact capture / restore), `core` (the trainer's state and blocking
operations), `engine` / `rank_engine` (where the model lives: this process, or supervised
torch.distributed rank processes: `rank_group`, `rank_main`, `rank_protocol`,
`sharding`, `fsdp`, `dcp`), `actor` (the Trio loop: ``fleetrl.actors.trainer:run``). docs/reference/trainer.md
is the guide.
"""

from .actor import run
from .batch import BadBatch, Batch, build_batch, check_group, sampler_key
from .checkpoint import CheckpointError, TrainerCheckpoint
from .config import AdvantageConfig, RanksConfig, TrainerConfig
from .core import Trainer
from .step import StepMetrics, build_optimizer, train_step

__all__ = [
    "AdvantageConfig",
    "BadBatch",
    "Batch",
    "CheckpointError",
    "RanksConfig",
    "StepMetrics",
    "Trainer",
    "TrainerCheckpoint",
    "TrainerConfig",
    "build_batch",
    "build_optimizer",
    "check_group",
    "run",
    "sampler_key",
    "train_step",
]

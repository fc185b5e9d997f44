"""The trainer's errors: input it cannot train on, state it cannot restore.

Every error of `fleetrl.actors.trainer` derives from `TrainerError`; where callers catch a
builtin (ValueError, RuntimeError) it stays a second base."""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["BadBatch", "CheckpointError", "RankProtocolError", "RankStepError", "RanksFailed", "TrainerError"]


class TrainerError(FleetrlError):
    """Root of the errors of `fleetrl.actors.trainer`."""


class BadBatch(TrainerError, ValueError):
    """A group that cannot become training rows; the message names group, attempt, segment."""


class CheckpointError(TrainerError, ValueError):
    """A trainer checkpoint that cannot be restored into this model (says why)."""


class RanksFailed(TrainerError, RuntimeError):
    """The trainer's rank group cannot go on: a rank process died, hung past its limit,
    or failed to start (the message names the rank, its exit status and the log dir)."""


class RankStepError(TrainerError, RuntimeError):
    """A request raised inside the rank processes; the message carries their error."""


class RankProtocolError(TrainerError, ValueError):
    """A frame between the trainer actor and rank 0 that is not a message of
    `rank_protocol` (names what is wrong)."""

"""The trainer's errors: input it cannot train on, state it cannot restore.

Every error of `fleetrl.actors.trainer` derives from `TrainerError`; where callers catch a
builtin (ValueError, RuntimeError) it stays a second base."""

from __future__ import annotations

__all__ = ["BadBatch", "CheckpointError", "TrainerError"]


class TrainerError(Exception):
    """Root of the errors of `fleetrl.actors.trainer`."""


class BadBatch(TrainerError, ValueError):
    """A group that cannot become training rows; the message names group, attempt, segment."""


class CheckpointError(TrainerError, ValueError):
    """A trainer checkpoint that cannot be restored into this model (says why)."""

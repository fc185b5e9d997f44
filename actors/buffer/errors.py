"""The rollout buffer's errors: a group it cannot take, or a misuse of it.

Every error of `fleetrl.actors.buffer` derives from `RolloutBufferError`; where callers catch a
builtin (ValueError, RuntimeError) it stays a second base."""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["BadGroup", "BufferFull", "RolloutBufferError"]


class RolloutBufferError(FleetrlError):
    """Root of the errors of `fleetrl.actors.buffer`."""


class BufferFull(RolloutBufferError, RuntimeError):
    """`offer` on a full buffer: the group was not taken; train, then offer it again."""


class BadGroup(RolloutBufferError, ValueError):
    """A group the buffer cannot judge (e.g. tokens from a version the trainer never had)."""

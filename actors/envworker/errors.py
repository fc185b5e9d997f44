"""An environment worker's errors (a misbehaving harness, a tracker misused).

Every error of `fleetrl.actors.envworker` derives from `EnvWorkerError`; where callers catch a
builtin (ValueError, RuntimeError) it stays a second base."""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["EnvWorkerError", "FilesOnlyError", "GroupStateError"]


class EnvWorkerError(FleetrlError):
    """Root of the errors of `fleetrl.actors.envworker`."""


class GroupStateError(EnvWorkerError, RuntimeError):
    """A ticket ended twice, or a ticket the tracker did not issue was reported."""


class FilesOnlyError(EnvWorkerError, RuntimeError):
    """A harness that declared ``sandbox_use = "files"`` called ``exec`` or ``read_file``."""

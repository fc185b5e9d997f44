"""The remote workers' errors, under one root.

`WorkersError` is what a caller catches for anything `fleetrl.actors.workers` raises of
its own; a refused join is the sampler pool's `JoinRefused` (the same words for both
kinds of remote member).
"""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["DaemonSilent", "UnsafeHarness", "WorkerSetupError", "WorkersError"]


class WorkersError(FleetrlError):
    """Root of the errors of `fleetrl.actors.workers`."""


class UnsafeHarness(WorkersError):
    """A shipped harness the worker refuses to load: unsigned, signed under another key,
    or pickled over a connection without TLS."""


class WorkerSetupError(WorkersError):
    """This host cannot run workers (its Docker engine is not reachable)."""


class DaemonSilent(WorkersError):
    """The daemon sent nothing for five heartbeat intervals."""

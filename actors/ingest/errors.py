"""The ingest actor's errors.

Every error of `fleetrl.actors.ingest` derives from `IngestError`; where callers catch a
builtin (RuntimeError) it stays a second base."""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["IngestError", "StoreError"]


class IngestError(FleetrlError):
    """Root of the errors of `fleetrl.actors.ingest`."""


class StoreError(IngestError, RuntimeError):
    """The store cannot be used: held by another writer, or unreadable."""

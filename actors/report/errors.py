"""Errors of reading a run's records into a report.

Every error of `fleetrl.actors.report` derives from `ReportError`; where callers catch a
builtin (ValueError, RuntimeError) it stays a second base."""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["ReportError", "ReportInputError"]


class ReportError(FleetrlError):
    """Root of the errors of `fleetrl.actors.report`."""


class ReportInputError(ReportError, ValueError):
    """A metrics or eval file cannot be read; the message names ``file:line``."""

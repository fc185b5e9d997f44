"""Errors of `fleetrl.actors.doctor`, under one root.

`DoctorError` is what a caller catches for anything the doctor refuses; a subclass keeps
the builtin base its callers already catch (`DoctorInputError` is a `ValueError`)."""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["DoctorError", "DoctorInputError"]


class DoctorError(FleetrlError):
    """Root of the errors of `fleetrl.actors.doctor`."""


class DoctorInputError(DoctorError, ValueError):
    """A run's state directory (or a file in it) cannot be read; the message names the
    directory, or the file and line."""

"""Errors of orchestrating runs (ablation arms, benches).

Every error of `fleetrl.actors.runs` derives from `RunError`; where callers catch a
builtin (ValueError, RuntimeError) it stays a second base."""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["RunError", "VariantError"]


class RunError(FleetrlError):
    """Root of the errors of `fleetrl.actors.runs`."""


class VariantError(RunError, ValueError):
    """The config cannot be turned into a variant; the message names the key."""

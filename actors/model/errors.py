"""Errors of loading and building models.

Every error of `fleetrl.actors.model` derives from `ModelError`; where callers catch a
builtin (ValueError, RuntimeError) it stays a second base."""

from __future__ import annotations

__all__ = ["ModelDirError", "ModelError"]


class ModelError(Exception):
    """Root of the errors of `fleetrl.actors.model`."""


class ModelDirError(ModelError, ValueError):
    """A model directory is missing, incomplete, or holds an architecture fleetrl does not
    support (the message names its `architectures` entry and the config file)."""

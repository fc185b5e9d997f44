"""The evaluator's errors.

Every error of `fleetrl.actors.evaluator` derives from `EvaluatorError`; where callers catch a
builtin (ValueError, RuntimeError) it stays a second base."""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["EvaluatorError", "ScoringError"]


class EvaluatorError(FleetrlError):
    """Root of the errors of `fleetrl.actors.evaluator`."""


class ScoringError(EvaluatorError, RuntimeError):
    """The sandboxed scoring run itself failed (not a completion's fault)."""

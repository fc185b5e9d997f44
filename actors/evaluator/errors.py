"""The evaluator's errors.

Every error of `fleetrl.actors.evaluator` derives from `EvaluatorError`; where callers catch a
builtin (ValueError, RuntimeError) it stays a second base."""

from __future__ import annotations

__all__ = ["EvaluatorError", "ScoringError"]


class EvaluatorError(Exception):
    """Root of the errors of `fleetrl.actors.evaluator`."""


class ScoringError(EvaluatorError, RuntimeError):
    """The sandboxed scoring run itself failed (not a completion's fault)."""

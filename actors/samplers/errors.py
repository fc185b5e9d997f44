"""Errors of the sampler backends, rooted at `SamplerError` and named for who broke what.

Errors a caller's input causes keep ``ValueError`` as a second base, so code that
catches ``ValueError`` (the sampler pool answers those as a bad request) still does.
"""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = [
    "BadGenerateRequest",
    "BadWeightUpdate",
    "NumericalFailure",
    "SamplerError",
    "UnsupportedModel",
    "VllmSupportError",
]


class SamplerError(FleetrlError):
    """Root of the errors raised by sampler backends."""


class BadGenerateRequest(SamplerError, ValueError):
    """A generate call's prompts or sampling parameters are invalid (the caller's fault)."""


class BadWeightUpdate(SamplerError, ValueError):
    """A weight version handed to a backend does not fit it (names, shapes, version order)."""


class NumericalFailure(SamplerError):
    """The model produced NaN/inf logits (e.g. fp16 overflow, or weights gone bad)."""


class UnsupportedModel(SamplerError, ValueError):
    """The model config uses a feature the torch backend's forward does not implement."""


class VllmSupportError(SamplerError):
    """vLLM returned log-probs that do not describe a support holding the sampled token
    (a vLLM change or misconfiguration; never the caller's fault)."""

"""The sampler pool's errors, under one root.

`PoolError` is what a caller catches for anything the pool refuses or loses; each
subclass keeps the builtin base its callers already catch (`PacingError` is a
`ValueError`, `UnknownSampler` a `KeyError`).
"""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["JoinRefused", "PacingError", "PoolError", "SamplerLost", "UnknownSampler"]


class PoolError(FleetrlError):
    """Anything the sampler pool refuses, or a sampler it lost."""


class PacingError(PoolError, ValueError):
    """Misuse of the pacer: unknown or duplicate attempt ids, bad versions."""


class SamplerLost(PoolError):
    """The sampler is gone or broken; the request it held must be routed elsewhere."""


class UnknownSampler(PoolError, KeyError):
    """No sampler of that id is registered."""


class JoinRefused(PoolError):
    """The daemon refused to let this sampler join (the reason is the message)."""

"""Routing policies: which sampler gets the next request (pure functions, no I/O).

A policy sees an immutable snapshot of every sampler (`SamplerView`) and the bounds of
the request (`Bounds`), and names one sampler or None ("nobody can take it now; wait").
Two rules hold for every policy, and Hypothesis checks them (tests/pool/test_routing.py):

* never a dead sampler;
* never a sampler whose weights are too old: its version must be at least the
  request's ``min_version`` and at least ``trainer_version - max_staleness``.

Policies:

* `least_loaded` (the default): the feasible sampler with the smallest load
  (assigned requests / capacity); ties by id, so the choice is deterministic.
* `cost_aware`: the feasible sampler with the lowest *measured* dollars per generated
  token whose expected latency stays within ``max_latency_s``. A sampler not yet
  measured is tried first (once it has served a request it has a figure), so the policy
  learns the fleet's costs instead of trusting configured guesses. When no sampler keeps
  the latency bound, it falls back to the least-loaded one: work is slowed, never stalled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

__all__ = ["POLICIES", "Bounds", "Policy", "SamplerView", "cost_aware", "expected_latency_s",
           "feasible", "least_loaded", "policy_named"]


class SamplerView(msgspec.Struct, frozen=True, kw_only=True):
    """What routing needs to know about one sampler at one instant."""

    sampler_id: str
    alive: bool
    version: int
    """Weight version the sampler serves now."""
    assigned: int
    """Requests routed to it and not yet answered (running or waiting in its queue)."""
    capacity: int
    """Requests it runs concurrently."""
    usd_per_token: float | None = None
    """Measured cost per generated token (None until it has generated something)."""
    latency_s: float | None = None
    """Measured mean seconds per request (None until measured)."""


class Bounds(msgspec.Struct, frozen=True, kw_only=True):
    """Limits a routed request must respect."""

    trainer_version: int
    max_staleness: int
    min_version: int = 0
    max_latency_s: float = math.inf


Policy = Callable[[Sequence[SamplerView], Bounds], "str | None"]


def feasible(views: Sequence[SamplerView], bounds: Bounds) -> list[SamplerView]:
    """Alive samplers whose weights are new enough for `bounds`."""
    oldest = max(bounds.min_version, bounds.trainer_version - bounds.max_staleness)
    return [v for v in views if v.alive and v.version >= oldest]


def _load(v: SamplerView) -> float:
    return v.assigned / v.capacity


def least_loaded(views: Sequence[SamplerView], bounds: Bounds) -> str | None:
    """The feasible sampler with the least load per unit of capacity (ties: lowest id)."""
    ok = feasible(views, bounds)
    if not ok:
        return None
    return min(ok, key=lambda v: (_load(v), v.sampler_id)).sampler_id


def expected_latency_s(v: SamplerView) -> float | None:
    """Seconds a request routed to `v` now would take: the requests ahead of it share
    the sampler's `capacity` slots, each taking its measured mean latency."""
    if v.latency_s is None:
        return None
    return v.latency_s * (1 + v.assigned // v.capacity)


def cost_aware(views: Sequence[SamplerView], bounds: Bounds) -> str | None:
    """Cheapest measured $ per token among feasible samplers that keep the latency bound.

    Unmeasured samplers with a free slot come first (exploration); then the cheapest
    whose expected latency is within ``bounds.max_latency_s`` (ties: least loaded, then
    id); if none keeps the bound, the least-loaded feasible sampler.
    """
    ok = feasible(views, bounds)
    if not ok:
        return None
    unmeasured = [v for v in ok if v.usd_per_token is None and v.assigned < v.capacity]
    if unmeasured:
        return min(unmeasured, key=lambda v: (_load(v), v.sampler_id)).sampler_id
    within = []
    for v in ok:
        if v.usd_per_token is None:
            continue
        lat = expected_latency_s(v)
        if lat is None or lat <= bounds.max_latency_s:
            within.append(v)
    if within:
        return min(within, key=lambda v: (v.usd_per_token, _load(v), v.sampler_id)).sampler_id
    return least_loaded(ok, bounds)


PolicyName = Literal["least_loaded", "cost_aware"]
POLICIES: dict[str, Policy] = {"least_loaded": least_loaded, "cost_aware": cost_aware}


def policy_named(name: str) -> Policy:
    """The policy called `name`; ValueError listing the known ones otherwise."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None

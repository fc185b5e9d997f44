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

Prompt affinity (`with_affinity`, `AffinityTable`): requests with the same prompt token
ids (a GRPO group's attempts) go to the sampler that already holds one of them, while it
stays feasible and has a free slot, so a batching backend can prefill the shared prompt
once. Otherwise the policy decides. Affinity only ever narrows the policy's feasible
set, so the two rules above hold with it too.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec

__all__ = ["POLICIES", "AffinityTable", "Bounds", "Policy", "SamplerView", "cost_aware", "expected_latency_s",
           "feasible", "least_loaded", "policy_named", "prompt_key", "with_affinity"]


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


# -- prompt affinity ----------------------------------------------------------------------------


def prompt_key(dtype: str, data: bytes) -> bytes:
    """The affinity key of a prompt: a 16-byte BLAKE2b digest of its token ids as they
    travel (dtype name and raw bytes). Sampling parameters are not part of it: requests
    that differ only in those still share the prompt (the batcher keeps their calls apart)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(dtype.encode())
    h.update(b"\0")
    h.update(data)
    return h.digest()


def with_affinity(policy: Policy, views: Sequence[SamplerView], bounds: Bounds,
                  remembered: str | None) -> str | None:
    """`remembered` (the sampler holding requests with the same prompt) if it is feasible
    for `bounds` and has a free slot (assigned < capacity); otherwise ``policy``'s choice."""
    if remembered is not None:
        for v in feasible(views, bounds):
            if v.sampler_id == remembered and v.assigned < v.capacity:
                return remembered
    return policy(views, bounds)


class _Entry:
    __slots__ = ("outstanding", "sampler_id")

    def __init__(self, sampler_id: str | None) -> None:
        self.sampler_id = sampler_id
        self.outstanding = 0


class AffinityTable:
    """Where the outstanding requests of each prompt went (pure bookkeeping).

    An entry lives while at least one request with its key is outstanding (routed and
    not yet ended): `routed` adds one and remembers the sampler chosen (the memory moves
    with each choice), `ended` removes one and drops the entry at zero, so the table
    holds at most one entry per outstanding request. `forget_sampler` clears the memory
    of a sampler that was taken out, so no key leads back to it.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[bytes, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def sampler_for(self, key: bytes) -> str | None:
        """The sampler remembered for `key` (None: no outstanding request, or forgotten)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.sampler_id

    def outstanding(self, key: bytes) -> int:
        entry = self._entries.get(key)
        return 0 if entry is None else entry.outstanding

    def routed(self, key: bytes, sampler_id: str) -> None:
        """A request with `key` was sent to `sampler_id`."""
        entry = self._entries.setdefault(key, _Entry(sampler_id))
        entry.sampler_id = sampler_id
        entry.outstanding += 1

    def ended(self, key: bytes) -> None:
        """A routed request with `key` is over (answered, failed, lost, or cancelled)."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"affinity: no outstanding request with prompt key {key.hex()}")
        entry.outstanding -= 1
        if entry.outstanding == 0:
            del self._entries[key]

    def forget_sampler(self, sampler_id: str) -> None:
        """`sampler_id` was taken out: its keys keep their counts but lose the memory."""
        for entry in self._entries.values():
            if entry.sampler_id == sampler_id:
                entry.sampler_id = None

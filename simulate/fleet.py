"""What the simulator is given: clouds with their samplers, links, prices and failures
(pure data), and a preset of 15 clouds."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

__all__ = ["Cloud", "Fleet", "GPUS", "Strategy", "preset_fleet"]

Strategy = Literal["direct", "cache", "relay"]

GPUS: dict[str, float] = {"H200": 3400.0, "H100": 3000.0, "A100": 1600.0, "L40S": 1100.0, "A10G": 450.0}
"""Decode tokens/s per GPU of a mid-size model (a preset's scale, not a measurement)."""


class Cloud(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    samplers: int
    gpu: str = "H100"
    gbps: float = 25.0
    """Each sampler's network (download and upload), Gbit/s."""
    cache_gbps: float = 100.0
    """The cloud's cache (strategy ``cache``): what it serves to the cloud's samplers."""
    rtt_ms: float = 50.0
    """Round trip to the origin (the trainer's cloud); within a cloud: ``local_rtt_ms``."""
    egress_usd_per_gb: float = 0.08
    """What this cloud charges for a GB leaving it."""
    failure_per_gb: float = 0.0
    """Probability that a transfer from or into this cloud breaks, per GB sent (resumed
    with a ranged GET after ``Fleet.reconnect_s``)."""
    usd_per_gpu_hour: float = 2.5

    def __post_init__(self) -> None:
        if self.samplers < 0 or self.gbps <= 0 or self.cache_gbps <= 0 or self.rtt_ms < 0:
            raise ValueError(f"cloud {self.name!r}: samplers >= 0, gbps > 0, cache_gbps > 0, rtt_ms >= 0")
        if not 0 <= self.failure_per_gb < 1:
            raise ValueError(f"cloud {self.name!r}: failure_per_gb must be in [0, 1)")
        if self.gpu not in GPUS:
            raise ValueError(f"cloud {self.name!r}: gpu {self.gpu!r} is not one of {', '.join(GPUS)}")


class Fleet(msgspec.Struct, frozen=True, kw_only=True):
    clouds: tuple[Cloud, ...]
    origin: int = 0
    """Index of the trainer's cloud."""
    origin_gbps: float = 100.0
    """The trainer's uplink (the delta store's), Gbit/s."""
    local_rtt_ms: float = 1.0
    tcp_window_mib: float = 64.0
    """One connection's window: a transfer over a round trip of r seconds moves at most
    window/r bytes per second."""
    chunk_mib: float = 64.0
    """Transfers go in chunks of this size (ranged GETs); a relay or cache forwards a
    chunk once it holds it (pipelining), and one chunk request costs one round trip."""
    reconnect_s: float = 1.0
    relay_fanout: int = 4
    apply_gbps: float = 16.0
    """How fast a sampler applies a delta once it holds it (Gbit/s of delta)."""
    sync_round_trips: int = 0
    """Requests a sampler makes from publication before its first chunk request, one
    round trip each over the same path (fleetrl's follower reads the version pointer and
    the manifest: 2). Behind a cache (strategy ``cache``) the first, the version pointer,
    is never cached: it goes through the cache to the origin (``local_rtt_ms`` plus
    ``cache_origin_round_trips`` of the cloud's round trips); the others (the manifest,
    a blob) are cache misses: the same for the cloud's first sampler, a lock wait for the
    others when ``cache_lock_poll_s`` > 0."""
    cache_lock_poll_s: float = 0.0
    """Strategy ``cache``. 0: an ideal cache, fetching from publication and forwarding each
    chunk to all its samplers as soon as it holds it. > 0: nginx with ``proxy_cache_lock``
    (fleetrl's documented cache; nginx: 0.5): the cloud's first sampler's request makes the
    cache fetch the delta in one streamed response, which that sampler receives as it
    arrives; the cloud's other samplers wait for the whole delta, re-checking every
    ``cache_lock_poll_s`` from their request, then stream it from the cache."""
    cache_origin_round_trips: int = 1
    """Strategy ``cache``: round trips of a request the cache passes to the origin (2 when
    each opens a new TCP connection, as nginx does without upstream keepalive; 3-4 with
    TLS)."""

    def __post_init__(self) -> None:
        if not self.clouds or not 0 <= self.origin < len(self.clouds):
            raise ValueError("a fleet needs clouds and an origin among them")
        if self.origin_gbps <= 0 or self.chunk_mib <= 0 or self.tcp_window_mib <= 0 or self.apply_gbps <= 0:
            raise ValueError("origin_gbps, chunk_mib, tcp_window_mib and apply_gbps must be > 0")
        if self.relay_fanout < 1:
            raise ValueError("relay_fanout must be >= 1")
        if self.sync_round_trips < 0:
            raise ValueError("sync_round_trips must be >= 0")
        if self.cache_lock_poll_s < 0 or self.cache_origin_round_trips < 1:
            raise ValueError("cache_lock_poll_s must be >= 0 and cache_origin_round_trips >= 1")

    @property
    def samplers(self) -> int:
        return sum(c.samplers for c in self.clouds)


_PRESET = [  # name, gpu, Gbit/s per sampler, RTT ms to the origin, egress $/GB, failures per GB, $/GPU-h
    ("aws-us-east-1", "H100", 100, 1, 0.09, 0.0005, 3.9), ("aws-us-west-2", "H100", 100, 65, 0.09, 0.0005, 3.9),
    ("gcp-us-central1", "H100", 100, 30, 0.12, 0.0005, 3.7), ("azure-eastus", "H100", 80, 8, 0.087, 0.001, 4.0),
    ("coreweave-us-east", "H100", 200, 12, 0.0, 0.001, 2.2), ("lambda-us-tx", "H100", 50, 40, 0.0, 0.002, 2.5),
    ("oci-us-ashburn", "H200", 100, 4, 0.0085, 0.001, 3.5), ("aws-eu-west-1", "H100", 100, 75, 0.09, 0.0005, 4.1),
    ("gcp-europe-west4", "A100", 50, 90, 0.12, 0.001, 2.9), ("nebius-eu-north", "H200", 100, 110, 0.0, 0.002, 2.3),
    ("ovh-eu-gra", "L40S", 25, 85, 0.0, 0.003, 1.4), ("aws-ap-northeast-1", "H100", 100, 160, 0.114, 0.001, 4.3),
    ("gcp-asia-southeast1", "A100", 50, 230, 0.12, 0.002, 3.0), ("runpod-community", "A10G", 10, 120, 0.0, 0.01, 0.5),
    ("vast-marketplace", "L40S", 10, 150, 0.0, 0.02, 0.7),
]


def preset_fleet(samplers: int, clouds: int = 15, **fleet_kw: float) -> Fleet:
    """`samplers` spread evenly over the first `clouds` of a preset of 15 (US, EU and
    Asia hyperscalers, GPU clouds and marketplaces; rough public list prices and links),
    the trainer in the first. The figures are a scenario, not measurements."""
    if not 1 <= clouds <= len(_PRESET):
        raise ValueError(f"clouds must be in [1, {len(_PRESET)}]")
    base, extra = divmod(samplers, clouds)
    out = []
    for i, (name, gpu, gbps, rtt, egress, fail, price) in enumerate(_PRESET[:clouds]):
        out.append(Cloud(name=name, samplers=base + (1 if i < extra else 0), gpu=gpu, gbps=gbps,
                         cache_gbps=max(100.0, 2 * gbps), rtt_ms=rtt, egress_usd_per_gb=egress,
                         failure_per_gb=fail, usd_per_gpu_hour=price))
    return Fleet(clouds=tuple(out), **fleet_kw)  # type: ignore[arg-type]


def chunks_of(size_bytes: float, chunk_mib: float) -> list[float]:
    """The chunk sizes of a transfer of `size_bytes`."""
    chunk = chunk_mib * (1 << 20)
    n = max(1, math.ceil(size_bytes / chunk))
    return [chunk] * (n - 1) + [size_bytes - chunk * (n - 1)]

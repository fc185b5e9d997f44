"""Settings of the sampler pool actor (``[actors.pool.config]``) and of its local samplers."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = ["LocalSamplerConfig", "PoolConfig"]

PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]


class LocalSamplerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One sampler run inside the daemon."""

    id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]+$")]
    model_dir: str
    backend: Literal["torch", "vllm"] = "torch"
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    device: str = "cpu"
    price_per_hour: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    capacity: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Requests served at once (what routing counts against)."""
    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Most requests in one backend call (concurrent requests are decoded as batches)."""


class PoolConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of the sampler pool actor (``[actors.pool.config]``)."""

    policy: Literal["least_loaded", "cost_aware"] = "least_loaded"
    affinity: bool = True
    """Prompt affinity: a request goes to the sampler holding others with the same prompt
    (while that one is feasible and has a free slot), so a group shares a batch."""
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] = 2
    """Samplers more than this many versions behind the trainer get no requests."""
    max_latency_s: PosFloat = 120.0
    """Cost-aware routing keeps the expected latency of a request under this."""
    request_timeout_s: PosFloat = 600.0
    """A sampler that holds one request longer than this has stopped answering."""
    max_tries: Annotated[int, msgspec.Meta(ge=1)] = 5
    """Samplers a request may break (or be refused by) before it is failed."""
    health_interval_s: PosFloat = 10.0
    health_timeout_s: PosFloat = 30.0
    restart_backoff_s: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    samplers: tuple[LocalSamplerConfig, ...] = ()
    """Local samplers."""
    weights_dir: str | None = None
    """A local delta store (actors/weights LocalDirStore) that local samplers follow."""
    join: bool = True
    """Mount the join endpoint for remote samplers at ``join_prefix`` on the control plane."""
    join_prefix: str = "/fleet"
    fleet_token_file: str | None = None
    """File holding the fleet token; default ``<actor state dir>/fleet_token`` (created, 0600)."""
    heartbeat_s: PosFloat = 2.0
    heartbeat_timeout_s: PosFloat = 10.0
    """A remote silent for this long is treated as dead."""
    reply_to: str | None = None
    """Actor that receives the answers to requests taken from the inbox."""
    attempts_per_step: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Attempts the trainer consumes per version (for staleness pacing)."""

    def __post_init__(self) -> None:
        ids = [s.id for s in self.samplers]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"samplers: duplicate id(s) {', '.join(dup)}")

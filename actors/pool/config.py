"""Settings of the sampler pool actor (``[actors.pool.config]``) and of its local samplers."""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from fleetrl.actors.samplers.vllm_setup import VllmEngineConfig
from fleetrl.daemon.config import RestartPolicy
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT

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
    fp8_scheme: Literal["tensor", "row", "block128"] = "block128"
    """Scale granularity of an fp8 torch sampler (``tensor``: one scale per matrix, the
    coarsest; `fleetrl.actors.weights.quant`)."""
    matmul: Literal["auto", "native", "fp32", "fp16_accumulate"] = "auto"
    """How a torch sampler of a low precision multiplies (`TorchBackendConfig.matmul`);
    ``fp16_accumulate`` (fp16 only) emulates fp16 accumulation."""
    vllm: VllmEngineConfig = VllmEngineConfig()
    """A vLLM sampler's engine settings (``vllm = { max_model_len = 4096, cpu_kv_cache_bytes
    = 1073741824 }``; `VllmEngineConfig`): a real model's context often needs a smaller
    ``max_model_len`` or a larger KV cache than the defaults on a CPU."""
    process: bool = False
    """Run this sampler as a child process of the daemon that joins the pool over the
    remote protocol (`fleetrl sampler --join`) under this id, restarted by the pool after
    it exits (`PoolConfig.process_restart`): a native crash (vLLM) then cannot take the
    daemon down (`fleetrl.actors.pool.children`). Needs the control plane ([http])."""

    def __post_init__(self) -> None:
        if self.matmul == "fp16_accumulate" and self.dtype != "fp16":
            raise ValueError(f"sampler {self.id!r}: matmul = \"fp16_accumulate\" needs dtype = \"fp16\" "
                             f"(got {self.dtype!r})")
        if self.backend != "torch" and (self.fp8_scheme != "block128" or self.matmul != "auto"):
            raise ValueError(f"sampler {self.id!r}: fp8_scheme and matmul are settings of the torch backend, "
                             f"not of {self.backend}")
        if self.backend != "vllm" and self.vllm != VllmEngineConfig():
            raise ValueError(f"sampler {self.id!r}: vllm holds settings of the vllm backend, not of {self.backend}")


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
    """Delay before a taken-out in-process sampler is rebuilt."""
    samplers: tuple[LocalSamplerConfig, ...] = ()
    """Local samplers (in the daemon's process, or child processes with ``process = true``)."""
    weights_dir: str | None = None
    """A local delta store (actors/weights LocalDirStore) that local samplers follow."""
    weights_prefix: str = "/weights"
    """Where the control plane serves the store of ``weights_dir`` (the trainer mounts its
    delta store at ``/weights``): child sampler processes follow it there over HTTP."""
    process_restart: RestartPolicy = RestartPolicy(backoff_base_s=1.0, backoff_max_s=60.0, intensity=5,
                                                   period_s=600.0)
    """Restarts of child sampler processes (the keys of ``[supervisor.restart]``): the delay
    grows from ``backoff_base_s`` by ``backoff_factor`` with each exit within ``period_s``;
    more than ``intensity`` exits within ``period_s`` fail the pool actor."""
    process_start_timeout_s: PosFloat = 600.0
    """A child sampler process must join (and join again after a lost connection) within
    this, or it is killed and restarted (a vLLM engine start takes a minute on a slow CPU)."""
    wait_for_processes: bool = False
    """Hand out the pool (start the actors listed after it) only once every child sampler
    process has joined, waiting at most ``process_start_timeout_s`` (then it starts with a
    warning): a run that must use its vLLM sampler from the first step (the ablation's hard
    regime) sets it; by default the pool serves with whoever is there and children join
    when they are ready."""
    process_grace_s: PosFloat = 10.0
    """At shutdown a child sampler gets SIGTERM, then SIGKILL after this many seconds."""
    join: bool = True
    """Mount the join endpoint for remote samplers at ``join_prefix`` on the control plane."""
    join_prefix: str = "/fleet"
    fleet_token_file: str | None = None
    """File holding the fleet token; default ``<actor state dir>/fleet_token`` (created, 0600)."""
    heartbeat_s: PosFloat = 2.0
    heartbeat_timeout_s: PosFloat = 10.0
    """A remote silent for this long is treated as dead."""
    attempts_per_step: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Attempts the trainer consumes per version (for staleness pacing)."""
    max_support: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_MAX_SUPPORT
    """The most tokens any sampler of the pool draws one token from: a request's ``top_k``
    is lowered to it (set to it when the caller set none), and the local samplers and
    child processes enforce it too. It bounds every token's record (about 8 bytes a
    member) at any vocabulary; replay and centering stay exact
    (docs/reference/corrections.md, "Supports at real vocabularies")."""
    whole_vocabulary: bool = False
    """Let a call that asks for no truncation (``top_p = 1``, no ``top_k``,
    ``temperature > 0``) draw from the whole vocabulary instead of the ``max_support``
    most likely tokens: its record then lists those with the mass outside them, the
    ratios stay exact and centering becomes approximate within a bound the trainer
    reports per step (docs/reference/corrections.md)."""

    def __post_init__(self) -> None:
        ids = [s.id for s in self.samplers]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"samplers: duplicate id(s) {', '.join(dup)}")
        taken = [i for i in ids if _REMOTE_ID.match(i)]
        if taken:
            raise ValueError(f"samplers: id(s) {', '.join(taken)} look like the ids the pool gives joining "
                             "remote samplers (remote-N); choose another")
        if not re.fullmatch(r"(/[A-Za-z0-9_.-]+)+", self.weights_prefix):
            raise ValueError(f"weights_prefix {self.weights_prefix!r} must look like '/weights' (no trailing slash)")


_REMOTE_ID = re.compile(r"^remote-[0-9]+$")

"""A sampler worker in this process: a backend behind the pool's handle interface.

Backends are synchronous (CPU/GPU bound), so `LocalSampler` runs each generate call in a
worker thread and at most ``capacity`` of them at once. It converts between the wire
messages (`fleetrl.daemon.messages`) and the backend's own structs, and turns backend
errors into answers: a bad request is a non-retryable `GenerateFailed` (another sampler
would refuse it too); numerical trouble is retryable elsewhere; anything else means the
sampler itself is broken and raises `SamplerLost`, so the pool re-routes the request
and restarts the sampler.

`WeightSync` follows the trainer's delta stream for one backend: a bf16 `Follower` keeps
the canonical weights bit-exactly (actors/weights), and after each sync the backend
loads them as the new version (it casts or re-quantises to its own dtype).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import trio

from fleetrl.actors.samplers import base
from fleetrl.actors.weights.follower import AsyncBlobSource, BlobSource, Follower
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor

__all__ = ["AsyncStoreSource", "LocalSampler", "SamplerHandle", "SamplerLost", "WeightSync",
           "backend_params", "generation_message", "wire_dtype"]

_WIRE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}


class SamplerLost(Exception):
    """The sampler is gone or broken; the request it held must be routed elsewhere."""


class SamplerHandle(Protocol):
    """How the pool talks to one sampler, local or remote."""

    sampler_id: str

    async def generate(self, request: m.GenerateRequest, started: Callable[[], None]
                       ) -> m.Generation | m.GenerateFailed:
        """Answer `request`; call `started()` when it begins running. Raises SamplerLost."""
        ...

    async def health(self) -> bool:
        """A real check (a forward pass, or a recent heartbeat)."""
        ...

    async def aclose(self) -> None:
        ...


def wire_dtype(dtype: str) -> str:
    """The wire name of a backend dtype ("bf16" -> "bfloat16"); other names pass through."""
    return _WIRE_DTYPES.get(dtype, dtype)


def backend_params(p: m.SamplingParams) -> base.SamplingParams:
    return base.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                               top_k=p.top_k, stop_ids=tuple(p.stop_ids), seed=p.seed)


def generation_message(request_id: str, gen: base.Generation, identity: m.SamplerIdentity) -> m.Generation:
    """The wire `Generation` of a backend generation (arrays as Tensors)."""
    support = m.SupportCSR(
        ids=Tensor.from_numpy(np.asarray(gen.support_ids, dtype=np.int64)),
        logprobs=Tensor.from_numpy(np.asarray(gen.support_logprobs, dtype=np.float32)),
        offsets=Tensor.from_numpy(np.asarray(gen.support_offsets, dtype=np.int64)),
    )
    return m.Generation(
        request_id=request_id,
        token_ids=Tensor.from_numpy(np.asarray(gen.token_ids, dtype=np.int64)),
        logprobs=Tensor.from_numpy(np.asarray(gen.logprobs, dtype=np.float32)),
        support=support,
        versions=Tensor.from_numpy(np.asarray(gen.versions, dtype=np.int64)),
        sampler=identity,
        finish_reason=gen.finish_reason,
    )


def identity_of(sampler_id: str, backend: base.SamplerBackend) -> m.SamplerIdentity:
    ident = backend.identity
    return m.SamplerIdentity(sampler_id=sampler_id, backend=ident.backend, device_kind=ident.device,
                             dtype=wire_dtype(ident.dtype))


def run_generate(backend: base.SamplerBackend, identity: m.SamplerIdentity,
                 request: m.GenerateRequest) -> m.Generation | m.GenerateFailed:
    """Blocking: one request through `backend` (used by local and remote samplers)."""
    where = f"sampler {identity.sampler_id}"
    if backend.weight_version.version < request.min_version:
        return m.GenerateFailed(request_id=request.request_id, retryable=True,
                                reason=f"{where} holds version {backend.weight_version.version} < "
                                       f"min_version {request.min_version}")
    try:
        params = backend_params(request.params)
        gens = backend.generate([request.prompt_ids.to_numpy().tolist()], params)
    except (base.BadGenerateRequest, ValueError) as exc:
        return m.GenerateFailed(request_id=request.request_id, reason=f"{where}: {exc}", retryable=False)
    except base.NumericalFailure as exc:
        return m.GenerateFailed(request_id=request.request_id, reason=f"{where}: {exc}", retryable=True)
    return generation_message(request.request_id, gens[0], identity)


class LocalSampler:
    """A backend in this process (see the module docstring)."""

    def __init__(self, sampler_id: str, backend: base.SamplerBackend, *, capacity: int = 1,
                 health_timeout_s: float = 30.0, close_timeout_s: float = 30.0) -> None:
        self.sampler_id = sampler_id
        self.backend = backend
        self.capacity = capacity
        self.identity = identity_of(sampler_id, backend)
        self.health_timeout_s = health_timeout_s
        self.close_timeout_s = close_timeout_s
        self._slots = trio.Semaphore(capacity)
        self._closed = False

    async def generate(self, request: m.GenerateRequest, started: Callable[[], None]
                       ) -> m.Generation | m.GenerateFailed:
        if self._closed:
            raise SamplerLost(f"sampler {self.sampler_id} is closed")
        async with self._slots:
            started()
            try:
                # abandon_on_cancel: a hung backend must not hold the pool hostage; its
                # thread is left behind and the sampler is replaced.
                return await trio.to_thread.run_sync(run_generate, self.backend, self.identity, request,
                                                     abandon_on_cancel=True)
            except trio.Cancelled:
                raise
            except Exception as exc:
                raise SamplerLost(f"sampler {self.sampler_id} failed: {type(exc).__name__}: {exc}") from exc

    async def health(self) -> bool:
        if self._closed:
            return False
        with trio.move_on_after(self.health_timeout_s):
            try:
                h = await trio.to_thread.run_sync(self.backend.health, abandon_on_cancel=True)
            except Exception:
                return False
            return bool(h.ok)
        return False

    @property
    def version(self) -> base.WeightVersion:
        return self.backend.weight_version

    async def aclose(self) -> None:
        """No more requests; a backend with a ``close()`` (vLLM: the engine and its
        memory) is closed in a thread, waiting at most `close_timeout_s` for it."""
        if self._closed:
            return
        self._closed = True
        close = getattr(self.backend, "close", None)
        if close is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(self.close_timeout_s):
                try:
                    await trio.to_thread.run_sync(close, abandon_on_cancel=True)
                except Exception:  # noqa: BLE001 - a broken backend is being discarded anyway
                    pass


class AsyncStoreSource:
    """An AsyncBlobSource over a synchronous one (a local store), reads in a thread."""

    def __init__(self, source: BlobSource) -> None:
        self.source = source

    async def manifest(self) -> Any:
        return await trio.to_thread.run_sync(self.source.manifest)

    async def get(self, key: str) -> bytes:
        return await trio.to_thread.run_sync(self.source.get, key)


class WeightSync:
    """Keeps one backend on the newest published version (see the module docstring)."""

    def __init__(self, backend: base.SamplerBackend, source: AsyncBlobSource) -> None:
        self.backend = backend
        self.source = source
        self.follower: Follower | None = None
        self.switch_s: list[float] = []
        """Seconds each version switch took inside the backend (load)."""

    async def sync(self) -> base.WeightVersion:
        """Fetch and apply up to the source's current version; returns the backend's version."""
        if self.follower is None:
            self.follower = Follower.from_manifest(await self.source.manifest())
        await self.follower.sync_async(self.source)
        f = self.follower
        if f.version is None or f.digest is None:
            return self.backend.weight_version
        target = base.WeightVersion(f.version, f.digest.hex())
        if target != self.backend.weight_version:
            tensors = {k: v.clone() for k, v in f.weights.items()}  # the shadow keeps changing
            t0 = time.perf_counter()
            await trio.to_thread.run_sync(self.backend.load_version, tensors, target)
            self.switch_s.append(time.perf_counter() - t0)
        return self.backend.weight_version

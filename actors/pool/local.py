"""A sampler worker in this process: a backend behind the pool's handle interface.

`LocalSampler` is a backend behind a `batcher.Batcher` (the remote sampler process,
`remote_client`, serves its requests through one too), under the backend's own
identity with the sampler id the pool knows it by (``samplers.base.served_identity``). See `batcher` for how requests become backend calls and errors become answers.

`WeightSync` follows the trainer's delta stream for one backend, incrementally. Its
follower matches what the backend stores (`follower_for`, from the backend's
`samplers.base.WeightFormat`): a bf16 `Follower` (bf16 samplers, vLLM, any backend that
converts for itself), a `CastFollower` (fp16 / fp32 torch samplers: casts updated where
touched) or an `Fp8Follower` (fp8 torch samplers: projections re-quantised where touched,
always the bytes of a fresh quantisation, handed over as `samplers.base.Fp8Values`).
After each sync the backend gets only the tensors the deltas touched
(``apply_update``); the first time, after an anchor reset, after a failed backend call,
or when the backend's version is not the one this sync gave it, it gets every tensor
(``load_version``). Backends copy what they are given, and one sync runs at a time, so
the follower's tensors never change under a backend call. Each switch is timed
(``switch_s``) and reported to ``on_switch`` as a `VersionSwitch`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any, Protocol

import msgspec
import torch
import trio

from fleetrl.actors.samplers.base import (
    Fp8Values,
    SamplerBackend,
    WeightFormat,
    WeightValue,
    WeightVersion,
    served_identity,
    weight_format,
)
from fleetrl.actors.weights.follower import AsyncBlobSource, BlobSource, CastFollower, Follower, Fp8Follower
from fleetrl.actors.weights.manifest import Manifest
from fleetrl.daemon import messages as m

from .batcher import Batcher, BatchStatistics
from .errors import SamplerLost

__all__ = ["AsyncStoreSource", "LocalSampler", "SamplerHandle", "SamplerLost", "VersionSwitch", "WeightSync",
           "backend_values", "follower_for"]


class SamplerHandle(Protocol):
    """How the pool talks to one sampler, local or remote."""

    sampler_id: str

    async def generate(self, request: m.GenerateRequest, started: Callable[[], None]
                       ) -> m.Generation | m.GenerateFailed:
        """Answer `request`; call `started()` when it begins running. Raises SamplerLost."""
        ...

    # A handle may also offer ``stream(request, started)``: an async iterator of lists of
    # new token ids (sent when ``request.stream``, as the sampler produces them), then
    # the answer; raises SamplerLost. Closing it early gives the request up. The pool
    # uses it when it is there (`LocalSampler`, `remote_server.RemoteSampler` have it).

    async def health(self) -> bool:
        """A real check (a forward pass, or a recent heartbeat)."""
        ...

    async def aclose(self) -> None:
        ...


class LocalSampler:
    """A backend in this process (see the module docstring)."""

    def __init__(self, sampler_id: str, backend: SamplerBackend, *, capacity: int = 1,
                 max_batch: int = 64, health_timeout_s: float = 30.0, close_timeout_s: float = 30.0) -> None:
        self.sampler_id = sampler_id
        self.backend = backend
        self.capacity = capacity
        self.max_batch = max_batch
        self.identity = served_identity(backend, sampler_id)
        self.health_timeout_s = health_timeout_s
        self.close_timeout_s = close_timeout_s
        self.batcher = Batcher(backend, self.identity, capacity=capacity, max_batch=max_batch)
        self._closed = False

    async def generate(self, request: m.GenerateRequest, started: Callable[[], None]
                       ) -> m.Generation | m.GenerateFailed:
        if self._closed:
            raise SamplerLost(f"sampler {self.sampler_id} is closed")
        return await self.batcher.submit(request, started)

    def stream(self, request: m.GenerateRequest, started: Callable[[], None]
               ) -> AsyncIterator[list[int] | m.Generation | m.GenerateFailed]:
        """`generate`, with the tokens of a ``stream=True`` request as they are decoded
        (`Batcher.stream`)."""
        if self._closed:
            raise SamplerLost(f"sampler {self.sampler_id} is closed")
        return self.batcher.stream(request, started)

    def statistics(self) -> BatchStatistics:
        return self.batcher.statistics()

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
    def version(self) -> WeightVersion:
        return self.backend.weight_version

    async def aclose(self) -> None:
        """No more requests (waiting ones raise SamplerLost); a backend with a ``close()``
        (vLLM: the engine and its memory) is closed in a thread, waiting at most
        `close_timeout_s` for it."""
        if self._closed:
            return
        self._closed = True
        self.batcher.close()
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


class VersionSwitch(msgspec.Struct, frozen=True, kw_only=True):
    """One version switch inside a backend (what `WeightSync` reports to ``on_switch``)."""

    seconds: float
    """Time the backend call took (the pause a version switch costs the backend)."""
    tensors: int
    """Tensors handed over."""
    full: bool
    """A full load (``load_version``), else an incremental ``apply_update``."""
    backend: str
    """The backend's name (``identity.backend``: "torch", "vllm")."""
    dtype: str
    """The backend's weight dtype (wire name)."""
    version: int
    """The version switched to."""


_CAST_DTYPES = {"fp16": torch.float16, "fp32": torch.float32}


def follower_for(manifest: Manifest, fmt: WeightFormat) -> Follower:
    """The follower that keeps weights the way a backend of format `fmt` stores them."""
    if fmt.dtype == "fp8":
        return Fp8Follower.from_manifest(manifest, scheme=fmt.fp8_scheme, only=fmt.fp8_names)
    if fmt.dtype in _CAST_DTYPES:
        return CastFollower.from_manifest(manifest, dtype=_CAST_DTYPES[fmt.dtype])
    return Follower.from_manifest(manifest)


def backend_values(follower: Follower, names: Collection[str]) -> dict[str, WeightValue]:
    """What a backend is handed for `names`: the follower's tensors themselves (no copy:
    backends copy), as `Fp8Values` where the follower quantises them."""
    if isinstance(follower, Fp8Follower):
        return {n: Fp8Values(follower.q[n], follower.scale[n], follower.scheme) if n in follower.q
                else follower.shadow[n] for n in names}
    weights = follower.weights
    return {n: weights[n] for n in names}


class WeightSync:
    """Keeps one backend on the newest published version (see the module docstring)."""

    def __init__(self, backend: SamplerBackend, source: AsyncBlobSource, *,
                 on_switch: Callable[[VersionSwitch], None] | None = None) -> None:
        self.backend = backend
        self.source = source
        self.on_switch = on_switch
        self.follower: Follower | None = None
        self.switch_s: list[float] = []
        """Seconds each version switch took inside the backend (load or update)."""
        self._given: WeightVersion | None = None  # the version this sync last gave the backend
        self._lock = trio.Lock()  # one sync at a time: the follower changes only inside one

    async def sync(self) -> WeightVersion:
        """Fetch and apply up to the source's current version; returns the backend's version."""
        async with self._lock:
            if self.follower is None:
                self.follower = follower_for(await self.source.manifest(), weight_format(self.backend))
            f = self.follower
            await f.sync_async(self.source)
            if f.version is None or f.digest is None:
                return self.backend.weight_version
            target = WeightVersion(f.version, f.digest.hex())
            current = self.backend.weight_version
            if target == current:  # already there (this sync's doing, or the same digest anyway)
                f.take_touched()  # the backend holds this version: nothing is owed
                self._given = target
                return current
            touched = f.take_touched()
            full = touched.full or self._given is None or self._given != current or target.version <= current.version
            names = [s.name for s in f.layout.specs] if full else touched.names
            tensors = backend_values(f, names)
            self._given = None  # until the backend has them: a failed call means a full load next time
            call = self.backend.load_version if full else self.backend.apply_update
            t0 = time.perf_counter()
            await trio.to_thread.run_sync(call, tensors, target)
            seconds = time.perf_counter() - t0
            self._given = target
            self.switch_s.append(seconds)
            if self.on_switch is not None:
                ident = self.backend.identity
                self.on_switch(VersionSwitch(seconds=seconds, tensors=len(tensors), full=full,
                                             backend=ident.backend, dtype=ident.dtype, version=target.version))
            return self.backend.weight_version

"""A sampler worker in this process: a backend behind the pool's handle interface.

`LocalSampler` is a backend behind a `batcher.Batcher` (the remote sampler process,
`remote_client`, serves its requests through one too), under the backend's own
identity with the sampler id the pool knows it by (``samplers.base.served_identity``). See `batcher` for how requests become backend calls and errors become answers.

`WeightSync` follows the trainer's delta stream for one backend: a bf16 `Follower` keeps
the canonical weights bit-exactly (actors/weights), and after each sync the backend
loads them as the new version (it casts or re-quantises to its own dtype).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import trio

from fleetrl.actors.samplers.base import SamplerBackend, WeightVersion, served_identity
from fleetrl.actors.weights.follower import AsyncBlobSource, BlobSource, Follower
from fleetrl.daemon import messages as m

from .batcher import Batcher, BatchStatistics
from .errors import SamplerLost

__all__ = ["AsyncStoreSource", "LocalSampler", "SamplerHandle", "SamplerLost", "WeightSync"]


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


class WeightSync:
    """Keeps one backend on the newest published version (see the module docstring)."""

    def __init__(self, backend: SamplerBackend, source: AsyncBlobSource) -> None:
        self.backend = backend
        self.source = source
        self.follower: Follower | None = None
        self.switch_s: list[float] = []
        """Seconds each version switch took inside the backend (load)."""

    async def sync(self) -> WeightVersion:
        """Fetch and apply up to the source's current version; returns the backend's version."""
        if self.follower is None:
            self.follower = Follower.from_manifest(await self.source.manifest())
        await self.follower.sync_async(self.source)
        f = self.follower
        if f.version is None or f.digest is None:
            return self.backend.weight_version
        target = WeightVersion(f.version, f.digest.hex())
        if target != self.backend.weight_version:
            tensors = {k: v.clone() for k, v in f.weights.items()}  # the shadow keeps changing
            t0 = time.perf_counter()
            await trio.to_thread.run_sync(self.backend.load_version, tensors, target)
            self.switch_s.append(time.perf_counter() - t0)
        return self.backend.weight_version

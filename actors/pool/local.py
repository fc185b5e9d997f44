"""A sampler worker in this process: a backend behind the pool's handle interface.

Backends are synchronous (CPU/GPU bound) and decode a batch of prompts faster than the
same prompts one by one. `Batcher` turns the concurrent requests waiting for one
backend into batches (one backend call for many requests with the same sampling
parameters, each answered with its own `Generation`), runs them in worker threads, and
turns backend errors into answers: a bad request is a non-retryable `GenerateFailed`
for that request alone (another sampler would refuse it too); numerical trouble is
retryable elsewhere; anything else means the sampler itself is broken and raises
`SamplerLost`, so the pool re-routes the request and restarts the sampler.
`LocalSampler` is a backend behind a `Batcher` (the remote sampler process,
`remote_client`, serves its requests through one too).

``capacity`` is the number of requests a sampler serves at once (what the pool routes
against); ``max_batch`` the most requests in one backend call. See `Batcher` for the
rules, and `fleetrl.actors.samplers.batching` for which requests may share a call
(seeded requests run alone).

`WeightSync` follows the trainer's delta stream for one backend: a bf16 `Follower` keeps
the canonical weights bit-exactly (actors/weights), and after each sync the backend
loads them as the new version (it casts or re-quantises to its own dtype).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import numpy as np
import trio

from fleetrl.actors.samplers import base
from fleetrl.actors.samplers.batching import batch_key, take_batch
from fleetrl.actors.weights.follower import AsyncBlobSource, BlobSource, Follower
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor

__all__ = ["AsyncStoreSource", "BatchStatistics", "Batcher", "LocalSampler", "SamplerHandle", "SamplerLost",
           "WeightSync", "backend_params", "decode_batch", "generation_message", "wire_dtype"]

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


def _too_old(backend: base.SamplerBackend, identity: m.SamplerIdentity,
             request: m.GenerateRequest) -> m.GenerateFailed | None:
    held = backend.weight_version.version
    if held < request.min_version:
        return m.GenerateFailed(request_id=request.request_id, retryable=True,
                                reason=f"sampler {identity.sampler_id} holds version {held} < "
                                       f"min_version {request.min_version}")
    return None


def _request_error(request_id: str, identity: m.SamplerIdentity, exc: Exception) -> m.GenerateFailed:
    """The answer to an error that a request's own input caused (or numerical trouble)."""
    retryable = isinstance(exc, base.NumericalFailure)
    return m.GenerateFailed(request_id=request_id, reason=f"sampler {identity.sampler_id}: {exc}",
                            retryable=retryable)


_REQUEST_ERRORS = (base.BadGenerateRequest, ValueError, base.NumericalFailure)


def run_generate(backend: base.SamplerBackend, identity: m.SamplerIdentity,
                 request: m.GenerateRequest) -> m.Generation | m.GenerateFailed:
    """Blocking: one request alone through `backend` (a batch of one)."""
    old = _too_old(backend, identity, request)
    if old is not None:
        return old
    try:
        params = backend_params(request.params)
        gens = backend.generate([request.prompt_ids.to_numpy().tolist()], params)
    except _REQUEST_ERRORS as exc:
        return _request_error(request.request_id, identity, exc)
    return generation_message(request.request_id, gens[0], identity)


def decode_batch(backend: base.SamplerBackend, prompts: list[list[int]], params: base.SamplingParams,
                 emit: Callable[[int, base.Generation], None]) -> None:
    """Blocking: one backend call for `prompts`; ``emit(i, generation)`` for each prompt.

    A backend that decodes step by step (``start(prompts, params)`` returning a run with
    ``step()``, ``done`` and ``take_finished()``, as `TorchBackend`) has each prompt
    emitted as soon as it finishes; any other backend's are emitted when its
    ``generate`` returns.
    """
    start = getattr(backend, "start", None)
    if start is None:
        for i, gen in enumerate(backend.generate(prompts, params)):
            emit(i, gen)
        return
    run = start(prompts, params)
    while not run.done:
        run.step()
        for i, gen in run.take_finished():
            emit(i, gen)


class BatchStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What a `Batcher` has done so far."""

    requests: int
    """Requests that reached the backend (in a batch)."""
    calls: int
    """Backend calls (batches) started."""
    largest: int
    """Most requests in one call."""
    queued: int
    """Requests waiting for a batch now."""
    running: int
    """Requests in running batches now."""


class _Job:
    __slots__ = ("answer", "done", "lost", "params", "prompt", "request", "started")

    def __init__(self, request: m.GenerateRequest, params: base.SamplingParams, prompt: list[int],
                 started: Callable[[], None]) -> None:
        self.request = request
        self.params = params
        self.prompt = prompt
        self.started = started
        self.done = trio.Event()
        self.answer: m.Generation | m.GenerateFailed | None = None
        self.lost: str | None = None


class Batcher:
    """Serves generate requests on one backend, concurrent requests as batches.

    Requests wait in a FIFO queue. Whenever fewer than ``ceil(capacity / max_batch)``
    backend calls run and fewer than ``capacity`` requests are in them, the next batch
    leaves the queue (`fleetrl.actors.samplers.batching.take_batch`: the oldest request
    and the compatible ones behind it, at most ``max_batch`` and the free capacity) and
    runs as one backend call in a worker thread. Nothing waits on purpose: batches form
    at the end of the Trio scheduling round in which requests arrive (requests that
    arrive together, e.g. a group of attempts started at once, share a call), and
    requests that arrive while the sampler's calls run form the next batch. With
    ``max_batch = 1`` every request is its own call, at most ``capacity`` at once (the
    behaviour before batching).

    Per request:

    * it is checked alone before it joins a batch (its parameters; the backend's
      ``check_generate`` when it has one; ``min_version`` against the weights when its
      batch forms), so a bad request is answered alone (`GenerateFailed`, not
      retryable) and never reaches the others' call. If a batch of several still fails
      with a request error (a bad request the check did not catch, or non-finite logits),
      its unanswered requests are re-run one by one, so the error lands only on the
      request that causes it;
    * ``started()`` is called when its batch starts, and its answer is handed back as soon
      as its own prompt finishes (backends that decode step by step, like the torch one,
      finish short generations before long ones of the same batch);
    * cancelling it (a caller's timeout, the pool taking the sampler out) takes it out of
      the queue, or, once its batch runs, drops its answer: the batch goes on for the
      other requests;
    * any other backend error means the backend is broken: every unanswered request of
      that batch raises `SamplerLost`.

    Batches run in threads started with `trio.lowlevel.start_thread_soon`, owned by no
    task, so no single request's cancellation can cancel them; a hung backend call is
    left behind (its requests are answered `SamplerLost` by whoever takes the sampler
    out, e.g. the pool's ``request_timeout_s``).
    """

    def __init__(self, backend: base.SamplerBackend, identity: m.SamplerIdentity, *, capacity: int = 1,
                 max_batch: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"sampler {identity.sampler_id}: capacity must be >= 1, got {capacity}")
        if max_batch < 1:
            raise ValueError(f"sampler {identity.sampler_id}: max_batch must be >= 1, got {max_batch}")
        self.backend = backend
        self.identity = identity
        self.capacity = capacity
        self.max_batch = max_batch
        self.max_calls = -(-capacity // max_batch)
        self._queue: list[_Job] = []
        self._calls_running = 0
        self._in_service = 0
        self._closed: str | None = None
        self._requests = 0
        self._calls = 0
        self._largest = 0
        self._token: trio.lowlevel.TrioToken | None = None
        self._dispatch_due = False

    def statistics(self) -> BatchStatistics:
        return BatchStatistics(requests=self._requests, calls=self._calls, largest=self._largest,
                               queued=len(self._queue), running=self._in_service)

    async def submit(self, request: m.GenerateRequest, started: Callable[[], None]
                     ) -> m.Generation | m.GenerateFailed:
        """Answer `request` (see the class docstring). Raises SamplerLost."""
        if self._closed is not None:
            raise SamplerLost(f"sampler {self.identity.sampler_id} is {self._closed}")
        self._token = trio.lowlevel.current_trio_token()
        try:
            params = backend_params(request.params)
            prompt = request.prompt_ids.to_numpy().tolist()
            check = getattr(self.backend, "check_generate", None)
            if check is not None:
                check([prompt], params)
        except (base.BadGenerateRequest, ValueError) as exc:
            return _request_error(request.request_id, self.identity, exc)
        job = _Job(request, params, prompt, started)
        self._queue.append(job)
        if not self._dispatch_due:  # once the tasks runnable now have queued their requests too
            self._dispatch_due = True
            self._token.run_sync_soon(self._due)
        try:
            await job.done.wait()
        except BaseException:
            if job in self._queue:
                self._queue.remove(job)
            raise
        if job.lost is not None:
            raise SamplerLost(job.lost)
        assert job.answer is not None
        return job.answer

    def close(self, reason: str = "closed") -> None:
        """Take no more requests; the waiting ones raise SamplerLost (running batches finish)."""
        if self._closed is not None:
            return
        self._closed = reason
        queued, self._queue = self._queue, []
        for job in queued:
            self._finish(job, None, f"sampler {self.identity.sampler_id} is {reason}")

    # -- in the Trio thread --------------------------------------------------------------
    def _due(self) -> None:
        self._dispatch_due = False
        self._dispatch()

    def _dispatch(self) -> None:
        while self._queue and self._calls_running < self.max_calls and self._in_service < self.capacity:
            limit = min(self.max_batch, self.capacity - self._in_service)
            jobs = take_batch(self._queue, lambda j: batch_key(j.params), limit)
            ready = []
            try:  # runs as a Trio callback: an exception here would end the whole Trio run
                for job in jobs:
                    old = _too_old(self.backend, self.identity, job.request)
                    if old is not None:
                        self._finish(job, old, None)
                    else:
                        ready.append(job)
                for job in ready:
                    job.started()
            except Exception as exc:  # noqa: BLE001 - a broken backend or caller: lose this batch
                for job in jobs:
                    self._finish(job, None, f"sampler {self.identity.sampler_id} failed: "
                                            f"{type(exc).__name__}: {exc}")
                continue
            if not ready:
                continue
            self._calls_running += 1
            self._in_service += len(ready)
            self._requests += len(ready)
            self._calls += 1
            self._largest = max(self._largest, len(ready))
            trio.lowlevel.start_thread_soon(
                functools.partial(self._run, ready),
                functools.partial(self._post, self._ended, ready))

    def _finish(self, job: _Job, answer: m.Generation | m.GenerateFailed | None, lost: str | None) -> None:
        if job.done.is_set():
            return
        job.answer, job.lost = answer, lost
        job.done.set()

    def _answered(self, job: _Job, answer: m.Generation | m.GenerateFailed | None, lost: str | None) -> None:
        if not job.done.is_set():
            self._in_service -= 1
        self._finish(job, answer, lost)

    def _ended(self, jobs: list[_Job], outcome: Any) -> None:
        """A batch's thread is over: whatever it left unanswered is lost."""
        self._calls_running -= 1
        error = getattr(outcome, "error", None)
        why = f"{type(error).__name__}: {error}" if error is not None else "the batch ended without an answer"
        for job in jobs:
            if not job.done.is_set():
                self._answered(job, None, f"sampler {self.identity.sampler_id} failed: {why}")
        self._dispatch()

    # -- in the batch's worker thread -----------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        token = self._token
        assert token is not None
        try:
            token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            pass  # the Trio run is over; nobody waits for the answer any more

    def _run(self, jobs: list[_Job]) -> None:
        identity = self.identity
        answered: set[int] = set()

        def emit(i: int, gen: base.Generation) -> None:
            answered.add(i)
            self._post(self._answered, jobs[i], generation_message(jobs[i].request.request_id, gen, identity), None)

        try:
            decode_batch(self.backend, [j.prompt for j in jobs], jobs[0].params, emit)
        except _REQUEST_ERRORS as exc:
            rest = [j for i, j in enumerate(jobs) if i not in answered]
            if len(jobs) == 1:
                for job in rest:
                    self._post(self._answered, job, _request_error(job.request.request_id, identity, exc), None)
                return
            for job in rest:  # find the culprit: each one alone
                try:
                    answer = run_generate(self.backend, identity, job.request)
                except Exception as alone:
                    self._post(self._answered, job, None,
                               f"sampler {identity.sampler_id} failed: {type(alone).__name__}: {alone}")
                else:
                    self._post(self._answered, job, answer, None)
        except Exception as exc:
            why = f"sampler {identity.sampler_id} failed: {type(exc).__name__}: {exc}"
            for i, job in enumerate(jobs):
                if i not in answered:
                    self._post(self._answered, job, None, why)


class LocalSampler:
    """A backend in this process (see the module docstring)."""

    def __init__(self, sampler_id: str, backend: base.SamplerBackend, *, capacity: int = 1,
                 max_batch: int = 64, health_timeout_s: float = 30.0, close_timeout_s: float = 30.0) -> None:
        self.sampler_id = sampler_id
        self.backend = backend
        self.capacity = capacity
        self.max_batch = max_batch
        self.identity = identity_of(sampler_id, backend)
        self.health_timeout_s = health_timeout_s
        self.close_timeout_s = close_timeout_s
        self.batcher = Batcher(backend, self.identity, capacity=capacity, max_batch=max_batch)
        self._closed = False

    async def generate(self, request: m.GenerateRequest, started: Callable[[], None]
                       ) -> m.Generation | m.GenerateFailed:
        if self._closed:
            raise SamplerLost(f"sampler {self.sampler_id} is closed")
        return await self.batcher.submit(request, started)

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
    def version(self) -> base.WeightVersion:
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

"""Model clients for environment workers (implementations of `harness.model.ModelClient`).

* `LocalModelClient`: a `TorchBackend` owned by the worker, called in a worker thread
  (backends are blocking), at most ``concurrency`` calls at once. For tests and the
  simplest single-process configs: no pool actor, no weight following (the weights
  stay at the version they were loaded with).
* `PoolModelClient`: calls the sampler pool actor through its handle
  (``await ctx.handle(name)``, a `SamplerPool`): each call becomes a
  `GenerateRequest` routed over the pool's local and remote samplers, which follow the
  trainer's weights. A `GenerateFailed` answer raises `ModelUnavailable` (the harness
  ends its episode in ``error`` and the worker reports a ``sampler_error``).

Both return the wire `Generation` of ``fleetrl.daemon.messages`` (the local one: the
backend's own, stamped with the request id and this client's sampler identity), and
both stream: ``stream(prompt_ids, params)`` yields `TokenChunk`s as the sampler decodes
(every decode step with the torch backend), then that same `Generation`. Close a stream
early with ``contextlib.aclosing`` to give the request up.
`for_attempt` gives a view that tags requests with the attempt id (the pool logs and
paces by it).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import aclosing, contextmanager
from typing import Any

import numpy as np
import trio

from fleetrl.actors.pool.batcher import decode_batch
from fleetrl.actors.pool.handle import PoolHandle
from fleetrl.actors.samplers.base import served_identity, stamp
from fleetrl.actors.samplers.errors import BadGenerateRequest, NumericalFailure
from fleetrl.daemon import messages as m
from fleetrl.daemon.actor import ActorContext
from fleetrl.daemon.protocol import Tensor
from fleetrl.harness.chat import ChatTokenizer
from fleetrl.harness.model import HFChatTokenizer, ModelUnavailable

from .config import LocalModel, ModelConfig

__all__ = ["LocalModelClient", "PoolModelClient", "open_model"]


class LocalModelClient:
    """A backend in this process, called in a worker thread (see the module docstring)."""

    def __init__(self, backend: Any, tokenizer: ChatTokenizer, *, sampler_id: str = "local",
                 concurrency: int = 1) -> None:
        self.backend = backend
        self._tok = tokenizer
        self.identity = served_identity(backend, sampler_id)
        self._limit = trio.CapacityLimiter(concurrency)
        self._ids = itertools.count(1)
        self.calls = 0

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tok

    def for_attempt(self, attempt_id: str) -> LocalModelClient:
        return self

    async def generate(self, prompt_ids: Sequence[int], params: m.SamplingParams) -> m.Generation:
        request_id = f"{self.identity.sampler_id}-{next(self._ids)}"
        with self._backend_failures():
            (gen,) = await trio.to_thread.run_sync(self.backend.generate, [list(prompt_ids)], params,
                                                   limiter=self._limit, abandon_on_cancel=True)
        self.calls += 1
        return stamp(gen, request_id, self.identity)

    @contextmanager
    def _backend_failures(self) -> Iterator[None]:
        """The backend's refusals as `ModelUnavailable`: a bad request is final, a
        numerical failure may pass on a retry."""
        try:
            yield
        except BadGenerateRequest as exc:
            raise ModelUnavailable(f"{self.identity.sampler_id}: {exc}", retryable=False) from exc
        except NumericalFailure as exc:
            raise ModelUnavailable(f"{self.identity.sampler_id}: {exc}", retryable=True) from exc

    async def stream(self, prompt_ids: Sequence[int], params: m.SamplingParams
                     ) -> AsyncIterator[m.TokenChunk | m.Generation]:
        """`generate`, streamed: a `TokenChunk` per decode step that produced tokens (a
        backend without ``streams_tokens`` sends none), then the `Generation`.

        The backend runs in a thread of its own that holds one of the ``concurrency``
        slots until the generation ends. Closed early, the stream gives the request up:
        a backend that decodes step by step and can abort a row (the torch backend)
        stops at the next step boundary, any other one finishes and its tokens are
        dropped."""
        request_id = f"{self.identity.sampler_id}-{next(self._ids)}"
        prompt = [int(t) for t in prompt_ids]
        slot = object()
        await self._limit.acquire_on_behalf_of(slot)
        feed = _Feed()
        trio_token = trio.lowlevel.current_trio_token()

        def post(fn: Any, *args: Any) -> None:  # from the backend's thread
            try:
                trio_token.run_sync_soon(fn, *args)
            except trio.RunFinishedError:
                pass

        def sink(_i: int, ids: list[int]) -> None:
            if not feed.abandoned:
                post(feed.push, ids)

        def given_up() -> list[int]:
            if feed.abandoned and not feed.aborted:
                feed.aborted = True
                return [0]
            return []

        def run() -> m.Generation:
            out: list[m.Generation] = []
            decode_batch(self.backend, [prompt], params, lambda _i, gen: out.append(gen), sink, given_up)
            return out[0]

        def ended(result: Any) -> None:  # in the Trio thread
            self._limit.release_on_behalf_of(slot)
            feed.end(result)

        try:
            trio.lowlevel.start_thread_soon(run, lambda result: post(ended, result))
        except BaseException:
            self._limit.release_on_behalf_of(slot)
            raise
        try:
            while True:  # tokens that came in while the reader held a chunk go out before the answer
                if feed.tokens:
                    ids, feed.tokens = feed.tokens, []
                    yield m.TokenChunk(request_id=request_id, token_ids=ids)
                    continue
                if feed.result is not None:
                    break
                await feed.wake.wait()
                feed.wake = trio.Event()
        except BaseException:  # cancelled, or the reader closed the stream
            feed.abandoned = True
            raise
        with self._backend_failures():
            gen = feed.result.unwrap()
        self.calls += 1
        yield stamp(gen, request_id, self.identity)


class _Feed:
    """One streamed local generation: tokens not yet read, and the thread's outcome."""

    __slots__ = ("abandoned", "aborted", "result", "tokens", "wake")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.result: Any = None
        self.abandoned = False
        self.aborted = False  # read and written by the backend's thread only
        self.wake = trio.Event()

    def push(self, ids: list[int]) -> None:
        if self.result is None:
            self.tokens.extend(ids)
            self.wake.set()

    def end(self, result: Any) -> None:
        self.result = result
        self.wake.set()


class PoolModelClient:
    """Calls through the sampler pool's in-process client (see the module docstring)."""

    def __init__(self, pool: Any, tokenizer: ChatTokenizer, *, attempt_id: str = "",
                 min_version: int = 0) -> None:
        self.pool = pool
        self._tok = tokenizer
        self.attempt_id = attempt_id
        self.min_version = min_version
        self._ids = itertools.count(1)

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tok

    def for_attempt(self, attempt_id: str) -> PoolModelClient:
        return PoolModelClient(self.pool, self._tok, attempt_id=attempt_id, min_version=self.min_version)

    def _request(self, prompt_ids: Sequence[int], params: m.SamplingParams, *, stream: bool) -> m.GenerateRequest:
        ids = np.asarray(list(prompt_ids), dtype=np.int64)
        try:
            return m.GenerateRequest(request_id=f"{self.attempt_id or 'envworker'}#{next(self._ids)}",
                                     attempt_id=self.attempt_id, prompt_ids=Tensor.from_numpy(ids),
                                     params=params, min_version=self.min_version, stream=stream)
        except ValueError as exc:
            raise ModelUnavailable(f"bad generate request: {exc}", retryable=False) from exc

    async def generate(self, prompt_ids: Sequence[int], params: m.SamplingParams) -> m.Generation:
        answer = await self.pool.generate(self._request(prompt_ids, params, stream=False))
        if isinstance(answer, m.GenerateFailed):
            raise ModelUnavailable(f"sampler pool: {answer.reason}", retryable=answer.retryable)
        return answer

    async def stream(self, prompt_ids: Sequence[int], params: m.SamplingParams
                     ) -> AsyncIterator[m.TokenChunk | m.Generation]:
        """`generate`, streamed through `SamplerPool.stream`: `TokenChunk`s as the
        sampler decodes, then the `Generation` (a pool without ``stream``: only that).
        A request whose sampler is lost after it began to stream raises a retryable
        `ModelUnavailable` (the pool does not re-route it)."""
        request = self._request(prompt_ids, params, stream=True)
        if getattr(self.pool, "stream", None) is None:
            yield await self.generate(prompt_ids, params)
            return
        async with aclosing(self.pool.stream(request)) as items:
            async for item in items:
                if isinstance(item, m.GenerateFailed):
                    raise ModelUnavailable(f"sampler pool: {item.reason}", retryable=item.retryable)
                yield item


async def open_model(cfg: ModelConfig, ctx: ActorContext) -> LocalModelClient | PoolModelClient:
    """The model client of ``cfg``: a torch backend of this actor's own, or the client of
    the pool actor ``cfg.pool`` (its handle; holding it keeps the pool serving until this
    actor has returned)."""
    if isinstance(cfg, LocalModel):
        from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig

        bcfg = TorchBackendConfig(model_dir=cfg.model_dir, dtype=cfg.dtype, device=cfg.device)
        backend = await trio.to_thread.run_sync(TorchBackend, bcfg)
        tok = await trio.to_thread.run_sync(HFChatTokenizer.from_pretrained, cfg.tokenizer_dir or cfg.model_dir)
        return LocalModelClient(backend, tok, sampler_id=f"{ctx.name}-local", concurrency=cfg.concurrency)
    tok = await trio.to_thread.run_sync(HFChatTokenizer.from_pretrained, cfg.tokenizer_dir)
    try:
        pool = await ctx.handle(cfg.pool, PoolHandle)
    except KeyError:
        raise ValueError(f"model.pool = {cfg.pool!r} is not an actor of this daemon") from None
    return PoolModelClient(pool, tok, min_version=cfg.min_version)

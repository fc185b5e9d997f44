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
backend's own, stamped with the request id and this client's sampler identity).
`for_attempt` gives a view that tags requests with the attempt id (the pool logs and
paces by it).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

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
        try:
            (gen,) = await trio.to_thread.run_sync(self.backend.generate, [list(prompt_ids)], params,
                                                   limiter=self._limit, abandon_on_cancel=True)
        except BadGenerateRequest as exc:
            raise ModelUnavailable(f"{self.identity.sampler_id}: {exc}", retryable=False) from exc
        except NumericalFailure as exc:
            raise ModelUnavailable(f"{self.identity.sampler_id}: {exc}", retryable=True) from exc
        self.calls += 1
        return stamp(gen, request_id, self.identity)


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

    async def generate(self, prompt_ids: Sequence[int], params: m.SamplingParams) -> m.Generation:
        ids = np.asarray(list(prompt_ids), dtype=np.int64)
        try:
            request = m.GenerateRequest(request_id=f"{self.attempt_id or 'envworker'}#{next(self._ids)}",
                                        attempt_id=self.attempt_id, prompt_ids=Tensor.from_numpy(ids),
                                        params=params, min_version=self.min_version)
        except ValueError as exc:
            raise ModelUnavailable(f"bad generate request: {exc}", retryable=False) from exc
        answer = await self.pool.generate(request)
        if isinstance(answer, m.GenerateFailed):
            raise ModelUnavailable(f"sampler pool: {answer.reason}", retryable=answer.retryable)
        return answer


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
        pool = await ctx.handle(cfg.pool)
    except KeyError:
        raise ValueError(f"model.pool = {cfg.pool!r} is not an actor of this daemon") from None
    return PoolModelClient(pool, tok, min_version=cfg.min_version)

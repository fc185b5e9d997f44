"""Helpers of the external-harness tests: serving an app on 127.0.0.1, and an
in-memory model with scripted answers."""

from __future__ import annotations

from contextlib import asynccontextmanager

import numpy as np
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from fleetrl.daemon.messages import Generation, SamplingParams, SamplerIdentity, SupportCSR
from fleetrl.daemon.protocol import Tensor


@asynccontextmanager
async def serving(app):
    """Serve ``app`` with hypercorn's Trio worker on a free port of 127.0.0.1; yields the base URL."""
    cfg = Config()
    cfg.bind = ["127.0.0.1:0"]
    cfg.accesslog = None
    cfg.errorlog = None
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: serve(app, cfg, shutdown_trigger=stop.wait, task_status=task_status))
        try:
            yield binds[0]
        finally:
            stop.set()


class ScriptedModel:
    """An in-memory ModelClient that answers with scripted texts (then ``<eos>``), with
    made-up log-probs over a one-token support; records what it was asked."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        self._tok = tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    @property
    def tokenizer(self):
        return self._tok

    async def generate(self, prompt_ids, params: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        text = self.replies.pop(0) if self.replies else ""
        ids = (self._tok.encode(text) + [self._tok.eos_id])[: params.max_tokens]
        n = len(ids)
        lps = np.full(n, -0.5, dtype=np.float32)
        return Generation(
            request_id=f"scripted-{len(self.prompts)}",
            token_ids=Tensor.from_numpy(np.asarray(ids, dtype=np.int64)),
            logprobs=Tensor.from_numpy(lps),
            support=SupportCSR(ids=Tensor.from_numpy(np.asarray(ids, dtype=np.int64)),
                               logprobs=Tensor.from_numpy(np.zeros(n, dtype=np.float32)),
                               offsets=Tensor.from_numpy(np.arange(n + 1, dtype=np.int64))),
            versions=Tensor.from_numpy(np.zeros(n, dtype=np.int64)),
            sampler=SamplerIdentity(sampler_id="scripted", backend="fake", device_kind="cpu", dtype="fp32"),
            finish_reason="stop" if n and ids[-1] == self._tok.eos_id else "length",
        )


class TorchClient:
    """A ModelClient over the torch sampler backend: its blocking ``generate`` in a
    worker thread, its result as the wire `Generation`; keeps every request so a test
    can check the recorded tokens against the sampler."""

    def __init__(self, backend, tokenizer) -> None:
        self.backend = backend
        self._tok = tokenizer
        self.requests: list[tuple[list[int], object]] = []

    @property
    def tokenizer(self):
        return self._tok

    async def generate(self, prompt_ids, params: SamplingParams) -> Generation:
        from fleetrl.actors.samplers.base import SamplingParams as BackendParams

        bp = BackendParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                           top_k=params.top_k, stop_ids=tuple(params.stop_ids), seed=params.seed)
        self.requests.append((list(prompt_ids), bp))
        (g,) = await trio.to_thread.run_sync(self.backend.generate, [list(prompt_ids)], bp)
        ident = self.backend.identity

        def t(values, dtype):
            return Tensor.from_numpy(np.asarray(values, dtype=dtype))

        return Generation(
            request_id=f"torch-{len(self.requests)}",
            token_ids=t(g.token_ids, np.int64), logprobs=t(g.logprobs, np.float32),
            support=SupportCSR(ids=t(g.support_ids, np.int64), logprobs=t(g.support_logprobs, np.float32),
                               offsets=t(g.support_offsets, np.int64)),
            versions=t(g.versions, np.int64),
            sampler=SamplerIdentity(sampler_id="torch-test", backend=ident.backend, device_kind=ident.device,
                                    dtype=ident.dtype),
            finish_reason=g.finish_reason,
        )

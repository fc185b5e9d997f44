"""A small saved model (grouped-query attention, peaked enough that top-p supports are
small and varied) shared by the sampler tests, and the transformers copy of it that
plays the trainer."""

from __future__ import annotations

import pytest

from tiny import PROMPTS, sampler_spec

from fleetrl.actors.model import build_tiny_llama, load_tiny_llama, save_tiny_llama

SPEC = sampler_spec(num_heads=4, num_kv_heads=2)

__all__ = ["PROMPTS", "SPEC"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return save_tiny_llama(build_tiny_llama(SPEC, seed=11), tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory):
    """Same architecture, other weights: the 'next version' in update tests."""
    return save_tiny_llama(build_tiny_llama(SPEC, seed=12), tmp_path_factory.mktemp("model2") / "tiny")


@pytest.fixture(scope="session")
def trainer(model_dir):
    """The trainer's view: transformers LlamaForCausalLM in fp32."""
    return load_tiny_llama(model_dir)


@pytest.fixture(scope="session")
def fp32_backend(model_dir):
    """An fp32 torch backend of `model_dir` that no test updates (shared, read-only)."""
    from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig

    return TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))


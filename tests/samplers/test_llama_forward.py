"""Our Llama forward with a KV cache against a full transformers forward.

Left-padded batches, grouped-query attention, cache growth and row removal: every
step's logits must equal the full-sequence forward of each row on its own.
"""

from __future__ import annotations

import pytest
import torch

from fleetrl.actors.model import build_tiny_llama
from fleetrl.actors.samplers.llama_forward import (
    KVCache,
    LlamaShape,
    RopeTable,
    UnsupportedModel,
    attention_mask,
    decoder_forward,
    dense_reader,
    lm_logits,
)

from .conftest import PROMPTS, SPEC

CPU = torch.device("cpu")


def _decode_greedy(model, dtype, prompts, steps, *, drop_row_after=None, initial_capacity=2):
    """Prefill + greedy steps with our forward; returns the sequences and per-step logits."""
    shape = LlamaShape.from_config(model.config)
    weights = {k: v.to(dtype) for k, v in model.state_dict().items()}
    w = dense_reader(weights)
    rope = RopeTable(shape, CPU)
    width = max(map(len, prompts))
    pads = torch.tensor([width - len(p) for p in prompts])
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    cache = KVCache(shape, len(prompts), initial_capacity, dtype, CPU)
    positions = (torch.arange(width)[None] - pads[:, None]).clamp(min=0)
    rows = list(range(len(prompts)))
    seqs = [list(p) for p in prompts]
    logged: list[tuple[int, list[int], torch.Tensor]] = []
    with torch.no_grad():
        hidden = decoder_forward(w, shape, rope, ids, positions, attention_mask(pads, 0, width), cache, dtype)
        logits = lm_logits(w, shape, hidden[:, -1])
        for step in range(steps):
            for j, r in enumerate(rows):
                logged.append((r, list(seqs[r]), logits[j]))
            nxt = logits.argmax(-1)
            for j, r in enumerate(rows):
                seqs[r].append(int(nxt[j]))
            if drop_row_after is not None and step == drop_row_after:
                keep = torch.tensor([j for j in range(len(rows)) if j != 0])
                rows = [rows[j] for j in keep.tolist()]
                cache.keep_rows(keep)
                pads, nxt = pads[keep], nxt[keep]
            c = cache.length
            hidden = decoder_forward(w, shape, rope, nxt[:, None], (c - pads)[:, None],
                                     attention_mask(pads, c, 1), cache, dtype)
            logits = lm_logits(w, shape, hidden[:, -1])
    return logged


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_cached_steps_match_full_forward(trainer, dtype, tol):
    model = trainer.to(dtype) if dtype != torch.float32 else trainer
    try:
        logged = _decode_greedy(model, dtype, PROMPTS, steps=12, drop_row_after=4)
        assert len(logged) == 3 * 5 + 2 * 7
        worst = 0.0
        with torch.no_grad():
            for _, seq, logits in logged:
                ref = model(torch.tensor([seq])).logits[0, -1].to(torch.float32)
                worst = max(worst, float((ref - logits).abs().max()))
        assert worst < tol
    finally:
        trainer.to(torch.float32)


def test_padding_does_not_leak_into_rows():
    """A row's logits do not depend on what sits in its padded columns."""
    model = build_tiny_llama(SPEC, seed=5)
    shape = LlamaShape.from_config(model.config)
    w = dense_reader(dict(model.state_dict()))
    rope = RopeTable(shape, CPU)
    pads = torch.tensor([3, 0])
    outs = []
    for filler in (0, 200):
        ids = torch.tensor([[filler] * 3 + [1, 2], [5, 6, 7, 8, 9]])
        cache = KVCache(shape, 2, 8, torch.float32, CPU)
        positions = (torch.arange(5)[None] - pads[:, None]).clamp(min=0)
        with torch.no_grad():
            h = decoder_forward(w, shape, rope, ids, positions, attention_mask(pads, 0, 5), cache, torch.float32)
        outs.append(lm_logits(w, shape, h[:, -1]))
    assert torch.equal(outs[0], outs[1])


def test_cache_grows_and_keeps_contents():
    cache = KVCache(LlamaShape.from_config(build_tiny_llama(SPEC, seed=0).config), 2, 3, torch.float32, CPU)
    cache.keys[0][:, :, :3] = 1.0
    cache.length = 3
    cache.ensure_capacity(4)
    assert cache.capacity == 6
    assert bool((cache.keys[0][:, :, :3] == 1.0).all())  # new columns are uninitialised until written
    assert cache.keys[0].shape[2] == 6 and cache.values[0].shape[2] == 6


def test_attention_mask_shape_and_rules():
    m = attention_mask(torch.tensor([2, 0]), 0, 4)[:, 0]
    assert m.shape == (2, 4, 4)
    assert m[0].tolist() == [
        [True, False, False, False],  # padding query: only itself
        [False, True, False, False],
        [False, False, True, False],  # first real token: itself
        [False, False, True, True],
    ]
    assert m[1].tolist() == torch.tril(torch.ones(4, 4, dtype=torch.bool)).tolist()


def test_unsupported_configs_are_refused():
    config = build_tiny_llama(SPEC, seed=0).config
    config.rope_parameters = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedModel, match="rope_type"):
        LlamaShape.from_config(config)

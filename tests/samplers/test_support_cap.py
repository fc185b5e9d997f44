"""The support cap of every sampler (`max_support`) and whole-vocabulary draws, on the
torch backend: the cap bounds the record and is what the token was drawn from; a
whole-vocabulary draw lists the cap's most likely tokens with log q and the tail; the
pool's `routed_params` decides which a call gets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.actors.samplers.base import bounded_params, routed_params
from fleetrl.daemon.messages import SAMPLER, SamplingParams
from fleetrl.daemon.tokens import check_sampled_tokens

from .conftest import PROMPTS


def _logits(trainer, prompt, gen):
    ids = torch.tensor([list(prompt) + gen.token_ids.to_numpy().tolist()])
    with torch.no_grad():
        return trainer(ids).logits[0, len(prompt) - 1: -1].double()


def test_a_request_without_top_k_is_drawn_from_the_cap(model_dir, trainer):
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), max_support=7))
    [gen] = backend.generate(PROMPTS[:1], SamplingParams(max_tokens=12, seed=3))
    sizes = np.diff(gen.support.offsets.to_numpy())
    assert (sizes == 7).all() and gen.support.rule == "listed"
    logits = _logits(trainer, PROMPTS[0], gen)
    for t in range(gen.num_tokens):
        ids, lps = gen.support.row(t)
        expect = torch.log_softmax(logits[t], -1)
        top = torch.sort(expect, descending=True, stable=True).indices[:7]
        assert ids.tolist() == top.tolist()  # the 7 most likely, renormalised: what it drew from
        ren = expect[top] - torch.logsumexp(expect[top], 0)
        assert float((torch.tensor(lps, dtype=torch.float64) - ren).abs().max()) < 1e-5
    # a smaller top_k of the request lowers it; a larger one does not raise it
    [small] = backend.generate(PROMPTS[:1], SamplingParams(max_tokens=4, top_k=3, seed=3))
    [large] = backend.generate(PROMPTS[:1], SamplingParams(max_tokens=4, top_k=50, seed=3))
    assert set(np.diff(small.support.offsets.to_numpy())) == {3}
    assert set(np.diff(large.support.offsets.to_numpy())) == {7}


def test_a_whole_vocabulary_draw_lists_the_most_likely_with_log_q_and_the_tail(model_dir, trainer):
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), max_support=5))
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=8, whole_vocabulary=True)
    gens = backend.generate(PROMPTS, params)
    unlisted = 0
    for prompt, gen in zip(PROMPTS, gens):
        s = gen.support
        assert s.rule == "vocabulary" and s.tail_mass is not None
        check_sampled_tokens(gen.token_ids, gen.logprobs, s, tol=1e-5, normalised=True)
        logits = _logits(trainer, prompt, gen)
        for t in range(gen.num_tokens):
            lq = torch.log_softmax(logits[t] / 0.9, -1)
            ids, lps = (x.copy() for x in s.row(t))
            assert ids.tolist() == torch.sort(lq, descending=True, stable=True).indices[:5].tolist()
            assert float((torch.tensor(lps, dtype=torch.float64) - lq[ids]).abs().max()) < 1e-5
            assert math.isclose(float(s.tail_mass.to_numpy()[t]), 1 - float(lq[ids].exp().sum()), abs_tol=1e-5)
            tok = int(gen.token_ids.to_numpy()[t])
            assert abs(float(gen.logprobs.to_numpy()[t]) - float(lq[tok])) < 1e-5
            unlisted += tok not in ids.tolist()
    assert unlisted > 0, "some tokens come from outside the listing (the whole vocabulary is drawn from)"
    assert SAMPLER.decode(SAMPLER.encode(gens[0])) == gens[0]


def test_routed_params_caps_every_call_unless_the_whole_vocabulary_is_allowed():
    free = SamplingParams(max_tokens=4)
    nucleus = SamplingParams(max_tokens=4, top_p=0.9)
    topk = SamplingParams(max_tokens=4, top_k=1000)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    asked = SamplingParams(max_tokens=4, whole_vocabulary=True)
    for p in (free, nucleus, greedy, asked):
        assert routed_params(p, 512, whole_vocabulary=False).top_k == 512
        assert not routed_params(p, 512, whole_vocabulary=False).whole_vocabulary
    assert routed_params(topk, 512, whole_vocabulary=True).top_k == 512
    assert routed_params(SamplingParams(max_tokens=4, top_k=9), 512, whole_vocabulary=False).top_k == 9
    assert routed_params(free, 512, whole_vocabulary=True) == asked
    assert routed_params(nucleus, 512, whole_vocabulary=True).top_k == 512
    assert routed_params(greedy, 512, whole_vocabulary=True).top_k == 512  # greedy: one member anyway
    assert bounded_params(asked, 8) is asked and bounded_params(free, 8).top_k == 8


@pytest.mark.parametrize("kw", [dict(top_p=0.9), dict(top_k=5), dict(temperature=0.0)])
def test_a_whole_vocabulary_request_must_ask_for_no_truncation(kw):
    with pytest.raises(ValueError, match="whole_vocabulary draws from every token"):
        SamplingParams(max_tokens=2, whole_vocabulary=True, **kw)


def test_the_cap_must_be_positive(model_dir):
    with pytest.raises(ValueError, match="max_support must be an int >= 1"):
        TorchBackendConfig(model_dir=str(model_dir), max_support=0)

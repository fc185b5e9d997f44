"""The vLLM backend at a real vocabulary (151,936 ids; `fleetrl model init --size
tiny-151k`): the engine is asked for at most `max_support` log-probs per token (never the
vocabulary), the record stays within 8 KB a token, and vLLM's log q^S agree with the
trainer's replay (transformers fp32) over every listed member; a whole-vocabulary draw
lists the cap's most likely tokens with log q and the tail."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fleetrl.actors.samplers import WeightVersion
from fleetrl.daemon.messages import SAMPLER, SamplingParams
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT, check_sampled_tokens
from fleetrl.grpo import replay_logprobs

V = 151_936
PROMPT = list(range(100, 140))
LOGPROB_TOL = 1e-4
"""As tests/vllm/test_vllm_fp32.py: vLLM fp32 vs transformers fp32 (measured ~1e-6 here)."""


@pytest.fixture(scope="module")
def backend(real_vocab_model_dir):
    from fleetrl.actors.samplers.vllm_backend import VllmBackend, VllmBackendConfig

    b = VllmBackend(VllmBackendConfig(model_dir=str(real_vocab_model_dir), dtype="fp32", max_num_seqs=8,
                                      cpu_kv_cache_bytes=32 << 20, max_model_len=512),
                    version=WeightVersion(0, "digest-0"))
    yield b
    b.close()


@pytest.fixture(scope="module")
def trainer(real_vocab_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_vocab_model_dir, dtype=torch.float32).eval()


def _logits(trainer, prompt, gen, temperature):
    ids = torch.tensor([prompt + gen.token_ids.to_numpy().tolist()])
    with torch.no_grad():
        return trainer(ids).logits[0, len(prompt) - 1: -1].double() / temperature


def test_the_engine_is_asked_for_the_cap_not_the_vocabulary(backend):
    assert backend.vocab_size == V
    assert backend._engine.model_config.max_logprobs == DEFAULT_MAX_SUPPORT
    assert backend._vllm_params(SamplingParams(max_tokens=2, top_k=DEFAULT_MAX_SUPPORT), 0, 2).logprobs \
        == DEFAULT_MAX_SUPPORT


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_capped_supports_agree_with_the_trainer_and_stay_within_8_kb(backend, trainer, top_p):
    gens = backend.generate([PROMPT, PROMPT[:9]], SamplingParams(max_tokens=12, temperature=0.9, top_p=top_p, seed=4))
    worst = 0.0
    for prompt, gen in zip((PROMPT, PROMPT[:9]), gens):
        sizes = np.diff(gen.support.offsets.to_numpy())
        assert sizes.max() <= DEFAULT_MAX_SUPPORT and gen.support.rule == "listed"
        assert len(SAMPLER.encode(gen)) / gen.num_tokens <= 8 * 1024
        sids, slps = gen.support.padded()
        lp, lp_k = replay_logprobs(_logits(trainer, prompt, gen, 0.9)[None], gen.token_ids.to_torch().long()[None],
                                   torch.from_numpy(sids)[None])
        valid = torch.from_numpy(sids >= 0)
        worst = max(worst, float((lp_k[0][valid] - torch.from_numpy(slps).double()[valid]).abs().max()))
    print(f"vLLM fp32 vs transformers fp32 at V={V}, top_p={top_p}: max |log q^S diff| {worst:.2e}, "
          f"{len(SAMPLER.encode(gens[0])) / gens[0].num_tokens:.0f} bytes a token")
    assert worst < LOGPROB_TOL


def test_a_whole_vocabulary_draw_lists_the_cap_with_log_q_and_the_tail(backend, trainer):
    [gen] = backend.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=6, whole_vocabulary=True))
    s = gen.support
    assert s.rule == "vocabulary" and (np.diff(s.offsets.to_numpy()) == DEFAULT_MAX_SUPPORT).all()
    check_sampled_tokens(gen.token_ids, gen.logprobs, s, tol=1e-4, normalised=True)
    logits = _logits(trainer, PROMPT, gen, 1.0)
    for t in range(gen.num_tokens):
        lq = torch.log_softmax(logits[t], -1)
        ids, lps = (x.copy() for x in s.row(t))
        top = set(torch.topk(lq, DEFAULT_MAX_SUPPORT + 8).indices.tolist())
        assert set(ids.tolist()) <= top  # the most likely (up to ties at the cut)
        assert float((torch.from_numpy(lps).double() - lq[ids]).abs().max()) < LOGPROB_TOL
        assert math.isclose(float(s.tail_mass.to_numpy()[t]), 1 - float(lq[ids].exp().sum()), abs_tol=1e-4)
        tok = int(gen.token_ids.to_numpy()[t])
        assert abs(float(gen.logprobs.to_numpy()[t]) - float(lq[tok])) < LOGPROB_TOL

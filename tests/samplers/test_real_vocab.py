"""A real vocabulary (151,936 ids, Qwen3's size; a tiny-hidden model of `fleetrl model
init --size tiny-151k`): with default settings a generated token costs at most 8 KB on
the wire and at rest (the record of a capped support, 512 members), where the old record,
which listed the whole vocabulary, cost about 1.2 MB; and the torch sampler's log-probs
agree with the trainer's replay (transformers fp32) over every listed member."""

from __future__ import annotations

import json

import msgspec
import numpy as np
import pytest
import torch

from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.actors.samplers.base import routed_params, served_identity, stamp
from fleetrl.actors.trainer.rollout_log import group_entry
from fleetrl.daemon.messages import ROLLOUTS, SAMPLER, RolloutGroup, SamplingParams, TokenSegment, Trajectory
from fleetrl.daemon.protocol import Tensor
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT
from fleetrl.grpo import replay_logprobs
from fleetrl.harness.atif_write import atif_from_attempt, encode_atif
from fleetrl.harness.recording import AttemptRecord, CallRecord

V = 151_936
BUDGET = 8 * 1024
PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def backend(real_vocab_model_dir):
    return TorchBackend(TorchBackendConfig(model_dir=str(real_vocab_model_dir)))


@pytest.fixture(scope="module")
def trainer(real_vocab_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_vocab_model_dir, dtype=torch.float32).eval()


def _group(gens, prompt) -> RolloutGroup:
    trajs = []
    for i, gen in enumerate(gens):
        seg = TokenSegment.from_generation(Tensor.from_numpy(np.asarray(prompt, dtype=np.int32)), gen)
        trajs.append(Trajectory(attempt_id=f"a{i}", task_id="t", group_id="g", segments=(seg,), reward=float(i % 2)))
    return RolloutGroup(group_id="g", task_id="t", trajectories=tuple(trajs))


@pytest.mark.parametrize("top_p", [1.0, 0.95])
def test_a_generated_token_costs_at_most_8_kb_on_the_wire_and_at_rest(backend, top_p):
    params = routed_params(SamplingParams(max_tokens=24, top_p=top_p, seed=5), DEFAULT_MAX_SUPPORT,
                           whole_vocabulary=False)
    gens = [stamp(g, f"r{i}", served_identity(backend, "torch-fp32"))
            for i, g in enumerate(backend.generate([PROMPT] * 4, params))]
    n = sum(g.num_tokens for g in gens)
    assert n == 96 and backend.shape.vocab_size == V
    sizes = np.concatenate([np.diff(g.support.offsets.to_numpy()) for g in gens])
    assert sizes.max() <= DEFAULT_MAX_SUPPORT
    if top_p == 1.0:  # a random model's nucleus is most of the vocabulary: the cap binds
        assert (sizes == DEFAULT_MAX_SUPPORT).all()
    wire = sum(len(SAMPLER.encode(g)) for g in gens) / n
    group = _group(gens, PROMPT)
    at_rest = len(ROLLOUTS.encode(group)) / n  # the buffer, checkpoints of buffered groups
    log = len(msgspec.json.encode(group_entry(group, {}, n=0, step=0, version=0, skipped=None, std_normalize=False,
                                              leave_one_out=False, now=0.0))) / n
    record = AttemptRecord(attempt_id="a0", task_id="t",
                           calls=(CallRecord(index=0, kind="completion", segment=group.trajectories[0].segments[0],
                                             text="x"),))
    atif = len(encode_atif(atif_from_attempt(record, group.trajectories[0], support=True))) / gens[0].num_tokens
    print(f"top_p={top_p}: bytes per generated token: wire {wire:.0f}, group at rest {at_rest:.0f}, "
          f"rollout log {log:.0f}, ATIF with support {atif:.0f}")
    for what, value in (("wire", wire), ("at rest", at_rest), ("rollout log", log), ("ATIF", atif)):
        assert value <= BUDGET, f"{what}: {value:.0f} bytes per token"


def test_the_old_record_listed_the_whole_vocabulary(real_vocab_model_dir):
    """The baseline the cap removes: a sampler allowed the whole vocabulary as its support
    lists all 151,936 ids per token (1.2 MB at 8 bytes a member)."""
    uncapped = TorchBackend(TorchBackendConfig(model_dir=str(real_vocab_model_dir), max_support=V))
    [gen] = uncapped.generate([PROMPT], SamplingParams(max_tokens=2, seed=1))
    per_token = len(SAMPLER.encode(gen)) / gen.num_tokens
    assert per_token > 140 * BUDGET and (np.diff(gen.support.offsets.to_numpy()) > 100_000).all()


def test_the_sampler_agrees_with_the_trainer_over_every_listed_member(backend, trainer):
    gens = backend.generate([PROMPT, PROMPT[:7]], SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=2))
    worst = 0.0
    for prompt, gen in zip((PROMPT, PROMPT[:7]), gens):
        ids = torch.tensor([prompt + gen.token_ids.to_numpy().tolist()])
        with torch.no_grad():
            logits = trainer(ids).logits[0, len(prompt) - 1: -1].float() / 0.8
        sids, slps = gen.support.padded()
        lp, lp_k = replay_logprobs(logits[None], gen.token_ids.to_torch().long()[None], torch.from_numpy(sids)[None])
        valid = torch.from_numpy(sids >= 0)
        worst = max(worst, float((lp[0] - gen.logprobs.to_torch()).abs().max()),
                    float((lp_k[0][valid] - torch.from_numpy(slps)[valid]).abs().max()))
    print(f"torch fp32 sampler vs transformers fp32 at V={V}: max |log q^S - log p^S| {worst:.2e}")
    assert worst < 1e-5


def test_whole_vocabulary_draws_keep_the_record_bounded(real_vocab_model_dir):
    backend = TorchBackend(TorchBackendConfig(model_dir=str(real_vocab_model_dir)))
    params = routed_params(SamplingParams(max_tokens=16, seed=3), DEFAULT_MAX_SUPPORT, whole_vocabulary=True)
    [gen] = backend.generate([PROMPT], params)
    assert gen.support.rule == "vocabulary"
    assert len(SAMPLER.encode(gen)) / gen.num_tokens <= BUDGET + 4  # + the tail mass, 4 bytes a token
    tail = gen.support.tail_mass.to_numpy()
    assert ((tail > 0) & (tail < 1)).all()
    assert json.loads(json.dumps(gen.support.to_json()))["rule"] == "vocabulary"

"""Prompt-shared logits (actors/trainer/prefix.py) equal the plain full-row forward:
logits, loss and gradients, on real batches built from RolloutGroups; and a full
train_step with sharing on and off lands on the same weights."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, build_tiny_llama, load_master_weights
from fleetrl.actors.trainer import TrainerConfig
from fleetrl.actors.trainer.batch import build_batch
from fleetrl.actors.trainer.prefix import plain_logits, shared_prompt_logits
from fleetrl.actors.trainer.step import build_optimizer, train_step
from fleetrl.daemon.config import ConfigError, load_config_text
from fleetrl.grpo import CorrectionConfig, policy_loss

LOGIT_TOL = 1e-4
V = 259
# A very small GQA model for the property test (2 layers, 4 query heads over 2 kv heads).
MICRO = TinyLlamaSpec(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48,
                      max_position_embeddings=512, initializer_range=0.2)


def _seg(groups, rng: np.random.Generator, prompt, n: int):
    """A segment of ``n`` random generated tokens after ``prompt``, each with a valid
    two-member support {token (q=0.7), token+1 (q=0.3)}, so check_group would accept it."""
    toks = rng.integers(3, V - 1, n).tolist()
    lq = [math.log(0.7), math.log(0.3)]
    sup = [[(t, lq[0]), (t + 1, lq[1])] for t in toks]
    return groups.segment(list(prompt), toks, [lq[0]] * n, sup, [0] * n)


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return [BOS_ID, *rng.integers(3, V, n - 1).tolist()]


def _loss(logits_BTV, batch):
    loss, _ = policy_loss(logits_BTV.float(), batch.tokens, batch.sampler_logprobs, batch.support_ids,
                          batch.support_logprobs, batch.advantages, batch.loss_mask, CorrectionConfig())
    return loss


def _compare(model, batch) -> dict[str, float]:
    """Logits, loss and grads of both paths; asserts they agree, returns the measured gaps."""
    out = {}
    for name, fn in (("plain", plain_logits), ("shared", shared_prompt_logits)):
        model.zero_grad(set_to_none=True)
        lg = fn(model, batch)
        loss = _loss(lg, batch)
        loss.backward()
        out[name] = (lg.detach(), loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()})
    (lp, sp), (ll, sl) = (out["plain"][0], out["shared"][0]), (out["plain"][1], out["shared"][1])
    assert lp.shape == sp.shape == (*batch.tokens.shape, V)
    m = batch.loss_mask
    logit_diff = float((lp - sp)[m].abs().max())
    assert logit_diff <= LOGIT_TOL
    assert torch.isfinite(sl) and torch.allclose(ll, sl, rtol=1e-5, atol=1e-7)
    rel = 0.0
    for k, gp in out["plain"][2].items():
        gs = out["shared"][2][k]
        assert torch.isfinite(gs).all(), f"non-finite gradient in {k}"
        assert torch.allclose(gp, gs, rtol=1e-3, atol=1e-6 * max(1.0, float(gp.abs().max()))), k
        rel = max(rel, float((gp - gs).norm() / gp.norm().clamp_min(1e-30)))
    model.zero_grad(set_to_none=True)
    return {"logit_max_abs_diff": logit_diff, "loss_diff": float((ll - sl).abs()), "grad_max_rel_diff": rel}


@pytest.fixture(scope="module")
def micro():
    return build_tiny_llama(MICRO, seed=11).train()


def test_batch_records_each_distinct_prompt_once(groups):
    rng = np.random.default_rng(0)
    p1, p2 = _prompt(rng, 7), _prompt(rng, 3)
    s1 = _seg(groups, rng, p1, 4)
    follow = _seg(groups, rng, p1 + s1.token_ids.to_numpy().tolist() + [10], 2)  # extends p1: another prompt
    g1 = groups.group_of("a", [([s1, follow], 1.0), ([_seg(groups, rng, p1, 2)], 0.0)])
    g2 = groups.group_of("b", [([_seg(groups, rng, p2, 1)], 1.0), ([_seg(groups, rng, p1, 3)], 0.0)])
    b = build_batch([g1, g2])
    assert b.prefix_index.tolist() == [0, 1, 0, 2, 0]  # identical prompts share across groups too
    assert b.prompt_lengths.tolist() == [7, 12, 3]
    assert b.prompt_ids.shape == (3, 12)
    for r in range(b.tokens.shape[0]):
        d = int(b.prefix_index[r])
        n = int(b.prompt_lengths[d])
        assert torch.equal(b.prompt_ids[d, :n], b.input_ids[r, :n])
        assert int(b.positions[r, 0]) == n - 1
        assert (b.prompt_ids[d, n:] == 0).all()


def test_sampled_groups_with_different_prompt_lengths(model_dir, groups):
    prompts = [[BOS_ID, *b"def f(x):"], [BOS_ID, *b"x"],
               [BOS_ID, *b"# add two numbers and return the sum\ndef add(a, b):"]]
    grps = [groups.sampled(model_dir, f"s{i}", p, [1.0, 0.0, 0.5, 0.0], seed=20 + i, max_tokens=9)
            for i, p in enumerate(prompts)]
    batch = build_batch(grps)
    assert batch.prompt_ids.shape[0] == 3 and batch.tokens.shape[0] == 12
    _compare(load_master_weights(model_dir), batch)


def test_many_groups_multi_segment_unique_prompts_and_one_token_rows(model_dir, groups):
    rng = np.random.default_rng(1)
    grps = []
    for g, plen in enumerate((3, 41, 17, 60)):  # groups of 8 with different prompt lengths
        p = _prompt(rng, plen)
        grps.append(groups.group_of(f"g{g}", [([_seg(groups, rng, p, int(n))], float(i % 2))
                                             for i, n in enumerate(rng.integers(1, 20, 8))]))
    # a multi-turn attempt: its second call's prompt extends the first call's prompt and output
    p = _prompt(rng, 9)
    first = _seg(groups, rng, p, 6)
    second = _seg(groups, rng, p + first.token_ids.to_numpy().tolist() + [13, 10], 5)
    grps.append(groups.group_of("turns", [([first, second], 1.0), ([_seg(groups, rng, p, 1)], 0.0)]))
    # a group whose prompts are all different
    grps.append(groups.group_of("unique", [([_seg(groups, rng, _prompt(rng, int(n)), 3)], float(i))
                                           for i, n in enumerate((2, 5, 30))]))
    batch = build_batch(grps)
    assert batch.prompt_ids.shape[0] == 4 + 2 + 3
    assert int(batch.loss_mask.sum(-1).min()) == 1
    gaps = _compare(load_master_weights(model_dir), batch)
    assert gaps["grad_max_rel_diff"] < 1e-4


def test_a_batch_of_one_row(model_dir, groups):
    rng = np.random.default_rng(2)
    for n in (1, 7):  # T == 1 never runs the completion forward
        batch = build_batch([groups.group_of("one", [([_seg(groups, rng, _prompt(rng, 11), n)], 1.0)])])
        batch = dataclasses.replace(batch, advantages=torch.ones(1))  # a non-zero signal
        assert batch.tokens.shape == (1, n)
        _compare(load_master_weights(model_dir), batch)


def test_padding_never_makes_nan_gradients(micro, groups):
    """Prompts of 1 and 200 tokens, and batches whose every completion is one token."""
    rng = np.random.default_rng(3)
    short, long_ = [BOS_ID], _prompt(rng, 200)
    mixed = build_batch([groups.group_of("m", [([_seg(groups, rng, short, 1)], 1.0),
                                               ([_seg(groups, rng, long_, 1)], 0.0),
                                               ([_seg(groups, rng, long_, 9)], 0.5),
                                               ([_seg(groups, rng, short, 12)], 0.0)])])
    ones = build_batch([groups.group_of("o", [([_seg(groups, rng, short, 1)], 1.0),
                                              ([_seg(groups, rng, long_, 1)], 0.0)])])
    for batch in (mixed, ones):
        micro.zero_grad(set_to_none=True)
        loss = _loss(shared_prompt_logits(micro, batch), batch)
        loss.backward()
        assert torch.isfinite(loss)
        grads = [p.grad for p in micro.parameters()]
        assert all(torch.isfinite(g).all() for g in grads)
        assert sum(float(g.abs().sum()) for g in grads) > 0
        _compare(micro, batch)


@st.composite
def _batches(draw):
    """Random prompts (1-24 tokens), 1-6 distinct, shared by 1-10 rows in random
    patterns across 1-3 groups, completions 1-10 tokens."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    prompts = [_prompt(rng, draw(st.integers(1, 24))) for _ in range(draw(st.integers(1, 6)))]
    n_groups = draw(st.integers(1, 3))
    spec = draw(st.lists(st.tuples(st.integers(0, len(prompts) - 1), st.integers(1, 10),
                                   st.integers(0, n_groups - 1)), min_size=1, max_size=10))
    return spec, prompts, seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_batches())
def test_property_shared_equals_plain(micro, groups, drawn):
    spec, prompts, seed = drawn
    rng = np.random.default_rng(seed + 1)
    by_group: dict[int, list] = {}
    for pi, n, g in spec:
        by_group.setdefault(g, []).append(([_seg(groups, rng, prompts[pi], n)], float(rng.random())))
    batch = build_batch([groups.group_of(f"h{g}", trajs) for g, trajs in sorted(by_group.items())])
    used = sorted({pi for pi, _, _ in spec})
    assert batch.prompt_ids.shape[0] == len({tuple(prompts[i]) for i in used})
    batch = dataclasses.replace(batch, advantages=torch.linspace(-1, 1, batch.tokens.shape[0]))
    _compare(micro, batch)


def _optimizer(model, kind):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    return build_optimizer(model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_train_step_with_and_without_sharing_lands_on_the_same_weights(model_dir, groups, kind):
    """AdamW (the trainer's optimizer): weights agree to 1e-5 relative per tensor (typically
    ~1e-6; Adam's first update g / (|g| + eps) amplifies float-rounding gaps of gradients
    near eps). SGD, whose update is proportional to the gradient: the updates themselves
    agree to 1e-4 relative."""
    grps = [groups.sampled(model_dir, f"t{i}", p, [1.0, 0.0, 0.0, 0.5], seed=30 + i, max_tokens=10)
            for i, p in enumerate(([BOS_ID, *b"def g(y):\n    return"], [BOS_ID, *b"1 + 1 ="]))]
    batch = build_batch(grps)
    start = load_master_weights(model_dir).state_dict()
    results = {}
    for share in (False, True):
        model = load_master_weights(model_dir)
        forwards = []
        model.register_forward_pre_hook(lambda mod, args: forwards.append(1))
        metrics = train_step(model, _optimizer(model, kind), batch, corrections=CorrectionConfig(),
                             temperature=0.8, grad_clip=1.0, pass_threshold=1.0, step=0, trainer_version=0,
                             share_prompts=share)
        assert not metrics.skipped
        assert len(forwards) == (2 if share else 1)  # prompts, then completions; or full rows
        results[share] = (metrics, {k: v.clone() for k, v in model.state_dict().items()})
    (mp, wp), (ms, ws) = results[False], results[True]
    assert ms.loss == pytest.approx(mp.loss, rel=1e-5, abs=1e-7)
    assert ms.grad_norm == pytest.approx(mp.grad_norm, rel=1e-5)
    assert ms.mismatch_kl_k3 == pytest.approx(mp.mismatch_kl_k3, rel=1e-3, abs=1e-7)
    moved = 0.0
    for k, w in wp.items():
        update = w - start[k]
        moved = max(moved, float(update.norm() / start[k].norm()))
        if kind == "adamw":
            assert float((ws[k] - w).norm() / w.norm()) < 1e-5, k
        elif update.norm() > 0:
            assert float((ws[k] - w).norm() / update.norm()) < 1e-4, k
    assert moved > 1e-4  # the step really changed the weights


def test_share_prompts_config_field():
    assert TrainerConfig(model_dir="/m").share_prompts is True
    with pytest.raises(ValueError, match=r"TrainerConfig.share_prompts must be true or false"):
        TrainerConfig(model_dir="/m", share_prompts="yes")
    off = load_config_text("""
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
config = {model_dir = "/m", share_prompts = false}
""").actor("trainer").config
    assert off.share_prompts is False
    with pytest.raises(ConfigError, match="share_prompts"):
        load_config_text("""
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
config = {model_dir = "/m", share_prompts = 3}
""")

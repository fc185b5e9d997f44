"""The chunked LM head (actors/trainer/head.py): the trainer computes only the logits its
loss reads, chunk by chunk, and never holds [B, T, V]. Checked against autograd of the
plain head (gradcheck in float64), against the plain path's logits and gradients on a
real tiny model, whole-vocabulary rows included, and by watching every tensor a train
step creates."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, build_tiny_llama
from fleetrl.actors.trainer.batch import build_batch
from fleetrl.actors.trainer.head import SupportHead, chunk_positions, support_logits
from fleetrl.actors.trainer.prefix import plain_hidden, plain_logits, shared_prompt_hidden
from fleetrl.actors.trainer.step import build_optimizer, train_step
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor
from fleetrl.grpo import CorrectionConfig, policy_loss, policy_loss_gathered

V = 259
SMALL = TinyLlamaSpec(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=24,
                      max_position_embeddings=256, initializer_range=0.2)


def _reference(hidden, weight, bias, ids, tok, temperature):
    z = torch.nn.functional.linear(hidden, weight, bias) / temperature
    return z.gather(1, ids), z.gather(1, tok[:, None]).squeeze(1), torch.logsumexp(z, -1)


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_support_head_matches_the_plain_head_in_value_and_gradient(chunk, with_bias):
    g = torch.Generator().manual_seed(chunk)
    N, H, Vs, K = 7, 5, 11, 4
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(Vs, H, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(Vs, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    ids = torch.randint(0, Vs, (N, K), generator=g)
    tok = torch.randint(0, Vs, (N,), generator=g)

    def ours(h, w, b):
        zS, za, lse = SupportHead.apply(h, w, b, ids, tok, 0.7, chunk, True)
        return zS, za, lse

    inputs = (hidden, weight, bias) if with_bias else (hidden, weight)
    assert torch.autograd.gradcheck(lambda *x: ours(*x, *([None] if not with_bias else [])), inputs)
    for got, want in zip(ours(hidden, weight, bias), _reference(hidden, weight, bias, ids, tok, 0.7)):
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_without_the_log_normaliser_its_gradient_is_not_formed():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    ids, tok = torch.randint(0, 6, (4, 2), generator=g), torch.randint(0, 6, (4,), generator=g)
    zS, za, lse = SupportHead.apply(hidden, weight, None, ids, tok, 1.0, 2, False)
    assert (lse == 0).all()
    (zS.sum() + za.sum()).backward()
    ref_zS, ref_za, _ = _reference(hidden.detach().requires_grad_(), weight, None, ids, tok, 1.0)
    h2 = hidden.detach().clone().requires_grad_()
    z = torch.nn.functional.linear(h2, weight.detach())
    (z.gather(1, ids).sum() + z.gather(1, tok[:, None]).sum()).backward()
    torch.testing.assert_close(hidden.grad, h2.grad)


def test_chunk_size_follows_the_byte_budget():
    assert chunk_positions(151_936, 256 << 20) == 441
    assert chunk_positions(259, 256 << 20) > 10**5
    assert chunk_positions(151_936, 1) == 1


def _segment(rng, prompt, n, *, vocabulary: bool):
    """n tokens after prompt with a valid record: a listed two-member support, or a
    whole-vocabulary listing of three members with its tail."""
    toks = rng.integers(3, V - 3, n)
    if vocabulary:
        lq = np.log([0.5, 0.2, 0.1])
        ids = np.stack([toks, toks + 1, toks + 2], 1).astype(np.int32)
        support = m.SupportCSR(ids=Tensor.from_numpy(ids.reshape(-1)),
                               logprobs=Tensor.from_numpy(np.tile(lq, n).astype(np.float32)),
                               offsets=Tensor.from_numpy(np.arange(0, 3 * n + 1, 3, dtype=np.int64)),
                               rule="vocabulary", tail_mass=Tensor.from_numpy(np.full(n, 0.2, dtype=np.float32)))
        lp = np.full(n, lq[0], dtype=np.float32)
    else:
        lq = np.log([0.7, 0.3])
        ids = np.stack([toks, toks + 1], 1).astype(np.int32)
        support = m.SupportCSR(ids=Tensor.from_numpy(ids.reshape(-1)),
                               logprobs=Tensor.from_numpy(np.tile(lq, n).astype(np.float32)),
                               offsets=Tensor.from_numpy(np.arange(0, 2 * n + 1, 2, dtype=np.int64)))
        lp = np.full(n, lq[0], dtype=np.float32)
    ident = m.SamplerIdentity(sampler_id="s", backend="torch", device_kind="cpu", dtype="float32")
    return m.TokenSegment(prompt_ids=Tensor.from_numpy(np.asarray(prompt, dtype=np.int64)),
                          token_ids=Tensor.from_numpy(toks.astype(np.int32)), logprobs=Tensor.from_numpy(lp),
                          support=support, versions=Tensor.from_numpy(np.zeros(n, dtype=np.int64)), sampler=ident,
                          finish_reason="length")


def _batch(seed: int = 0, lengths=(5, 3, 7, 4)):
    """Four attempts at one prompt; the second and fourth drew from the whole vocabulary."""
    rng = np.random.default_rng(seed)
    prompt = [BOS_ID, *rng.integers(3, V, 6).tolist()]
    trajs = []
    for i, (n, vocab) in enumerate(zip(lengths, (False, True, False, True))):
        seg = _segment(rng, prompt, n, vocabulary=vocab)
        trajs.append(m.Trajectory(attempt_id=f"a{i}", task_id="t", group_id="g", segments=(seg,), reward=float(i % 2)))
    return build_batch([m.RolloutGroup(group_id="g", task_id="t", trajectories=tuple(trajs))])


@pytest.mark.parametrize("chunk_bytes", [4 * V, 4 * V * 5, 1 << 30])
def test_gathered_loss_equals_the_plain_logits_loss_with_whole_vocabulary_rows(chunk_bytes):
    torch.manual_seed(0)
    model = build_tiny_llama(SMALL, seed=5).train()
    batch = _batch()
    assert batch.support_vocab.tolist() == [False, True, False, True]
    config = CorrectionConfig(weighting="tis", centering=True)  # no band: the random model's tokens stay kept
    grads = []
    for path in ("plain", "chunked"):
        model.zero_grad(set_to_none=True)
        if path == "plain":
            lg = plain_logits(model, batch).float() / 0.8
            loss, met = policy_loss(lg, batch.tokens, batch.sampler_logprobs, batch.support_ids,
                                    batch.support_logprobs, batch.advantages, batch.loss_mask, config,
                                    vocabulary=batch.support_vocab, tail_mass=batch.support_tail)
        else:
            g = support_logits(model, plain_hidden(model, batch), batch.tokens, batch.support_ids, batch.loss_mask,
                               temperature=0.8, want_vocab_lse=True, chunk_bytes=chunk_bytes)
            loss, met = policy_loss_gathered(g, batch.tokens, batch.sampler_logprobs, batch.support_ids,
                                             batch.support_logprobs, batch.advantages, batch.loss_mask, config,
                                             vocab_size=V, vocabulary=batch.support_vocab,
                                             tail_mass=batch.support_tail)
        loss.backward()
        grads.append((float(loss.detach()), met, {k: p.grad.clone() for k, p in model.named_parameters()}))
    (l1, m1, g1), (l2, m2, g2) = grads
    assert math.isclose(l1, l2, rel_tol=1e-5, abs_tol=1e-7)
    assert m1["tokens_counted"] == m2["tokens_counted"] and m2["vocabulary_tokens"] == 7.0
    assert m2["tail_mass_mean"] == pytest.approx(0.2, rel=1e-6) and m2["centering_bound_max"] > 0
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-6, msg=k)


class _Largest(TorchDispatchMode):
    """Records the largest floating tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("share", [False, True])
def test_a_train_step_never_holds_logits_of_the_whole_batch(share):
    """With a chunk of 2 positions no op of the step produces more than a few chunks'
    worth of logits; the plain head would produce [B, L, V]."""
    model = build_tiny_llama(SMALL, seed=1).train()
    batch = _batch(1, lengths=(20, 12, 16, 9))
    B, L = batch.input_ids.shape
    T = batch.tokens.shape[1]
    params = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with _Largest() as watch:
        met = train_step(model, opt, batch, corrections=CorrectionConfig(), temperature=1.0, grad_clip=1.0,
                         pass_threshold=1.0, step=0, trainer_version=0, share_prompts=share,
                         logits_chunk_bytes=2 * 4 * V)
    assert not met.skipped and met.vocabulary_tokens == 21
    biggest_weight = max(p.numel() for p in model.parameters())
    assert watch.largest <= max(biggest_weight, params // 4, 2 * V * 2)
    assert watch.largest < B * T * V / 2
    with _Largest() as plain:
        plain_logits(model, batch)
    assert plain.largest >= B * T * V  # what the step avoids


def test_train_step_is_the_same_whatever_the_chunk():
    batch = _batch(2)
    after = []
    for chunk_bytes in (4 * V, 1 << 30):
        model = build_tiny_llama(SMALL, seed=2).train()
        opt = build_optimizer(model, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        met = train_step(model, opt, batch, corrections=CorrectionConfig(), temperature=1.0, grad_clip=1.0,
                         pass_threshold=1.0, step=0, trainer_version=0, logits_chunk_bytes=chunk_bytes)
        after.append((met, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (m1, w1), (m2, w2) = after
    assert not m1.skipped and m1.tokens == m2.tokens and m1.vocabulary_tokens == m2.vocabulary_tokens == 7
    assert math.isclose(m1.loss, m2.loss, rel_tol=1e-5, abs_tol=1e-7)
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-5, atol=1e-6, msg=k)


def test_shared_prompt_hidden_states_equal_the_plain_ones():
    model = build_tiny_llama(SMALL, seed=4)
    batch = dataclasses.replace(_batch(3))
    with torch.no_grad():
        a, b = plain_hidden(model, batch), shared_prompt_hidden(model, batch)
    torch.testing.assert_close(a[batch.loss_mask], b[batch.loss_mask], rtol=1e-5, atol=1e-5)

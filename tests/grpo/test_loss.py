"""policy_loss: agreement with a per-token loop reference, and invariants 1, 2, 5-9
of docs/reference/corrections.md. All in float64 on CPU, sizes small enough for Hypothesis."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fleetrl.grpo import BadLossInput, CorrectionConfig, policy_loss
from fleetrl.grpo.loss import centering_gradient_logits

settings.load_profile("grpo")

seeds = st.integers(0, 2**31 - 1)
configs = st.builds(
    CorrectionConfig,
    weighting=st.sampled_from(["none", "tis", "mask", "tis+mask"]),
    tis_cap=st.sampled_from([0.8, 1.0, 1.5, 2.0, math.inf]),
    mask_low=st.sampled_from([0.0, 0.5, 0.8, 0.95]),
    mask_high=st.sampled_from([1.05, 1.25, 2.0, 5.0, math.inf]),
    seq_mask=st.sampled_from([None, (0.9, 1.1), (0.5, 2.0), (0.99, 1.01)]),
    centering=st.booleans(),
    normalization=st.sampled_from(["token", "sequence"]),
)


def run(batch: SimpleNamespace, config: CorrectionConfig, **override):
    args = dict(
        logits=batch.logits,
        tokens=batch.tokens,
        sampler_logprobs=batch.sampler_logprobs,
        support_ids=batch.support_ids,
        support_logprobs=batch.support_logprobs,
        advantages=batch.advantages,
        loss_mask=batch.loss_mask,
        config=config,
    )
    args.update(override)
    logits = args["logits"]
    if logits.grad is not None:
        logits.grad = None
    loss, metrics = policy_loss(**args)
    (grad,) = torch.autograd.grad(loss, logits, allow_unused=False) if loss.requires_grad else (torch.zeros_like(logits),)
    return loss.detach(), grad, metrics


def ref(grpo, batch, config):
    z = batch.logits
    loss = grpo.reference_loss(batch, config)
    (grad,) = torch.autograd.grad(loss, z)
    return loss.detach(), grad


@given(seed=seeds, B=st.integers(1, 3), T=st.integers(1, 4), V=st.integers(2, 9),
       top_p=st.sampled_from([0.5, 0.8, 0.95, 1.0]), top_k=st.sampled_from([None, 2, 4]),
       mismatch=st.sampled_from([0.05, 0.3, 1.0]), config=configs)
def test_matches_the_per_token_loop_reference(grpo, seed, B, T, V, top_p, top_k, mismatch, config):
    batch = grpo.make_batch(seed, B, T, V, top_p=top_p, top_k=top_k, mismatch=mismatch)
    loss, grad, metrics = run(batch, config)
    ref_loss, ref_grad = ref(grpo, batch, config)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-12)
    assert metrics["loss"] == pytest.approx(float(loss), rel=1e-12, abs=1e-15)


@given(seed=seeds, B=st.integers(1, 3), T=st.integers(1, 4), V=st.integers(2, 9), config=configs,
       give_q=st.booleans())
def test_full_vocabulary_matches_the_reference(grpo, seed, B, T, V, config, give_q):
    """support_ids=None: the trainer's full softmax; centering needs q over the vocabulary."""
    batch = grpo.make_batch(seed, B, T, V, top_p=1.0)
    full_q = torch.log_softmax(batch.sampler_logits, -1)
    batch.sampler_logprobs = full_q.gather(-1, batch.tokens[..., None]).squeeze(-1)
    batch.support_ids = None
    batch.support_logprobs = full_q if give_q else None
    if config.centering and not give_q:
        with pytest.raises(BadLossInput, match="centering=True needs support_logprobs"):
            run(batch, config)
        return
    loss, grad, _ = run(batch, config)
    ref_loss, ref_grad = ref(grpo, batch, config)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-12)


@given(seed=seeds, config=configs)
def test_zero_probability_tokens_in_a_full_vocabulary_q_are_harmless(grpo, seed, config):
    """A sampler that masks part of the vocabulary reports log q = -inf there."""
    batch = grpo.make_batch(seed, 2, 3, 7, top_p=0.6)
    full_q = torch.full((2, 3, 8), -math.inf, dtype=torch.float64)  # column 7 takes the padding
    full_q.scatter_(-1, batch.support_ids.masked_fill(batch.support_ids < 0, 7), batch.support_logprobs)
    batch.support_ids, batch.support_logprobs = None, full_q[..., :7]
    loss, grad, metrics = run(batch, config)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    ref_loss, ref_grad = ref(grpo, batch, config)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-12)


def test_full_vocabulary_equals_replay_over_every_token(grpo):
    batch = grpo.make_batch(11, 2, 3, 6, top_p=1.0)
    config = CorrectionConfig(weighting="tis+mask", tis_cap=1.2, mask_low=0.7, mask_high=1.5)
    loss, grad, _ = run(batch, config)
    full_q = torch.full((2, 3, 6), -math.inf, dtype=torch.float64)
    full_q.scatter_(-1, batch.support_ids, batch.support_logprobs)
    loss2, grad2, _ = run(batch, config, support_ids=None, support_logprobs=full_q)
    torch.testing.assert_close(loss2, loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad2, grad, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------ invariant 1: rho == 1


@given(seed=seeds, B=st.integers(1, 3), T=st.integers(1, 5), V=st.integers(2, 12),
       top_p=st.sampled_from([0.5, 0.9, 1.0]), config=configs)
def test_at_ratio_one_every_variant_is_plain_grpo(grpo, seed, B, T, V, top_p, config):
    assume(config.tis_cap >= 1 and config.mask_low <= 1 <= config.mask_high)
    batch = grpo.make_batch(seed, B, T, V, top_p=top_p, on_policy=True)
    loss, grad, metrics = run(batch, config)
    # plain GRPO / REINFORCE on the (replayed) support distribution, written directly
    z = batch.logits
    ids = batch.support_ids.clamp(min=0)
    zS = z.gather(-1, ids).masked_fill(batch.support_ids < 0, -math.inf)
    lp_a = z.gather(-1, batch.tokens[..., None]).squeeze(-1) - torch.logsumexp(zS, -1)
    per_tok = -batch.advantages[:, None] * lp_a * batch.loss_mask
    if config.normalization == "token":
        plain = per_tok.sum() / batch.loss_mask.sum().clamp(min=1)
    else:
        n = batch.loss_mask.sum(-1)
        plain = (per_tok.sum(-1)[n > 0] / n[n > 0]).sum() / (n > 0).sum().clamp(min=1)
    (plain_grad,) = torch.autograd.grad(plain, z)
    torch.testing.assert_close(loss, plain.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, plain_grad, rtol=1e-9, atol=1e-12)
    assert metrics["frac_masked_tokens"] == 0 and metrics["frac_masked_sequences"] == 0
    assert abs(metrics["mismatch_kl_k3"]) < 1e-12
    assert metrics["tokens_counted"] == float(batch.loss_mask.sum())


# ------------------------------------------------- invariant 2: masked tokens drop out


@given(seed=seeds, B=st.integers(1, 3), T=st.integers(1, 5), V=st.integers(2, 9), config=configs)
def test_loss_mask_positions_have_no_gradient_and_do_not_matter(grpo, seed, B, T, V, config):
    batch = grpo.make_batch(seed, B, T, V, top_p=0.9, mask_p=0.6)
    loss, grad, _ = run(batch, config)
    off = ~batch.loss_mask
    assert (grad[off] == 0).all()
    # garbage at those positions changes nothing
    g = torch.Generator().manual_seed(seed)
    logits = batch.logits.detach().clone()
    logits[off] = 100 * torch.randn(int(off.sum()), V, generator=g, dtype=torch.float64)
    logits.requires_grad_(True)
    tokens = batch.tokens.masked_fill(off, -100)
    slp = batch.sampler_logprobs.masked_fill(off, math.nan)
    ids = batch.support_ids.masked_fill(off[..., None], -1)
    loss2, grad2, _ = run(batch, config, logits=logits, tokens=tokens, sampler_logprobs=slp, support_ids=ids)
    torch.testing.assert_close(loss2, loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad2[~off], grad[~off], rtol=1e-12, atol=1e-14)
    assert torch.isfinite(grad2).all()


@given(seed=seeds, B=st.integers(1, 3), T=st.integers(2, 6), V=st.integers(2, 9),
       weighting=st.sampled_from(["mask", "tis+mask"]), centering=st.booleans(),
       normalization=st.sampled_from(["token", "sequence"]))
def test_band_masked_tokens_are_left_out_of_the_normaliser(grpo, seed, B, T, V, weighting, centering, normalization):
    """A token rejected by the band behaves exactly like a token outside loss_mask:
    zero gradient *and* not counted (slime PR 657's bug would shrink the rest)."""
    batch = grpo.make_batch(seed, B, T, V, top_p=0.9, mismatch=1.0)
    config = CorrectionConfig(weighting=weighting, mask_low=0.8, mask_high=1.25, centering=centering,
                              normalization=normalization)
    loss, grad, metrics = run(batch, config)
    _, lp_ratio = _log_ratio(batch)
    rejected = batch.loss_mask & ((lp_ratio < math.log(0.8)) | (lp_ratio > math.log(1.25)))
    assume(rejected.any() and (batch.loss_mask & ~rejected).any())
    assert (grad[rejected] == 0).all()
    loss2, grad2, metrics2 = run(batch, config, loss_mask=batch.loss_mask & ~rejected)
    torch.testing.assert_close(loss, loss2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, grad2, rtol=1e-12, atol=1e-14)
    assert metrics["tokens_counted"] == metrics2["tokens_counted"]
    assert metrics["frac_masked_tokens"] == pytest.approx(float(rejected.sum()) / float(batch.loss_mask.sum()))


def _log_ratio(batch):
    z = batch.logits.detach()
    ids = batch.support_ids.clamp(min=0)
    zS = z.gather(-1, ids).masked_fill(batch.support_ids < 0, -math.inf)
    lp_a = z.gather(-1, batch.tokens[..., None]).squeeze(-1) - torch.logsumexp(zS, -1)
    return lp_a, lp_a - batch.sampler_logprobs


def test_sequence_mask_drops_whole_sequences_and_their_count(grpo):
    batch = grpo.make_batch(4, 4, 6, 8, top_p=0.9, mismatch=1.0, mask_p=1.0)
    _, lr = _log_ratio(batch)
    gm = lr.mean(-1)
    low, high = float(gm.sort().values[1]) - 1e-9, float(gm.sort().values[2]) + 1e-9  # keep the middle two
    config = CorrectionConfig(weighting="tis", tis_cap=math.inf, seq_mask=(math.exp(low), math.exp(high)),
                              centering=False, normalization="sequence")
    loss, grad, metrics = run(batch, config)
    kept = (gm >= low) & (gm <= high)
    assert int(kept.sum()) == 2
    assert (grad[~kept] == 0).all() and (grad[kept] != 0).any()
    assert metrics["frac_masked_sequences"] == 0.5
    assert metrics["sequences_counted"] == 2.0
    only = torch.zeros_like(batch.loss_mask)
    only[kept] = True
    loss2, grad2, _ = run(batch, CorrectionConfig(weighting="tis", tis_cap=math.inf, centering=False,
                                                  normalization="sequence"), loss_mask=only)
    torch.testing.assert_close(loss, loss2)
    torch.testing.assert_close(grad, grad2)


def test_sequence_normalisation_leaves_out_empty_sequences(grpo):
    batch = grpo.make_batch(9, 3, 4, 6, on_policy=True, mask_p=1.0)
    mask = batch.loss_mask.clone()
    mask[1] = False
    config = CorrectionConfig(centering=False, normalization="sequence")
    loss, _, metrics = run(batch, config, loss_mask=mask)
    lp_a, _ = _log_ratio(batch)
    per_seq = -(batch.advantages[:, None] * lp_a).mean(-1)
    torch.testing.assert_close(loss, (per_seq[0] + per_seq[2]).detach() / 2)
    assert metrics["sequences_counted"] == 2.0


def test_nothing_counted_gives_zero_loss_and_zero_gradient(grpo):
    batch = grpo.make_batch(2, 2, 3, 5, top_p=0.9)
    for normalization in ("token", "sequence"):
        loss, grad, metrics = run(batch, CorrectionConfig(normalization=normalization),
                                  loss_mask=torch.zeros(2, 3, dtype=torch.bool))
        assert float(loss) == 0 and (grad == 0).all()
        assert metrics["tokens_counted"] == 0


# ---------------------------------------------- invariants 5-8: score centering


def _one_position(seed: int, K: int, mismatch: float):
    g = torch.Generator().manual_seed(seed)
    zS = 2 * torch.randn(K, generator=g, dtype=torch.float64)
    lq = torch.log_softmax(zS + mismatch * torch.randn(K, generator=g, dtype=torch.float64), -1)
    return zS, lq


def _position_batch(zS, lq, a: int, A: float):
    K = zS.shape[0]
    return SimpleNamespace(
        logits=zS.reshape(1, 1, K).clone().requires_grad_(True),
        tokens=torch.tensor([[a]]),
        sampler_logprobs=lq[a].reshape(1, 1),
        support_ids=torch.arange(K).reshape(1, 1, K),
        support_logprobs=lq.reshape(1, 1, K),
        advantages=torch.tensor([A], dtype=torch.float64),
        loss_mask=torch.ones(1, 1, dtype=torch.bool),
    )


def _weight(lr: torch.Tensor, config: CorrectionConfig) -> torch.Tensor:
    from fleetrl.grpo import log_weights

    return log_weights(lr, config).exp()


@given(seed=seeds, K=st.integers(1, 10), mismatch=st.floats(0.0, 2.0),
       weighting=st.sampled_from(["none", "tis", "mask", "tis+mask"]), cap=st.sampled_from([0.7, 1.0, 1.3, math.inf]),
       A=st.floats(-3, 3).filter(lambda x: abs(x) > 1e-3))
def test_closed_form_gradient_equals_autograd(seed, K, mismatch, weighting, cap, A):
    """Invariant 8: dl/dz = -A [w_a (e_a - p^S) - sum_v c_v (e_v - p^S)], c_v = q^S_v w_v."""
    zS, lq = _one_position(seed, K, mismatch)
    config = CorrectionConfig(weighting=weighting, tis_cap=cap, mask_low=0.6, mask_high=1.6)
    p = torch.softmax(zS, -1)
    w = _weight(torch.log_softmax(zS, -1) - lq, config)
    c = lq.exp() * w
    for a in range(K):
        if w[a] == 0:
            continue  # a rejected token: no gradient at all (tested elsewhere)
        _, grad, _ = run(_position_batch(zS, lq, a, A), config)
        e_a = torch.zeros(K, dtype=torch.float64)
        e_a[a] = 1
        closed = -A * (w[a] * (e_a - p) - (c - c.sum() * p))
        torch.testing.assert_close(grad.reshape(K), closed, rtol=1e-9, atol=1e-12)


@given(seed=seeds, K=st.integers(1, 10), mismatch=st.floats(0.0, 2.0),
       log_w=st.lists(st.floats(-5, 5) | st.just(-math.inf), min_size=10, max_size=10))
def test_centred_score_has_zero_mean_under_q_for_any_weights(seed, K, mismatch, log_w):
    """Invariant 5, for arbitrary weights f: sum_a q_a [w_a (e_a - p) - (c - (sum c) p)] = 0."""
    zS, lq = _one_position(seed, K, mismatch)
    p = torch.softmax(zS, -1)
    q = lq.exp()
    w = torch.tensor(log_w[:K], dtype=torch.float64).exp()
    c = q * w
    centre = centering_gradient_logits(c, torch.log(p))
    mean = sum(q[a] * (w[a] * (torch.eye(K, dtype=torch.float64)[a] - p) - centre) for a in range(K))
    torch.testing.assert_close(mean, torch.zeros(K, dtype=torch.float64), rtol=0, atol=1e-10)


@given(seed=seeds, K=st.integers(1, 10), mismatch=st.floats(0.0, 2.0),
       weighting=st.sampled_from(["none", "tis"]), cap=st.sampled_from([0.7, 1.3, math.inf]))
def test_centred_loss_gradient_has_zero_mean_over_the_sampled_token(seed, K, mismatch, weighting, cap):
    """Invariant 5 through policy_loss: E_{a ~ q^S}[grad] = 0 with centering, for fixed A."""
    zS, lq = _one_position(seed, K, mismatch)
    config = CorrectionConfig(weighting=weighting, tis_cap=cap)
    mean = sum(lq[a].exp() * run(_position_batch(zS, lq, a, 1.0), config)[1].reshape(K) for a in range(K))
    torch.testing.assert_close(mean, torch.zeros(K, dtype=torch.float64), rtol=0, atol=1e-10)


@given(seed=seeds, B=st.integers(1, 3), T=st.integers(1, 4), V=st.integers(2, 9),
       top_p=st.sampled_from([0.6, 0.9, 1.0]), which=st.sampled_from(["tis", "mask"]))
def test_centering_is_a_no_op_under_full_unclipped_importance_sampling(grpo, seed, B, T, V, top_p, which):
    """Invariant 6: w = p^S/q^S untruncated => mu_w = sum_v p_v grad log p_v = 0."""
    batch = grpo.make_batch(seed, B, T, V, top_p=top_p, mismatch=0.5)
    kw = {"tis_cap": math.inf} if which == "tis" else {"mask_low": 0.0, "mask_high": math.inf}
    _, with_c, m = run(batch, CorrectionConfig(weighting=which, centering=True, **kw))
    _, without, _ = run(batch, CorrectionConfig(weighting=which, centering=False, **kw))
    torch.testing.assert_close(with_c, without, rtol=1e-9, atol=1e-12)
    assert m["centering_norm"] < 1e-9


@given(seed=seeds, K=st.integers(2, 10), mismatch=st.floats(0.1, 2.0),
       weighting=st.sampled_from(["none", "tis"]), cap=st.sampled_from([0.7, 1.3]))
def test_centering_term_does_not_depend_on_the_sampled_token_and_vanishes_at_zero_advantage(
    seed, K, mismatch, weighting, cap
):
    """Invariant 7."""
    zS, lq = _one_position(seed, K, mismatch)
    on = CorrectionConfig(weighting=weighting, tis_cap=cap, centering=True)
    off = CorrectionConfig(weighting=weighting, tis_cap=cap, centering=False)
    diffs = [run(_position_batch(zS, lq, a, 1.3), on)[1] - run(_position_batch(zS, lq, a, 1.3), off)[1] for a in range(K)]
    for d in diffs[1:]:
        torch.testing.assert_close(d, diffs[0], rtol=1e-9, atol=1e-12)
    if weighting == "none":  # mu = q - p in logit space: non-zero whenever q != p
        assert diffs[0].abs().max() > 0
    _, zero_grad, _ = run(_position_batch(zS, lq, 0, 0.0), on)
    assert (zero_grad == 0).all()


# ---------------------------------------------------- invariant 9: numerical range


@given(x=st.floats(-30, 30), y=st.floats(-30, 30), config=configs, dtype=st.sampled_from([torch.float32, torch.float64]))
def test_no_nan_or_inf_for_log_ratios_within_twenty(x, y, config, dtype):
    """Two-member supports with log q^S(a) = logsigmoid(x), log p^S(a) = logsigmoid(y)."""
    lq_a = torch.nn.functional.logsigmoid(torch.tensor(x, dtype=torch.float64))
    lp_a = torch.nn.functional.logsigmoid(torch.tensor(y, dtype=torch.float64))
    assume(abs(float(lp_a - lq_a)) <= 20)
    lq = torch.stack([lq_a, torch.log1p(-lq_a.exp()) if x < 30 else torch.tensor(-x, dtype=torch.float64)])
    assume(torch.isfinite(lq).all())
    batch = SimpleNamespace(
        logits=torch.tensor([[[y, 0.0]]], dtype=dtype, requires_grad=True),
        tokens=torch.tensor([[0]]),
        sampler_logprobs=lq[:1].reshape(1, 1).to(dtype),
        support_ids=torch.tensor([[[0, 1]]]),
        support_logprobs=lq.reshape(1, 1, 2).to(dtype),
        advantages=torch.tensor([1.5], dtype=dtype),
        loss_mask=torch.ones(1, 1, dtype=torch.bool),
    )
    loss, grad, metrics = run(batch, config)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


def test_half_precision_logits_are_upcast(grpo):
    batch = grpo.make_batch(1, 2, 3, 8, top_p=0.9)
    logits = batch.logits.detach().to(torch.bfloat16).requires_grad_(True)
    loss, grad, _ = run(batch, CorrectionConfig(), logits=logits, support_logprobs=batch.support_logprobs.float(),
                        sampler_logprobs=batch.sampler_logprobs.float(), advantages=batch.advantages.float())
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert torch.isfinite(grad.float()).all() and grad.float().abs().sum() > 0


# ------------------------------------------------------------------- bad input


def test_bad_inputs_are_named(grpo):
    batch = grpo.make_batch(0, 2, 3, 6, top_p=0.8, mask_p=1.0)
    cfg = CorrectionConfig()
    cases = [
        ({"config": {"weighting": "tis"}}, "config must be a fleetrl.grpo.CorrectionConfig"),
        ({"logits": batch.logits[0]}, "logits must be a floating"),
        ({"tokens": batch.tokens[:1]}, "tokens must be an integer"),
        ({"tokens": batch.tokens.masked_fill(batch.loss_mask, 99)}, r"tokens\[0, 0\] = 99 is not a token id"),
        ({"loss_mask": batch.loss_mask.long()}, "loss_mask must be a bool"),
        ({"advantages": torch.tensor([1.0, math.nan], dtype=torch.float64)}, "advantages must be finite; sequence 1"),
        ({"advantages": torch.zeros(3, dtype=torch.float64)}, r"advantages must be a floating \[B\]"),
        ({"sampler_logprobs": batch.sampler_logprobs + 1.0}, "is not a finite log-probability"),
        ({"support_logprobs": None}, "centering=True needs support_logprobs"),
        ({"support_logprobs": batch.support_logprobs[..., :1]}, "support_logprobs must be floating with the shape"),
        ({"support_logprobs": batch.support_logprobs + math.log(0.9)}, r"sum to probability 0\.9"),
        ({"support_ids": batch.support_ids + 100}, "support_ids must be token ids"),
    ]
    for override, message in cases:
        with pytest.raises(BadLossInput, match=message):
            policy_loss(**{**_args(batch, cfg), **override})


def test_a_sampled_token_outside_its_support_is_named(grpo):
    batch = grpo.make_batch(0, 1, 2, 6, top_p=0.5, mask_p=1.0)
    tokens = batch.tokens.clone()
    not_in = next(v for v in range(6) if v not in batch.support_ids[0, 1].tolist())
    tokens[0, 1] = not_in
    with pytest.raises(BadLossInput, match=r"tokens\[0, 1\] = .* is not in its reported support"):
        policy_loss(**{**_args(batch, CorrectionConfig(centering=False)), "tokens": tokens})


def test_duplicate_support_ids_and_inconsistent_sampled_logprob_are_named(grpo):
    batch = grpo.make_batch(0, 1, 1, 6, top_p=1.0, mask_p=1.0)
    ids = batch.support_ids.clone()
    ids[0, 0, -1] = ids[0, 0, 0]
    with pytest.raises(BadLossInput, match=r"support_ids\[0, 0\] lists a token id twice"):
        policy_loss(**{**_args(batch, CorrectionConfig(centering=False)), "support_ids": ids})
    with pytest.raises(BadLossInput, match=r"sampler_logprobs\[0, 0\] = .* disagrees"):
        policy_loss(**{**_args(batch, CorrectionConfig()), "sampler_logprobs": batch.sampler_logprobs - 0.5})


def _args(batch, config):
    return dict(
        logits=batch.logits, tokens=batch.tokens, sampler_logprobs=batch.sampler_logprobs,
        support_ids=batch.support_ids, support_logprobs=batch.support_logprobs,
        advantages=batch.advantages, loss_mask=batch.loss_mask, config=config,
    )


def test_metrics_match_direct_computation(grpo):
    batch = grpo.make_batch(21, 3, 5, 7, top_p=0.8, mismatch=0.8, mask_p=0.7)
    config = CorrectionConfig(weighting="tis", tis_cap=1.1, centering=True)
    _, _, metrics = run(batch, config)
    _, lr = _log_ratio(batch)
    lr_m = lr[batch.loss_mask]
    assert metrics["log_ratio_mean"] == pytest.approx(float(lr_m.mean()))
    assert metrics["log_ratio_min"] == pytest.approx(float(lr_m.min()))
    assert metrics["log_ratio_max"] == pytest.approx(float(lr_m.max()))
    assert metrics["mismatch_kl_k3"] == pytest.approx(float((lr_m.exp() - 1 - lr_m).mean()))
    assert metrics["weight_mean"] == pytest.approx(float(lr_m.exp().clamp(max=1.1).mean()))
    # centering norm: ||c - (sum c) p^S|| per kept token, c_v = q^S_v min(rho_v, C)
    norms = []
    z = batch.logits.detach()
    for b, t in batch.loss_mask.nonzero().tolist():
        S = [int(v) for v in batch.support_ids[b, t] if int(v) >= 0]
        p = torch.softmax(z[b, t, S], -1)
        q = batch.support_logprobs[b, t, : len(S)].exp()
        c = q * (p / q).clamp(max=1.1)
        norms.append(float((c - c.sum() * p).norm()))
    assert metrics["centering_norm"] == pytest.approx(sum(norms) / len(norms))
    assert metrics["centering_norm"] > 0

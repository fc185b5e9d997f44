"""Whole-vocabulary rows (docs/reference/corrections.md, "Supports at real vocabularies"):
the sampler drew from all of q and listed only its K most likely members, with log q over
the vocabulary and the tail mass. The ratio is exact; centering over the listing misses
terms whose L1 norm (gradient w.r.t. the logits) is bounded by 2 W tau, and the metrics
report that bound. Checked against the exact whole-vocabulary loss (support_ids=None with
q over every token)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.grpo import BadLossInput, CorrectionConfig, policy_loss, sample_from_vocabulary, vocabulary_listing
from fleetrl.grpo.loss import SupportLogits, max_weight, policy_loss_gathered

settings.load_profile("grpo")

WEIGHTINGS = ("none", "tis", "mask", "tis+mask")


def case(seed: int, B: int, T: int, V: int, K: int, *, mismatch: float = 0.4, scale: float = 1.5):
    g = torch.Generator().manual_seed(seed)
    z = scale * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    zq = z + mismatch * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tok, lqa = sample_from_vocabulary(zq.reshape(B * T, V), temperature=1.0, generator=g)
    ids, lq, tail = vocabulary_listing(zq.reshape(B * T, V), temperature=1.0, k=K)
    k = ids.shape[1]
    return dict(z=z, full_lq=torch.log_softmax(zq, -1), tokens=tok.reshape(B, T), lqa=lqa.reshape(B, T),
                ids=ids.reshape(B, T, k), lq=lq.reshape(B, T, k), tail=tail.reshape(B, T),
                adv=torch.randn(B, generator=g, dtype=torch.float64),
                mask=torch.rand(B, T, generator=g) < 0.85)


def grads(c, config, *, listed: bool):
    z = c["z"].clone().requires_grad_(True)
    if listed:
        loss, met = policy_loss(z, c["tokens"], c["lqa"], c["ids"], c["lq"], c["adv"], c["mask"], config,
                                vocabulary=torch.ones(c["adv"].shape, dtype=torch.bool), tail_mass=c["tail"])
    else:
        loss, met = policy_loss(z, c["tokens"], c["lqa"], None, c["full_lq"], c["adv"], c["mask"], config)
    loss.backward()
    return loss.detach(), z.grad, met


@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 40), K=st.integers(1, 12),
       weighting=st.sampled_from(WEIGHTINGS), mismatch=st.floats(0.0, 1.5))
def test_the_missing_centering_gradient_is_within_the_reported_bound(seed, V, K, weighting, mismatch):
    config = CorrectionConfig(weighting=weighting, mask_low=0.5, mask_high=5.0, tis_cap=2.0, centering=True)
    c = case(seed, 3, 5, V, K, mismatch=mismatch)
    loss_l, g_l, met = grads(c, config, listed=True)
    loss_f, g_f, met_f = grads(c, config, listed=False)
    # the ratio is exact: the same tokens are kept, the loss value is the same
    assert met["tokens_counted"] == met_f["tokens_counted"]
    torch.testing.assert_close(loss_l, loss_f, rtol=1e-10, atol=1e-12)
    n = max(met["tokens_counted"], 1.0)
    kept = c["mask"].clone()
    # per position: ||grad difference||_1 <= |A| / n * 2 W tau (and <= |A| / n * 2 pi)
    W = max_weight(config)
    diff = (g_l - g_f).abs().sum(-1)
    allowed = c["adv"].abs()[:, None] / n * 2.0 * W * c["tail"]
    assert bool((diff <= allowed + 1e-12).all()), float((diff - allowed).max())
    assert met["vocabulary_tokens"] == float(kept.sum())
    assert met["centering_bound_max"] <= 2.0 * W * float(c["tail"][kept].max()) + 1e-12 if kept.any() else True
    # the reported bound covers the measured difference of every kept position, summed
    if met["tokens_counted"]:
        total = float((diff * n / c["adv"].abs().clamp(min=1e-300)[:, None])[c["mask"]].sum())
        assert total <= met["centering_bound_sum"] + 1e-9


@given(seed=st.integers(0, 2**31 - 1), V=st.integers(2, 30), K=st.integers(1, 10),
       weighting=st.sampled_from(WEIGHTINGS))
def test_without_centering_a_whole_vocabulary_row_is_exact(seed, V, K, weighting):
    config = CorrectionConfig(weighting=weighting, centering=False)
    c = case(seed, 2, 4, V, K)
    loss_l, g_l, _ = grads(c, config, listed=True)
    loss_f, g_f, _ = grads(c, config, listed=False)
    torch.testing.assert_close(loss_l, loss_f, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_l, g_f, rtol=1e-10, atol=1e-14)


def test_listing_everything_makes_centering_exact_and_the_bound_zero():
    config = CorrectionConfig(weighting="tis+mask", centering=True)
    c = case(5, 2, 4, 9, 9)
    assert float(c["tail"].max()) < 1e-12
    loss_l, g_l, met = grads(c, config, listed=True)
    loss_f, g_f, _ = grads(c, config, listed=False)
    torch.testing.assert_close(g_l, g_f, rtol=1e-9, atol=1e-12)
    assert met["centering_bound_max"] < 1e-10 and met["tail_mass_max"] < 1e-12


def test_tail_figures_are_reported_per_step():
    config = CorrectionConfig(weighting="mask", centering=True)
    c = case(2, 2, 6, 30, 3)
    _, _, met = grads(c, config, listed=True)
    rows = c["mask"]
    assert met["vocabulary_tokens"] == float(rows.sum())
    assert math.isclose(met["tail_mass_sum"], float(c["tail"][rows].sum()), rel_tol=1e-12)
    assert math.isclose(met["tail_mass_mean"], float(c["tail"][rows].mean()), rel_tol=1e-12)
    assert met["tail_mass_max"] == pytest.approx(float(c["tail"][rows].max()))
    assert 0 < met["centering_bound_mean"] <= met["centering_bound_max"]
    # a listed batch reports none of it
    _, _, plain = grads(c, CorrectionConfig(centering=False), listed=False)
    assert plain["vocabulary_tokens"] == 0.0 and plain["tail_mass_max"] == 0.0


def test_gathered_logits_give_the_same_loss_and_gradients():
    """`policy_loss_gathered` is `policy_loss` after its gather (the trainer's path)."""
    config = CorrectionConfig(weighting="tis+mask", centering=True)
    c = case(9, 2, 5, 25, 6)
    vocab = torch.tensor([True, False])
    # row 1 becomes a listed row: its support is its listing, renormalised, holding the token
    ids, lq, tok, lqa = c["ids"].clone(), c["lq"].clone(), c["tokens"].clone(), c["lqa"].clone()
    ids[1], lq[1] = ids[1], lq[1] - torch.logsumexp(lq[1], -1, keepdim=True)
    tok[1], lqa[1] = ids[1, :, 0], lq[1, :, 0]
    z1 = c["z"].clone().requires_grad_(True)
    loss1, m1 = policy_loss(z1, tok, lqa, ids, lq, c["adv"], c["mask"], config, vocabulary=vocab, tail_mass=c["tail"])
    loss1.backward()
    z2 = c["z"].clone().requires_grad_(True)
    gathered = SupportLogits(support=z2.gather(-1, ids.clamp(min=0)), sampled=z2.gather(-1, tok[..., None])[..., 0],
                             vocab_lse=torch.logsumexp(z2, -1))
    loss2, m2 = policy_loss_gathered(gathered, tok, lqa, ids, lq, c["adv"], c["mask"], config, vocab_size=25,
                                     vocabulary=vocab, tail_mass=c["tail"])
    loss2.backward()
    torch.testing.assert_close(loss1, loss2, rtol=0, atol=0)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-12, atol=1e-15)
    assert m1 == m2


def test_bad_whole_vocabulary_input_is_named():
    c = case(1, 1, 3, 8, 3)
    config = CorrectionConfig()
    z = c["z"].clone().requires_grad_(True)
    with pytest.raises(BadLossInput, match="vocabulary must be a bool"):
        policy_loss(z, c["tokens"], c["lqa"], c["ids"], c["lq"], c["adv"], c["mask"], config,
                    vocabulary=torch.ones(1, dtype=torch.long))
    with pytest.raises(BadLossInput, match="need support_ids"):
        policy_loss(z, c["tokens"], c["lqa"], None, c["full_lq"], c["adv"], c["mask"], config,
                    vocabulary=torch.ones(1, dtype=torch.bool))
    over = c["lq"].clone()
    over[0, 0, 0] = 0.0  # a listed member of probability 1 plus others: more than 1
    with pytest.raises(BadLossInput, match="sum to probability .* > 1"):
        policy_loss(z, c["tokens"], c["lqa"], c["ids"], over, c["adv"], torch.ones(1, 3, dtype=torch.bool), config,
                    vocabulary=torch.ones(1, dtype=torch.bool))
    gathered = SupportLogits(support=z.gather(-1, c["ids"]))
    with pytest.raises(BadLossInput, match="need gathered.sampled"):
        policy_loss_gathered(gathered, c["tokens"], c["lqa"], c["ids"], c["lq"], c["adv"], c["mask"], config,
                             vocab_size=8, vocabulary=torch.ones(1, dtype=torch.bool))


def test_an_unbounded_band_bounds_the_centering_error_by_the_trainer_tail():
    """mask_high = inf: W is unbounded, so the bound is 2 pi, the trainer's own mass
    outside the listing (finite, never NaN, even where the sampler's tail is 0)."""
    config = CorrectionConfig(weighting="mask", mask_low=0.0, mask_high=math.inf, centering=True)
    c = case(4, 2, 5, 20, 4)
    c["tail"][0, 0] = 0.0
    _, g_l, met = grads(c, config, listed=True)
    _, g_f, _ = grads(c, config, listed=False)
    assert math.isfinite(met["centering_bound_max"]) and met["centering_bound_max"] <= 2.0
    n = met["tokens_counted"]
    diff = (g_l - g_f).abs().sum(-1)
    pi = 1 - torch.softmax(c["z"], -1).gather(-1, c["ids"]).sum(-1)
    assert bool((diff <= c["adv"].abs()[:, None] / n * 2 * pi + 1e-12).all())

"""policy_loss(reduction="sum"): numerator and normaliser of the mean, so that any split
of the rows (micro-batches, data-parallel ranks) recombines into the whole batch's loss,
gradient and metrics. Float64 on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.grpo import BadLossInput, CorrectionConfig, policy_loss

settings.load_profile("grpo")

configs = st.builds(
    CorrectionConfig,
    weighting=st.sampled_from(["none", "tis", "mask", "tis+mask"]),
    mask_low=st.sampled_from([0.0, 0.8, 0.95]),
    mask_high=st.sampled_from([1.05, 1.25, 5.0]),
    seq_mask=st.sampled_from([None, (0.9, 1.1), (0.99, 1.01)]),
    centering=st.booleans(),
    normalization=st.sampled_from(["token", "sequence"]),
)

ROW_FIELDS = ("tokens", "sampler_logprobs", "support_ids", "support_logprobs", "advantages", "loss_mask")


def _call(batch, logits, rows, config, reduction):
    sel = {k: getattr(batch, k)[rows] for k in ROW_FIELDS}
    return policy_loss(logits[rows], sel["tokens"], sel["sampler_logprobs"], sel["support_ids"],
                       sel["support_logprobs"], sel["advantages"], sel["loss_mask"], config, reduction=reduction)


@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), T=st.integers(1, 4), V=st.integers(2, 8),
       parts=st.lists(st.integers(0, 3), min_size=6, max_size=6), config=configs)
def test_sums_over_any_row_split_equal_the_whole_batch_mean(grpo, seed, B, T, V, parts, config):
    batch = grpo.make_batch(seed, B, T, V, top_p=0.9, mismatch=0.2, mask_p=0.7)
    z = batch.logits
    whole, wm = _call(batch, z, torch.arange(B), config, "mean")
    (g_whole,) = torch.autograd.grad(whole, z) if whole.requires_grad else (torch.zeros_like(z),)

    part_of = torch.tensor(parts[:B])
    num = torch.zeros((), dtype=torch.float64)
    sums: dict[str, float] = {}
    for p in part_of.unique().tolist():
        loss_p, mp = _call(batch, z, (part_of == p).nonzero().squeeze(-1), config, "sum")
        assert mp["loss"] == pytest.approx(float(loss_p.detach()), rel=1e-12, abs=1e-15)
        num = num + loss_p
        for k in ("tokens_counted", "sequences_counted", "tokens_in_loss", "tokens_masked", "sequences_in_loss",
                  "sequences_masked", "log_ratio_sum", "weight_sum", "centering_norm_sum"):
            sums[k] = sums.get(k, 0.0) + mp[k]
    count = sums["tokens_counted" if config.normalization == "token" else "sequences_counted"]
    combined = num / max(count, 1.0)
    (g_comb,) = torch.autograd.grad(combined, z) if combined.requires_grad else (torch.zeros_like(z),)

    assert float(combined.detach()) == pytest.approx(float(whole.detach()), rel=1e-10, abs=1e-12)
    assert torch.allclose(g_comb, g_whole, rtol=1e-9, atol=1e-12)
    for k in ("tokens_counted", "sequences_counted"):
        assert sums[k] == wm[k]
    n_loss, n_keep, n_seq = sums["tokens_in_loss"], sums["tokens_counted"], sums["sequences_in_loss"]
    assert n_loss == float(batch.loss_mask.sum()) and n_seq == float(batch.loss_mask.any(-1).sum())
    frac_tok = sums["tokens_masked"] / n_loss if n_loss else 0.0
    frac_seq = sums["sequences_masked"] / n_seq if n_seq else 0.0
    assert frac_tok == pytest.approx(wm["frac_masked_tokens"], abs=1e-12)
    assert frac_seq == pytest.approx(wm["frac_masked_sequences"], abs=1e-12)
    assert (sums["log_ratio_sum"] / n_loss if n_loss else 0.0) == pytest.approx(wm["log_ratio_mean"], abs=1e-10)
    assert (sums["weight_sum"] / n_keep if n_keep else 0.0) == pytest.approx(wm["weight_mean"], abs=1e-10)
    assert (sums["centering_norm_sum"] / n_keep if n_keep else 0.0) == pytest.approx(wm["centering_norm"],
                                                                                      abs=1e-10)


def test_sum_is_the_mean_times_its_normaliser(grpo):
    batch = grpo.make_batch(3, 4, 5, 7, top_p=0.9, mismatch=0.3)
    for normalization, key in (("token", "tokens_counted"), ("sequence", "sequences_counted")):
        cfg = CorrectionConfig(normalization=normalization)
        mean, mm = _call(batch, batch.logits, torch.arange(4), cfg, "mean")
        total, ms = _call(batch, batch.logits, torch.arange(4), cfg, "sum")
        assert ms[key] == mm[key] > 1
        assert float(total.detach()) == pytest.approx(float(mean.detach()) * ms[key], rel=1e-12)
        assert ms["loss"] == pytest.approx(float(total.detach()), rel=1e-12)
        assert not math.isclose(float(total.detach()), float(mean.detach()))


def test_unknown_reduction_is_named(grpo):
    batch = grpo.make_batch(1, 2, 2, 4)
    with pytest.raises(BadLossInput, match="reduction"):
        _call(batch, batch.logits, torch.arange(2), CorrectionConfig(), "avg")

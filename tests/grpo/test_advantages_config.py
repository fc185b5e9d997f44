"""group_advantages (invariant 10) and CorrectionConfig validation."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.grpo import BadLossInput, CorrectionConfig, group_advantages, policy_loss

settings.load_profile("grpo")

rewards = st.lists(st.floats(-100, 100), min_size=1, max_size=12)
flags = st.fixed_dictionaries({"std_normalize": st.booleans(), "leave_one_out": st.booleans()})


@given(r=rewards, c=st.floats(-100, 100), kw=flags)
def test_advantages_are_shift_invariant(r, c, kw):
    base = group_advantages(torch.tensor(r, dtype=torch.float64), **kw)
    shifted = group_advantages(torch.tensor(r, dtype=torch.float64) + c, **kw)
    scale = 1.0 if kw["std_normalize"] else max(1.0, max(abs(x) for x in r) + abs(c))
    torch.testing.assert_close(shifted, base, rtol=0, atol=1e-9 * scale * 1e3)


@given(v=st.floats(-1e6, 1e6), G=st.integers(1, 16), kw=flags)
def test_equal_rewards_give_exactly_zero(v, G, kw):
    adv = group_advantages(torch.full((G,), v, dtype=torch.float64), **kw)
    assert (adv == 0).all()


@given(r=rewards)
def test_definitions(r):
    x = torch.tensor(r, dtype=torch.float64)
    G = len(r)
    centred = group_advantages(x)
    if (x == x[0]).all():
        return
    torch.testing.assert_close(centred, x - x.mean())
    assert abs(float(centred.sum())) < 1e-9 * max(1.0, float(x.abs().max()))
    loo = group_advantages(x, leave_one_out=True)
    for i in range(G):
        others = [r[j] for j in range(G) if j != i]
        assert math.isclose(float(loo[i]), r[i] - sum(others) / len(others), rel_tol=1e-9, abs_tol=1e-9)
    std = group_advantages(x, std_normalize=True, eps=0.0)
    torch.testing.assert_close(std, (x - x.mean()) / x.std(correction=0))


def test_batched_form_equals_per_group_and_integers_are_accepted():
    r = torch.tensor([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 3]])
    batched = group_advantages(r, std_normalize=True)
    assert batched.dtype == torch.float32
    for n in range(3):
        torch.testing.assert_close(batched[n], group_advantages(r[n], std_normalize=True))
    assert (batched[1] == 0).all()
    assert group_advantages(torch.tensor([5.0]), leave_one_out=True).tolist() == [0.0]


def test_equal_rewards_give_zero_gradient_through_the_loss():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 5, (4, 3), generator=g)
    lp = torch.log_softmax(logits.detach(), -1)
    adv = group_advantages(torch.full((4,), 0.7, dtype=torch.float64), std_normalize=True)
    loss, _ = policy_loss(logits, tokens, lp.gather(-1, tokens[..., None]).squeeze(-1), None, lp, adv,
                          torch.ones(4, 3, dtype=torch.bool), CorrectionConfig())
    loss.backward()
    assert (logits.grad == 0).all()


@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.tensor(1.0), "group dimension"),
        (torch.tensor([1.0, math.nan]), r"finite; found nan at index \(1,\)"),
        ([1.0, 2.0], "torch.Tensor"),
    ],
)
def test_bad_rewards_are_named(bad, message):
    with pytest.raises(BadLossInput, match=message):
        group_advantages(bad)


def test_bad_eps_is_named():
    with pytest.raises(BadLossInput, match="eps"):
        group_advantages(torch.ones(2), eps=-1.0)


# ------------------------------------------------------------------ CorrectionConfig


def test_defaults_and_frozen():
    cfg = CorrectionConfig()
    assert (cfg.weighting, cfg.tis_cap, cfg.mask_low, cfg.mask_high, cfg.seq_mask, cfg.centering, cfg.normalization) == (
        "mask", 2.0, 0.5, 5.0, None, True, "token")
    with pytest.raises(AttributeError):
        cfg.tis_cap = 3.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"weighting": "ppo"}, "weighting"),
        ({"normalization": "batch"}, "normalization"),
        ({"centering": 1}, "centering"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"tis_cap": "2"}, "tis_cap"),
        ({"tis_cap": math.nan}, "tis_cap"),
        ({"mask_low": 2.0, "mask_high": 1.0}, "mask_low/mask_high"),
        ({"mask_low": -0.1}, "mask_low/mask_high"),
        ({"mask_low": math.inf, "mask_high": math.inf}, "mask_low/mask_high"),
        ({"seq_mask": (1.1, 0.9)}, "seq_mask"),
        ({"seq_mask": (0.9,)}, "seq_mask"),
        ({"seq_mask": (0.9, "x")}, r"seq_mask\[1\]"),
        ({"seq_mask": 0.9}, "seq_mask"),
    ],
)
def test_bad_values_are_rejected_at_construction_naming_the_field(kwargs, field):
    with pytest.raises(BadLossInput, match=f"CorrectionConfig.{field}"):
        CorrectionConfig(**kwargs)


def test_decoding_from_config_data_validates_and_names_the_field():
    cfg = msgspec.convert({"weighting": "tis+mask", "seq_mask": [0.99, 1.01], "tis_cap": "inf"},
                          CorrectionConfig, strict=False)
    assert cfg.seq_mask == (0.99, 1.01) and cfg.tis_cap == math.inf
    with pytest.raises(msgspec.ValidationError, match="weighting"):
        msgspec.convert({"weighting": "clip"}, CorrectionConfig)
    with pytest.raises(msgspec.ValidationError, match="mask_low"):
        msgspec.convert({"mask_low": 6.0}, CorrectionConfig)
    with pytest.raises(msgspec.ValidationError, match="unknown field `tis_capp`"):
        msgspec.convert({"tis_capp": 3.0}, CorrectionConfig)
    # from TOML, as the daemon's config file would carry it
    text = b'weighting = "tis+mask"\ntis_cap = inf\nseq_mask = [0.99, 1.01]\n'
    assert msgspec.toml.decode(text, type=CorrectionConfig) == cfg

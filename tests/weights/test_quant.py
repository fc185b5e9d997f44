"""The fp8 quantizer: determinism, scale rules, block locality, error bounds, bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.weights.quant import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    FP8_SCALE_FLOOR,
    dequantize_fp8,
    quantize_fp8,
    scale_shape,
)

SCHEMES = ["tensor", "row", "block128"]


def _rand(shape, seed, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _bytes(q: torch.Tensor) -> bytes:
    return q.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deterministic_identical_bytes(scheme, dtype):
    t = _rand((300, 257), 0, dtype)
    q1, s1 = quantize_fp8(t, scheme)
    q2, s2 = quantize_fp8(t.clone(), scheme)
    assert q1.dtype == FP8_DTYPE and s1.dtype == torch.float32
    assert _bytes(q1) == _bytes(q2)
    assert s1.numpy().tobytes() == s2.numpy().tobytes()


@pytest.mark.parametrize(
    "shape,scheme,want",
    [
        ((300, 257), "tensor", ()),
        ((300, 257), "row", (300,)),
        ((300, 257), "block128", (3, 3)),
        ((256, 128), "block128", (2, 1)),
        ((1000,), "block128", (1, 8)),
        ((1000,), "row", (1,)),
        ((4, 5, 130), "block128", (1, 2)),
        ((4, 5, 130), "row", (20,)),
        ((), "block128", (1, 1)),
    ],
)
def test_scale_shapes(shape, scheme, want):
    assert scale_shape(shape, scheme) == want
    q, s = quantize_fp8(_rand(shape, 1), scheme)
    assert tuple(s.shape) == want and q.shape == torch.Size(shape)


def test_scales_are_amax_over_448_per_block():
    t = _rand((200, 300), 2, torch.float32)
    _, s = quantize_fp8(t, "block128")
    for i in range(2):
        for j in range(3):
            blk = t[i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK]
            want = torch.tensor(blk.abs().max().item(), dtype=torch.float32) / FP8_MAX
            assert s[i, j].item() == want.item()
    _, sr = quantize_fp8(t, "row")
    assert torch.equal(sr, t.abs().amax(dim=1) / FP8_MAX)
    _, st_ = quantize_fp8(t, "tensor")
    assert st_.item() == (t.abs().max() / FP8_MAX).item()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_all_zero_blocks_get_floor_and_dequantize_to_zero(scheme):
    t = torch.zeros(130, 260, dtype=torch.bfloat16)
    t[:128, :128] = 1.0  # one non-zero block, the rest zero
    q, s = quantize_fp8(t, scheme)
    if scheme == "block128":
        assert s[0, 0].item() == pytest.approx(1 / FP8_MAX)
        assert (s.flatten()[1:] == FP8_SCALE_FLOOR).all()
    if scheme == "row":
        assert (s[128:] == FP8_SCALE_FLOOR).all()
    assert torch.isfinite(s).all() and (s > 0).all()
    d = dequantize_fp8(q, s, scheme)
    assert torch.equal(d[128:], torch.zeros_like(d[128:]))
    assert torch.equal(d[:128, :128], t[:128, :128])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_amax_element_maps_to_448(scheme):
    t = _rand((64, 64), 3, torch.float32)
    t[5, 7] = 100.0
    q, _ = quantize_fp8(t, scheme)
    assert q[5, 7].float().item() == FP8_MAX


@pytest.mark.parametrize("scheme", ["row", "block128"])
def test_row_bands_quantize_independently(scheme):
    """Re-quantizing a 128-row band alone gives the same bytes as the whole tensor:
    the property fp8 followers rely on to re-quantize only touched rows or blocks."""
    t = _rand((400, 300), 4)
    q, s = quantize_fp8(t, scheme)
    qb, sb = quantize_fp8(t[128:256], scheme)
    assert _bytes(qb) == _bytes(q[128:256].contiguous())
    if scheme == "block128":
        assert torch.equal(sb, s[1:2])
    else:
        assert torch.equal(sb, s[128:256])


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 300),
    cols=st.integers(1, 300),
    seed=st.integers(0, 2**31),
    log_scale=st.integers(-20, 20),
    scheme=st.sampled_from(SCHEMES),
)
def test_round_trip_error_is_within_e4m3_precision(rows, cols, seed, log_scale, scheme):
    t = _rand((rows, cols), seed, torch.float32, scale=2.0**log_scale)
    q, s = quantize_fp8(t, scheme)
    d = dequantize_fp8(q, s, scheme, dtype=torch.float32)
    rows_view = t.reshape(rows, cols)
    if scheme == "tensor":
        full = s.reshape(1, 1).expand(rows, cols)
    elif scheme == "row":
        full = s.reshape(rows, 1).expand(rows, cols)
    else:
        full = s.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    # e4m3: 3 mantissa bits (relative error <= 2**-4 for normals), subnormal step 2**-9.
    tol = torch.maximum(rows_view.abs() * 2.0**-4, full * 2.0**-10) * (1 + 1e-6)
    assert ((d - t).abs() <= tol).all()


def test_bad_input_is_rejected_with_a_clear_error():
    t = torch.ones(4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="scheme"):
        quantize_fp8(t, "block64")
    t[1, 2] = math.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_fp8(t, "row")
    with pytest.raises(TypeError, match="bf16"):
        quantize_fp8(torch.ones(3, dtype=torch.int32), "tensor")
    q, s = quantize_fp8(torch.ones(4, 4), "row")
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_fp8(q, s[:2], "row")


def test_empty_tensor():
    q, s = quantize_fp8(torch.empty(0, 5), "block128")
    assert q.shape == (0, 5) and tuple(s.shape) == (0, 1)
    assert dequantize_fp8(q, s, "block128").shape == (0, 5)

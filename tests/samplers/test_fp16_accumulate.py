"""fp16 matmuls with fp16 accumulation (`matmul = "fp16_accumulate"`): the blocked
accumulation against a sequential fp16 reference, its error bound, the config check, and
the mismatch it adds to an fp16 sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fleetrl.actors.model import TinyLlamaSpec, build_tiny_llama, save_tiny_llama
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.actors.samplers.base import WeightVersion
from fleetrl.actors.samplers.llama_forward import (
    FP16_ACC_BLOCK,
    Fp16AccWeight,
    fp16_accumulate_linear,
    fp16_accumulate_weight,
    projection,
)
from fleetrl.actors.samplers.torch_weights import TorchWeights
from fleetrl.daemon.messages import SamplingParams

from .conftest import PROMPTS

U16 = 2.0**-11
"""fp16 unit roundoff."""


def sequential_fp16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, block: int) -> np.ndarray:
    """The reference, one output at a time: an fp16 accumulator starting at the bias; each
    block's dot product (exact, in float64) is added and the sum rounded to fp16."""
    x64, w64 = x.double().numpy(), w.double().numpy()
    M, K = x64.shape
    N = w64.shape[0]
    out = np.empty((M, N), dtype=np.float16)
    for m in range(M):
        for n in range(N):
            acc = np.float16(0.0 if bias is None else float(bias[n]))
            for lo in range(0, K, block):
                part = float(np.dot(x64[m, lo:lo + block], w64[n, lo:lo + block]))
                acc = np.float16(float(acc) + part)
            out[m, n] = acc
    return out


def integer_grid(shape, scale, gen):
    """fp16 values k * scale with |k| <= 16: block dot products are exact in fp32, so only
    the accumulator's fp16 rounding can differ from exact arithmetic."""
    return (torch.randint(-16, 17, shape, generator=gen).to(torch.float32) * scale).to(torch.float16)


@pytest.mark.parametrize("K", [16, 70, 256])
@pytest.mark.parametrize("with_bias", [False, True])
def test_blocked_accumulation_equals_the_sequential_fp16_reference(K, with_bias):
    g = torch.Generator().manual_seed(K)
    x = integer_grid((6, K), 0.25, g)
    w = integer_grid((9, K), 0.125, g)
    bias = integer_grid((9,), 4.0, g) if with_bias else None
    got = fp16_accumulate_linear(x, fp16_accumulate_weight(w), bias)
    assert got.dtype == torch.float16 and got.shape == (6, 9)
    want = sequential_fp16(x, w, bias, FP16_ACC_BLOCK)
    assert np.array_equal(got.numpy().view(np.uint16), want.view(np.uint16))
    if K == 256:  # the sums grew past fp16's exact integers: rounding happened, and differs from
        exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert not torch.equal(got.double(), exact)  # exact arithmetic
        once = F.linear(x.float(), w.float(), None if bias is None else bias.float()).half()
        assert not torch.equal(got, once)  # and from fp32 accumulation rounded once


def test_leading_dimensions_and_block_size_are_respected():
    g = torch.Generator().manual_seed(3)
    x = integer_grid((2, 3, 40), 0.25, g)
    w = integer_grid((5, 40), 0.5, g)
    for block in (1, 8, 16, 40, 64):
        wb = fp16_accumulate_weight(w, block)
        assert wb.blocks_BKN.shape == (-(-40 // block), block, 5) and wb.in_features == 40
        got = fp16_accumulate_linear(x, wb)
        assert got.shape == (2, 3, 5)
        want = sequential_fp16(x.reshape(6, 40), w, None, block)
        assert np.array_equal(got.reshape(6, 5).numpy().view(np.uint16), want.view(np.uint16)), block


def test_blocked_accumulation_stays_within_the_rounding_error_bound():
    """Random values: |y - exact| <= gamma_(blocks + 1) * sum |x_i w_i| (Higham's bound for
    recursive summation of the blocks, plus the fp32 rounding of each block), and the
    error is real: larger than fp32 accumulation's on average."""
    g = torch.Generator().manual_seed(0)
    K = 512
    x = torch.randn(32, K, generator=g).half()
    w = (torch.randn(48, K, generator=g) * 0.05).half()
    got = fp16_accumulate_linear(x, fp16_accumulate_weight(w)).double()
    exact = F.linear(x.double(), w.double())
    blocks = K // FP16_ACC_BLOCK
    n = blocks + 1
    gamma = n * U16 / (1 - n * U16)
    magnitude = F.linear(x.double().abs(), w.double().abs())
    assert bool(((got - exact).abs() <= gamma * magnitude + 2**-24).all())
    fp32_acc = F.linear(x.float(), w.float()).half().double()
    assert float((got - exact).abs().mean()) > 2 * float((fp32_acc - exact).abs().mean())


def test_bad_inputs_are_refused():
    w = torch.zeros(4, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="2-D float16"):
        fp16_accumulate_weight(w.float())
    with pytest.raises(ValueError, match="block must be >= 1"):
        fp16_accumulate_weight(w, 0)
    with pytest.raises(ValueError, match="activations must be float16"):
        fp16_accumulate_linear(torch.zeros(2, 8), fp16_accumulate_weight(w))
    with pytest.raises(ValueError, match="input has 7 features, the weight 8"):
        fp16_accumulate_linear(torch.zeros(2, 7, dtype=torch.float16), fp16_accumulate_weight(w))


def test_projection_dispatches_on_the_matmul_copy():
    g = torch.Generator().manual_seed(1)
    x = integer_grid((4, 48), 0.25, g)
    w = integer_grid((6, 48), 0.125, g)
    b = integer_grid((6,), 1.0, g)
    read = {"w": w, "b": b}.__getitem__
    got = projection(x, read, {"w": fp16_accumulate_weight(w)}.__getitem__, "w", "b")
    assert torch.equal(got, fp16_accumulate_linear(x, fp16_accumulate_weight(w), b))


# -- configuration ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_fp16_accumulate_needs_dtype_fp16(model_dir, dtype):
    with pytest.raises(ValueError, match="fp16_accumulate.*needs dtype = 'fp16'"):
        TorchBackendConfig(model_dir=str(model_dir), dtype=dtype, matmul="fp16_accumulate")
    with pytest.raises(ValueError, match="matmul must be one of"):
        TorchBackendConfig(model_dir=str(model_dir), dtype="fp16", matmul="fp8_accumulate")
    with pytest.raises(ValueError, match="needs dtype fp16"):
        TorchWeights({}, dtype=dtype, device=torch.device("cpu"), fp8_scheme="row", fp8_dequantize_once=True,
                     matmul="fp16_accumulate", lm_head_name="lm_head.weight", version=WeightVersion(0, "d"))


def test_an_fp16_accumulate_sampler_multiplies_from_blocked_copies(model_dir):
    be = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="fp16", matmul="fp16_accumulate"))
    assert be.matmul == "fp16_accumulate" and not be.fp32_matmul
    weights, mm, _ = be._snapshot()
    assert mm is not None and "lm_head.weight" in mm and "model.layers.1.mlp.down_proj.weight" in mm
    assert all(isinstance(v, Fp16AccWeight) for v in mm.values())
    assert len(mm) == 7 * 2 + 1  # every projection of both layers, and the LM head
    assert weights["lm_head.weight"].dtype == torch.float16  # the values stay fp16
    [g] = be.generate([PROMPTS[0]], SamplingParams(max_tokens=8, seed=3))
    assert g.num_tokens == 8


# -- the mismatch it adds -----------------------------------------------------------------

WIDE = TinyLlamaSpec(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=768,
                     max_position_embeddings=512, initializer_range=0.05)
"""Wide enough that accumulation matters: 16 blocks per attention projection and the LM
head, 48 in the MLP's down projection."""


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory):
    return save_tiny_llama(build_tiny_llama(WIDE, seed=1), tmp_path_factory.mktemp("wide") / "tiny")


def first_step_distribution(model_dir, dtype, **kw) -> torch.Tensor:
    be = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype, **kw))
    gens = be.generate(PROMPTS, SamplingParams(max_tokens=1, top_p=1.0, seed=0))
    return torch.stack([g.support.logprobs.to_torch()[torch.argsort(g.support.ids.to_torch())] for g in gens]).double()


def test_fp16_accumulation_adds_a_bounded_mismatch(wide_model_dir):
    """Measured on this model (3 prompts x 260 tokens, full next-token distributions):

    ============================  ================  ===============  ==========
    fp16 sampler, matmul          mean |dlog q|     max |dlog q|     KL(p||q)
    ============================  ================  ===============  ==========
    ``fp32`` (fp32 accumulation)  8.8e-4            3.2e-3           6.2e-7
    ``fp16_accumulate``           1.7e-3            7.1e-3           2.0e-6
    ============================  ================  ===============  ==========

    fp16's unit roundoff is 4.9e-4; with fp16 accumulation every one of the 16-48 block
    sums of a projection is rounded to fp16 again, so the logits carry a few more
    roundings of their own size: about twice the mean error, three times the KL. The
    bounds below leave about 3x room above the measurement (another CPU's fp32 kernels
    round differently, the emulation does not) and would catch an emulation that rounds
    far too coarsely (e.g. accumulating each element in fp16, or bf16 rounding).
    """
    exact = first_step_distribution(wide_model_dir, "fp32")
    p = exact.exp()

    def stats(lq):
        diff = (lq - exact).abs()
        return float(diff.mean()), float(diff.max()), float((p * (exact - lq)).sum(-1).mean())

    plain_mean, plain_max, plain_kl = stats(first_step_distribution(wide_model_dir, "fp16", matmul="fp32"))
    acc_mean, acc_max, acc_kl = stats(first_step_distribution(wide_model_dir, "fp16", matmul="fp16_accumulate"))
    assert acc_mean <= 5e-3 and acc_max <= 2.5e-2 and acc_kl <= 1e-5  # bounded
    assert acc_mean > 1.3 * plain_mean and acc_kl > 2 * plain_kl  # the emulation has an effect
    assert plain_max < 1e-2

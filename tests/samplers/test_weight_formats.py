"""How a torch sampler wants its weights handed over (`weight_format`), and pre-quantised
fp8 weights (`Fp8Values`): stored byte for byte, copied, checked."""

from __future__ import annotations

import pytest
import torch

from fleetrl.actors.model.tiny_llama import read_state_dict
from fleetrl.actors.samplers import BadWeightUpdate, TorchBackend, TorchBackendConfig, WeightVersion
from fleetrl.actors.samplers.base import Fp8Values, WeightFormat, weight_format
from fleetrl.actors.samplers.torch_weights import FP8_SUFFIXES, Fp8Weight
from fleetrl.actors.weights.quant import FP8_DTYPE, quantize_fp8
from fleetrl.daemon.messages import SamplingParams

from .conftest import PROMPTS

PROJ = "model.layers.1.self_attn.o_proj.weight"


def backend(model_dir, dtype="fp32", **kw) -> TorchBackend:
    return TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype, **kw))


def bf16_weights(model_dir) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in read_state_dict(model_dir).items()}


def fp8_values(weights, scheme) -> dict[str, torch.Tensor | Fp8Values]:
    """The projections pre-quantised with `scheme`, the rest as given."""
    return {n: Fp8Values(*quantize_fp8(t, scheme), scheme) if n.endswith(FP8_SUFFIXES) else t
            for n, t in weights.items()}


def test_each_dtype_asks_for_its_own_format(model_dir):
    for dtype in ("fp32", "bf16", "fp16"):
        assert backend(model_dir, dtype).weight_format() == WeightFormat(dtype=dtype)
    fmt = backend(model_dir, "fp8", fp8_scheme="tensor").weight_format()
    assert fmt.dtype == "fp8" and fmt.fp8_scheme == "tensor"
    assert len(fmt.fp8_names) == 7 * 2 and all(n.endswith(FP8_SUFFIXES) for n in fmt.fp8_names)
    assert weight_format(backend(model_dir, "fp8", fp8_scheme="tensor")) == fmt


def test_backends_without_a_format_take_bf16_and_a_bad_format_is_refused():
    assert weight_format(object()) == WeightFormat(dtype="bf16")

    class Odd:
        def weight_format(self):
            return "fp8"

    with pytest.raises(TypeError, match="Odd.weight_format\\(\\) returned str"):
        weight_format(Odd())
    with pytest.raises(ValueError, match="fp8_scheme must be one of"):
        WeightFormat(dtype="fp8")
    with pytest.raises(ValueError, match="for dtype fp8, not bf16"):
        WeightFormat(dtype="bf16", fp8_scheme="row")


@pytest.mark.parametrize("scheme", ["tensor", "row", "block128"])
def test_pre_quantised_weights_are_stored_byte_for_byte_and_copied(model_dir, other_model_dir, scheme):
    be = backend(model_dir, "fp8", fp8_scheme=scheme)
    new = bf16_weights(other_model_dir)
    given = fp8_values(new, scheme)
    be.load_version(given, WeightVersion(3, "other"))
    held, _, version = be._snapshot()
    assert version == WeightVersion(3, "other")
    v = given[PROJ]
    assert isinstance(held[PROJ], Fp8Weight)
    assert held[PROJ].q is not v.q and held[PROJ].scale is not v.scale  # copies
    assert torch.equal(held[PROJ].q.view(torch.uint8), v.q.view(torch.uint8))
    assert torch.equal(held[PROJ].scale, v.scale)
    params = SamplingParams(max_tokens=10, top_p=0.9, seed=4)
    expected = be.generate(PROMPTS, params)
    # the same bytes as a backend that quantised the bf16 values itself: same generations
    plain = backend(model_dir, "fp8", fp8_scheme=scheme)
    plain.load_version(new, WeightVersion(3, "other"))
    assert plain.generate(PROMPTS, params) == expected
    v.q.zero_()  # the caller (a follower) re-quantises its tensors in place
    v.scale.fill_(1.0)
    assert be.generate(PROMPTS, params) == expected
    # an update of one projection moves the version and changes only it
    w = (new[PROJ].float() * 2).to(torch.bfloat16)
    be.apply_update({PROJ: Fp8Values(*quantize_fp8(w, scheme), scheme)}, WeightVersion(4, "v4"))
    after, _, _ = be._snapshot()
    assert torch.equal(after[PROJ].q.view(torch.uint8), quantize_fp8(w, scheme)[0].view(torch.uint8))
    assert all(after[n] is held[n] for n in held if n != PROJ)


def test_an_empty_update_moves_only_the_version(model_dir):
    be = backend(model_dir, "bf16")
    before, _, _ = be._snapshot()
    be.apply_update({}, WeightVersion(1, "same weights"))
    after, _, version = be._snapshot()
    assert version == WeightVersion(1, "same weights")
    assert all(after[n] is before[n] for n in before)


def test_bad_pre_quantised_weights_are_refused_and_change_nothing(model_dir):
    be = backend(model_dir, "fp8", fp8_scheme="row")
    w = bf16_weights(model_dir)[PROJ]
    q, s = quantize_fp8(w, "row")
    nan_q = q.clone()
    nan_q.view(torch.uint8)[0, 0] = 0x7F
    cases = [
        ({PROJ: Fp8Values(*quantize_fp8(w, "tensor"), "tensor")}, "scheme 'tensor'; this sampler's fp8 scheme is 'row'"),
        ({PROJ: Fp8Values(q, s[:-1], "row")}, "scales are .* expected float32 of shape"),
        ({PROJ: Fp8Values(q, s.double(), "row")}, "scales are .*float64"),
        ({PROJ: Fp8Values(q, s.clone().fill_(float("inf")), "row")}, "not finite and positive"),
        ({PROJ: Fp8Values(q, torch.zeros_like(s), "row")}, "not finite and positive"),
        ({PROJ: Fp8Values(nan_q, s, "row")}, "contain NaN"),
        ({PROJ: Fp8Values(q.float(), s, "row")}, f"are torch.float32, expected {FP8_DTYPE}"),
        ({PROJ: Fp8Values(q[:-1], s, "row")}, "has shape"),
        ({"model.norm.weight": Fp8Values(*quantize_fp8(torch.ones(64), "row"), "row")},
         "model.norm.weight is pre-quantised fp8, but this sampler keeps it"),
    ]
    before, _, _ = be._snapshot()
    for tensors, message in cases:
        with pytest.raises(BadWeightUpdate, match=message):
            be.apply_update(tensors, WeightVersion(1, "x"))
    assert be.weight_version.version == 0 and be._snapshot()[0] is before
    with pytest.raises(BadWeightUpdate, match="pre-quantised fp8; this backend takes fp32, bf16 or fp16"):
        backend(model_dir, "bf16").apply_update({PROJ: Fp8Values(q, s, "row")}, WeightVersion(1, "x"))

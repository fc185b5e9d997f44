"""What every backend shares: prompt checks, the token record it builds (the wire
`Generation`, checked tightly), its identity, and the errors rooted at `SamplerError`.

The wire types' own checks (`SamplingParams`, `Generation`, the support CSR and
`check_sampled_tokens`) are tested with them, in tests/daemon."""

from __future__ import annotations

import math

import pytest

from fleetrl.actors.samplers import (
    BadGenerateRequest,
    BadWeightUpdate,
    NumericalFailure,
    SamplerError,
    TokenLog,
    UnsupportedModel,
    VllmSupportError,
    check_prompts,
)
from fleetrl.actors.samplers.base import backend_identity, stamp
from fleetrl.daemon import messages as m

IDENT = backend_identity("torch", "cpu", "fp32")


def test_check_prompts_names_the_bad_prompt():
    assert check_prompts([(1, 2), [3]], 10) == [[1, 2], [3]]
    with pytest.raises(BadGenerateRequest, match="non-empty"):
        check_prompts([], 10)
    with pytest.raises(BadGenerateRequest, match=r"prompts\[1\] is empty"):
        check_prompts([[1], []], 10)
    with pytest.raises(BadGenerateRequest, match=r"prompts\[0\]\[2\] = 10"):
        check_prompts([[1, 2, 10]], 10)
    with pytest.raises(BadGenerateRequest, match="tokenize first"):
        check_prompts(["hello"], 10)


def test_a_backend_identity_uses_wire_dtype_names():
    assert IDENT == m.SamplerIdentity(sampler_id="torch", backend="torch", device_kind="cpu", dtype="float32")
    assert backend_identity("vllm", "cuda:H200", "fp8").dtype == "float8_e4m3fn"


def _log(**changes) -> TokenLog:
    log = TokenLog()
    rows = [(3, math.log(0.6), [3, 5], [math.log(0.6), math.log(0.4)], 1), (4, 0.0, [4], [0.0], 2)]
    for t, (tok, lp, ids, lps, version) in enumerate(rows):
        log.add(changes.get(f"token{t}", tok), changes.get(f"lp{t}", lp), ids, lps, changes.get(f"v{t}", version))
    return log


def test_token_log_builds_the_wire_generation():
    log = _log()
    log.finish = "stop"
    gen = log.generation(IDENT, seed=5)
    assert isinstance(gen, m.Generation) and gen.request_id == "" and gen.sampler == IDENT
    assert (gen.num_tokens, gen.finish_reason, gen.seed) == (2, "stop", 5)
    # ids travel as int32 (every vocabulary fits): 4 bytes a token and a support member
    assert gen.token_ids.to_numpy().tolist() == [3, 4] and gen.token_ids.dtype == gen.support.ids.dtype == "int32"
    assert gen.logprobs.dtype == gen.support.logprobs.dtype == "float32"
    assert gen.support.offsets.to_numpy().tolist() == [0, 2, 3]
    assert gen.versions.to_numpy().tolist() == [1, 2]
    assert _log().generation(IDENT, seed=0).finish_reason == "length"  # a row the budget ended


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"token0": 9}, r"generated token 0 \(id 9\) is not in its reported support"),
        ({"lp0": math.log(0.5)}, r"logprobs\[0\] = .* disagrees"),
        ({"v1": 0}, "versions decrease at token 1"),
    ],
)
def test_token_log_refuses_tokens_outside_their_support(changes, message):
    with pytest.raises(ValueError, match=message):
        _log(**changes).generation(IDENT, seed=0)


def test_stamp_names_the_request_and_the_serving_sampler_without_copying():
    gen = _log().generation(IDENT, seed=0)
    served = m.SamplerIdentity(sampler_id="s7", backend="torch", device_kind="cpu", dtype="float32")
    out = stamp(gen, "req-1", served)
    assert (out.request_id, out.sampler, out.seed) == ("req-1", served, 0)
    assert out.token_ids is gen.token_ids and out.support is gen.support


def test_every_sampler_error_derives_from_the_root_and_input_errors_stay_value_errors():
    for cls in (BadGenerateRequest, BadWeightUpdate, NumericalFailure, UnsupportedModel, VllmSupportError):
        assert issubclass(cls, SamplerError)
    for cls in (BadGenerateRequest, BadWeightUpdate, UnsupportedModel):
        assert issubclass(cls, ValueError)
    assert not issubclass(NumericalFailure, ValueError)

"""Token records: the support CSR's padded form and `check_sampled_tokens`, the one check
that tokens were sampled from their reported supports (samplers tight, the trainer loose)."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.daemon import messages as m
from fleetrl.daemon.errors import BadMessage
from fleetrl.daemon.protocol import Tensor
from fleetrl.daemon.tokens import SupportCSR, check_sampled_tokens

IDENT = m.SamplerIdentity(sampler_id="s", backend="torch", device_kind="cpu", dtype="float32")


def _t(values, dtype) -> Tensor:
    return Tensor.from_numpy(np.asarray(values, dtype=dtype))


def _support(ids, lps, offsets) -> SupportCSR:
    return SupportCSR(ids=_t(ids, np.int64), logprobs=_t(lps, np.float64), offsets=_t(offsets, np.int64))


@st.composite
def generations(draw):
    """Random valid generations: each support a distinct id set holding its token."""
    n = draw(st.integers(0, 12))
    tokens, lps, sids, slps, offsets, versions = [], [], [], [], [0], []
    version = draw(st.integers(0, 5))
    for _ in range(n):
        ids = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True))
        raw = np.array(draw(st.lists(st.floats(-5, 5), min_size=len(ids), max_size=len(ids))))
        lp = (raw - (raw.max() + np.log(np.exp(raw - raw.max()).sum()))).tolist()
        pick = draw(st.integers(0, len(ids) - 1))
        tokens.append(ids[pick])
        lps.append(lp[pick])
        sids += ids
        slps += lp
        offsets.append(len(sids))
        version += draw(st.integers(0, 1))
        versions.append(version)
    return m.Generation(request_id="", token_ids=_t(tokens, np.int64), logprobs=_t(lps, np.float64),
                        support=_support(sids, slps, offsets), versions=_t(versions, np.int64),
                        finish_reason="length", sampler=IDENT, seed=1)


@settings(max_examples=60, deadline=None)
@given(generations())
def test_generation_round_trips_msgpack_passes_the_tight_check_and_pads_its_support(gen):
    assert m.SAMPLER.decode(m.SAMPLER.encode(gen)) == gen
    check_sampled_tokens(gen.token_ids, gen.logprobs, gen.support, versions=gen.versions, tol=1e-6,
                         normalised=True)
    ids, lps = gen.support.padded()
    assert ids.shape[0] == gen.num_tokens and ids.dtype == np.int64 and lps.dtype == np.float32
    offsets = gen.support.offsets.to_numpy()
    for t in range(gen.num_tokens):
        a, b = offsets[t], offsets[t + 1]
        k = b - a
        assert ids[t, :k].tolist() == gen.support.ids.to_numpy()[a:b].tolist()
        assert np.allclose(lps[t, :k], gen.support.logprobs.to_numpy()[a:b].astype(np.float32))
        assert (ids[t, k:] == -1).all() and np.isneginf(lps[t, k:]).all()


def test_padded_support_of_no_positions_is_n_by_one():
    ids, lps = _support([], [], [0]).padded()
    assert ids.shape == lps.shape == (0, 1)


GOOD = dict(token_ids=[3, 4], logprobs=[math.log(0.6), 0.0], support_ids=[3, 5, 4],
            support_logprobs=[math.log(0.6), math.log(0.4), 0.0], offsets=[0, 2, 3], versions=[1, 2])


def _check(tol=1e-6, normalised=False, **changes):
    f = GOOD | changes
    check_sampled_tokens(_t(f["token_ids"], np.int64), _t(f["logprobs"], np.float64),
                         _support(f["support_ids"], f["support_logprobs"], f["offsets"]),
                         versions=_t(f["versions"], np.int64), tol=tol, normalised=normalised)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"versions": [2, 1]}, r"versions decrease at token 1: 2 -> 1"),
        ({"token_ids": [9, 4]}, r"generated token 0 \(id 9\) is not in its reported support"),
        ({"support_ids": [3, 3, 4]}, r"generated token 0 \(id 3\) appears more than once in its reported support"),
        ({"logprobs": [math.log(0.5), 0.0]}, r"logprobs\[0\] = -0.69\d* disagrees .* differs"),
        ({"logprobs": [math.nan, 0.0]}, r"logprobs\[0\] = nan disagrees"),
        ({"support_logprobs": [math.log(0.6), math.nan, 0.0]},
         r"token 0: support.logprobs\[1\] = nan is not a finite log-probability"),
        ({"support_logprobs": [math.log(0.6), math.log(0.4), 0.01]},
         r"token 1: support.logprobs\[2\] = 0.01 is not a finite log-probability"),
    ],
)
def test_inconsistent_tokens_are_refused_naming_the_token(changes, message):
    with pytest.raises(ValueError, match=message):
        _check(**changes)


def test_the_tolerance_decides_what_is_close_enough():
    _check()
    nudged = {"logprobs": [math.log(0.6) + 1e-4, 0.0]}
    with pytest.raises(ValueError, match="disagrees"):
        _check(**nudged)
    _check(tol=5e-3, **nudged)


def test_normalisation_is_checked_only_when_asked():
    unnormalised = {"support_logprobs": [math.log(0.6), math.log(0.9), 0.0]}
    _check(**unnormalised)
    with pytest.raises(ValueError, match=r"the support of token 0 has probability 1.50\d*, not 1"):
        _check(normalised=True, **unnormalised)


def test_no_tokens_and_no_versions_are_fine():
    check_sampled_tokens(np.zeros(0, np.int64), np.zeros(0), _support([], [], [0]), tol=1e-6)
    f = GOOD
    check_sampled_tokens(np.asarray(f["token_ids"]), np.asarray(f["logprobs"]),
                         _support(f["support_ids"], f["support_logprobs"], f["offsets"]), tol=1e-6)


def test_a_decoded_generation_with_disagreeing_arrays_is_refused():
    """The structural half stays on the wire type (built or decoded); the sampled-token
    half is `check_sampled_tokens`, run by whoever produces or admits the tokens."""
    gen = m.Generation(request_id="r", token_ids=_t([3, 4], np.int64), logprobs=_t([0.0, 0.0], np.float32),
                       support=_support([3, 5, 4], [-0.5, -0.9, 0.0], [0, 2, 3]), versions=_t([1, 2], np.int64),
                       finish_reason="stop", sampler=IDENT)
    raw = msgspec.to_builtins(gen, builtin_types=(bytes,))
    short = msgspec.to_builtins(_t([0.0], np.float32), builtin_types=(bytes,))
    empty = raw["support"] | {"offsets": msgspec.to_builtins(_t([0, 3, 3], np.int64), builtin_types=(bytes,))}
    for key, value, message in [("logprobs", short, "logprobs has 1 entries"), ("support", empty, "empty support")]:
        with pytest.raises(BadMessage, match=message):
            m.SAMPLER.decode(msgspec.msgpack.encode(raw | {key: value}))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_sampled_token_without_a_finite_log_prob_is_refused_where_it_enters(bad):
    """A NaN or infinite log q (a sampler that "filled in" what it did not compute) is
    refused when the record is built and when it is decoded from a peer, naming the
    token; never passed on to the trainer, where it would poison every ratio."""
    fields = dict(request_id="r", token_ids=_t([3, 4], np.int64), support=_support([3, 5, 4], [-0.5, -0.9, 0.0],
                  [0, 2, 3]), versions=_t([1, 2], np.int64), finish_reason="stop", sampler=IDENT)
    with pytest.raises(ValueError, match=r"logprobs\[1\] = .* is not a finite log-probability"):
        m.Generation(logprobs=_t([-0.5, bad], np.float32), **fields)
    gen = m.Generation(logprobs=_t([-0.5, 0.0], np.float32), **fields)
    raw = msgspec.to_builtins(gen, builtin_types=(bytes,))
    raw["logprobs"] = msgspec.to_builtins(_t([bad, 0.0], np.float32), builtin_types=(bytes,))
    with pytest.raises(BadMessage, match=r"logprobs\[0\] = .* is not a finite"):
        m.SAMPLER.decode(msgspec.msgpack.encode(raw))
    with pytest.raises(ValueError, match=r"logprobs\[0\]"):
        m.TokenSegment(prompt_ids=_t([1], np.int64), logprobs=_t([bad, 0.0], np.float64),
                       **{k: v for k, v in fields.items() if k != "request_id"})


def test_the_sampling_record_is_what_the_params_were_and_travels_to_the_segment():
    params = m.SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, top_k=40, seed=11)
    rec = m.SamplingRecord.of(params)
    assert (rec.temperature, rec.top_p, rec.top_k, rec.seed, rec.whole_vocabulary) == (0.7, 0.9, 40, 11, False)
    assert m.SamplingRecord.of(params, seed=5).seed == 5 and not rec.greedy
    assert m.SamplingRecord.of(m.SamplingParams(max_tokens=1, temperature=0.0)).greedy
    gen = m.Generation(request_id="r", token_ids=_t([3], np.int64), logprobs=_t([0.0], np.float32),
                       support=_support([3], [0.0], [0, 1]), versions=_t([1], np.int64), finish_reason="stop",
                       sampler=IDENT, sampling=rec)
    assert m.SAMPLER.decode(m.SAMPLER.encode(gen)).sampling == rec
    assert m.TokenSegment.from_generation(_t([1], np.int64), gen).sampling == rec
    for bad in (dict(temperature=-1.0), dict(temperature=math.nan), dict(temperature=1.0, top_p=0.0),
                dict(temperature=1.0, top_k=0)):
        with pytest.raises(ValueError, match="SamplingRecord"):
            m.SamplingRecord(**bad)

"""The protocol's structs check themselves, so bad messages are refused with a reason."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.samplers import (
    BadGenerateRequest,
    Generation,
    SamplerIdentity,
    SamplingParams,
    check_prompts,
)

IDENT = SamplerIdentity(backend="torch", device="cpu", dtype="fp32")


@st.composite
def generations(draw):
    """Random valid generations: each support a distinct id set holding its token."""
    n = draw(st.integers(0, 12))
    tokens, lps, sids, slps, offsets, versions = [], [], [], [0], [0], []
    sids, slps = [], []
    version = draw(st.integers(0, 5))
    for _ in range(n):
        ids = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6, unique=True))
        raw = torch.tensor(draw(st.lists(st.floats(-5, 5), min_size=len(ids), max_size=len(ids))), dtype=torch.float64)
        lp = torch.log_softmax(raw, 0).tolist()
        pick = draw(st.integers(0, len(ids) - 1))
        tokens.append(ids[pick])
        lps.append(lp[pick])
        sids += ids
        slps += lp
        offsets.append(len(sids))
        version += draw(st.integers(0, 1))
        versions.append(version)
    return Generation(token_ids=tuple(tokens), logprobs=tuple(lps), support_ids=tuple(sids),
                      support_logprobs=tuple(slps), support_offsets=tuple(offsets), versions=tuple(versions),
                      finish_reason="length", sampler=IDENT, seed=1)


@settings(max_examples=60, deadline=None)
@given(generations())
def test_generation_round_trips_msgpack_and_pads_its_support(gen):
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(gen), type=Generation) == gen
    ids, lps = gen.support_tensors()
    assert ids.shape[0] == gen.num_tokens
    for t in range(gen.num_tokens):
        a, b = gen.support_offsets[t], gen.support_offsets[t + 1]
        k = b - a
        assert ids[t, :k].tolist() == list(gen.support_ids[a:b])
        assert torch.allclose(lps[t, :k], torch.tensor(gen.support_logprobs[a:b], dtype=torch.float32))
        assert bool((ids[t, k:] == -1).all()) and bool(torch.isinf(lps[t, k:]).all())


def _fields(gen: Generation) -> dict:
    return {f: getattr(gen, f) for f in gen.__struct_fields__}


GOOD = Generation(token_ids=(3, 4), logprobs=(math.log(0.6), 0.0), support_ids=(3, 5, 4),
                  support_logprobs=(math.log(0.6), math.log(0.4), 0.0), support_offsets=(0, 2, 3),
                  versions=(1, 2), finish_reason="stop", sampler=IDENT, seed=0)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"logprobs": (0.0,)}, "equal lengths"),
        ({"support_offsets": (0, 2)}, "support_offsets"),
        ({"support_offsets": (0, 3, 3)}, "empty"),
        ({"support_offsets": (1, 2, 3)}, "start at 0"),
        ({"versions": (2, 1)}, "decrease"),
        ({"token_ids": (9, 4)}, "not in its reported support"),
        ({"support_ids": (3, 3, 4)}, "more than once"),
        ({"logprobs": (math.log(0.5), 0.0)}, "differs"),
        ({"support_logprobs": (math.log(0.6), math.nan, 0.0)}, "not a finite log-probability"),
    ],
)
def test_inconsistent_generation_is_refused_when_decoded(changes, message):
    raw = msgspec.msgpack.encode(_fields(GOOD) | changes)
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.msgpack.decode(raw, type=Generation)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"stop_ids": [3, -1]}, "stop_ids\\[1\\]"),
        ({"seed": -1}, "seed"),
        ({"topp": 0.5}, "topp"),
    ],
)
def test_bad_sampling_params_name_the_field(changes, field):
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert({"max_tokens": 4} | changes, SamplingParams)


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

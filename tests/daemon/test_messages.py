"""The message catalogue: round trips of every message, invariants, the released schema."""

from __future__ import annotations

import json
import math

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.daemon import messages as m
from fleetrl.daemon.examples import example_trajectory
from fleetrl.daemon.errors import BadMessage
from fleetrl.daemon.protocol import (
    PROTOCOL_VERSION,
    Codec,
    Message,
    Rejected,
    Tensor,
    evolution_problems,
    schema_snapshot,
)

ENC = msgspec.msgpack.Encoder()
CODECS = (m.SAMPLER, m.WEIGHTS, m.FLEET, m.ROLLOUTS, m.CONTROL, m.FEEDBACK)

# --------------------------------------------------------------------------- strategies

text = st.text(max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
non_neg = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
uint = st.integers(0, 2**40)
seeds = st.none() | st.integers(0, 2**63 - 1)


@st.composite
def vectors(draw, n: int, dtypes: tuple[str, ...], *, finite_only: bool = False):
    dtype = draw(st.sampled_from(dtypes))
    if dtype.startswith("float"):
        width = 32 if dtype == "float32" else 64
        values = draw(st.lists(st.floats(width=width, allow_nan=not finite_only, allow_infinity=not finite_only),
                               min_size=n, max_size=n))
    else:
        hi = 2**31 - 1 if dtype == "int32" else 2**63 - 1
        values = draw(st.lists(st.integers(-hi - 1, hi), min_size=n, max_size=n))
    return Tensor.from_numpy(np.array(values, dtype=dtype))


@st.composite
def supports(draw, n: int):
    counts = draw(st.lists(st.integers(1, 4), min_size=n, max_size=n))
    total = sum(counts)
    return m.SupportCSR(
        ids=draw(vectors(total, ("int32", "int64"))),
        logprobs=draw(vectors(total, ("float32", "float64"))),
        offsets=Tensor.from_numpy(np.cumsum([0, *counts], dtype=np.int64)),
    )


sampling_records = st.builds(
    m.SamplingRecord, temperature=st.floats(0.0, 100.0), top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.none() | st.integers(1, 2**20), seed=seeds, whole_vocabulary=st.booleans())
identities = st.builds(m.SamplerIdentity, sampler_id=text, backend=text, device_kind=text, dtype=text)
finish = st.sampled_from(["stop", "length", "abort"])


@st.composite
def token_fields(draw) -> dict:
    n = draw(st.integers(0, 6))
    return {
        "token_ids": draw(vectors(n, ("int32", "int64"))),
        "logprobs": draw(vectors(n, ("float32", "float64"), finite_only=True)),
        "support": draw(supports(n)),
        "versions": draw(vectors(n, ("int32", "int64"))),
        "sampler": draw(identities),
        "finish_reason": draw(finish),
        "sampling": draw(st.none() | sampling_records),
    }


@st.composite
def segments(draw) -> m.TokenSegment:
    prompt = draw(vectors(draw(st.integers(0, 6)), ("int32", "int64")))
    return m.TokenSegment(prompt_ids=prompt, **draw(token_fields()))


@st.composite
def generations(draw) -> m.Generation:
    return m.Generation(request_id=draw(text), **draw(token_fields()),
                        seed=draw(seeds))


@st.composite
def trajectories(draw, task_id=None, group_id=None) -> m.Trajectory:
    return m.Trajectory(
        attempt_id=draw(text),
        task_id=draw(text) if task_id is None else task_id,
        group_id=draw(text) if group_id is None else group_id,
        segments=tuple(draw(st.lists(segments(), max_size=3))),
        reward=draw(finite),
        metrics=draw(st.dictionaries(text, finite, max_size=3)),
    )


@st.composite
def groups(draw) -> m.RolloutGroup:
    task, group = draw(text), draw(text)
    return m.RolloutGroup(
        group_id=group,
        task_id=task,
        trajectories=tuple(draw(st.lists(trajectories(task, group), max_size=3))),
    )


sampling_params = st.builds(
    m.SamplingParams,
    max_tokens=st.integers(1, 2**31),
    temperature=non_neg,
    top_p=st.floats(min_value=0.0, max_value=1.0, exclude_min=True),
    top_k=st.none() | st.integers(1, 1000),
    stop_ids=st.lists(uint, max_size=4).map(tuple),
    seed=seeds,
)
blobs = st.builds(m.BlobRef, hash=text, size=uint, url=text)


@st.composite
def weight_versions(draw) -> m.WeightVersionAvailable:
    version = draw(st.integers(0, 2**40))
    base = draw(st.none() | st.integers(0, version - 1)) if version else None
    return m.WeightVersionAvailable(
        version=version, digest=draw(text), base=base, blobs=tuple(draw(st.lists(blobs, max_size=3)))
    )


mismatch_figures = st.builds(
    m.MismatchFigures, tokens=st.integers(1, 2**40), kl_k3=non_neg, frac_out_of_band=st.floats(0.0, 1.0),
    log_ratio_mean=finite, log_ratio_std=non_neg, log_ratio_max_abs=non_neg,
)

STRATEGIES: dict[type[Message], st.SearchStrategy] = {
    m.SamplerMismatch: st.builds(
        m.SamplerMismatch, step=uint, version=uint, mask_low=st.floats(0.0, 1.0),
        mask_high=st.floats(2.0, 1e6) | st.just(math.inf),
        by_kind=st.dictionaries(text, mismatch_figures, max_size=3),
        by_sampler=st.lists(st.tuples(identities, mismatch_figures), max_size=3,
                            unique_by=lambda p: p[0].sampler_id).map(tuple),
    ),
    m.GenerateRequest: st.builds(
        m.GenerateRequest,
        request_id=text,
        attempt_id=text,
        prompt_ids=st.integers(1, 8).flatmap(lambda n: vectors(n, ("int32", "int64"))),
        params=sampling_params,
        min_version=uint,
        stream=st.booleans(),
    ),
    m.Generation: generations(),
    m.TokenChunk: st.builds(m.TokenChunk, request_id=text, token_ids=st.lists(uint, max_size=8)),
    m.GenerateFailed: st.builds(m.GenerateFailed, request_id=text, reason=text, retryable=st.booleans()),
    Rejected: st.builds(Rejected, kind=text, detail=text),
    m.WeightVersionAvailable: weight_versions(),
    m.SamplerStatus: st.builds(
        m.SamplerStatus, sampler_id=text, version=uint, digest=text, queue_depth=uint, tokens_per_s=non_neg
    ),
    m.Join: st.builds(
        m.Join, token=text, identity=identities, protocol=uint, capacity=st.integers(1, 512)
    ),
    m.Welcome: st.builds(
        m.Welcome,
        sampler_id=text,
        run_id=text,
        protocol=uint,
        heartbeat_s=st.floats(min_value=0.0, max_value=1e6, exclude_min=True),
        version=uint,
    ),
    m.Refused: st.builds(m.Refused, reason=text, retry_after_s=st.none() | non_neg),
    m.Heartbeat: st.builds(m.Heartbeat, sampler_id=text, sent_at=finite),
    m.Leave: st.builds(m.Leave, sampler_id=text, reason=text),
    m.Trajectory: trajectories(),
    m.RolloutGroup: groups(),
    m.RolloutFailed: st.builds(
        m.RolloutFailed,
        attempt_id=text,
        task_id=text,
        reason=st.sampled_from(
            ["sandbox_error", "harness_crash", "timeout", "evaluator_error", "sampler_error"]
        ),
        detail=text,
        group_id=text,
    ),
    m.Pause: st.builds(m.Pause, reason=text),
    m.Resume: st.builds(m.Resume),
    m.Shutdown: st.builds(m.Shutdown, grace_s=st.none() | non_neg, reason=text),
    m.StatusRequest: st.builds(m.StatusRequest),
    m.StatusReply: st.builds(
        m.StatusReply,
        run_id=text,
        state=st.sampled_from(["starting", "running", "paused", "draining"]),
        version=uint,
        actors=st.lists(
            st.builds(
                m.ActorStatus, name=text, state=text, restarts=uint, last_error=st.none() | text
            ),
            max_size=3,
        ).map(tuple),
    ),
}


# --------------------------------------------------------------------------- round trips


def test_every_message_type_has_a_round_trip_strategy():
    assert set(STRATEGIES) == set(m.ALL_MESSAGES)


@pytest.mark.parametrize("cls", m.ALL_MESSAGES, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_round_trips_through_each_of_its_conversations(cls, data):
    msg = data.draw(STRATEGIES[cls])
    assert type(msg) is cls
    carriers = [c for c in CODECS if cls in c.types]
    assert carriers, f"{cls.__name__} belongs to no conversation"
    for codec in carriers:
        back = codec.decode(codec.encode(msg))
        assert back == msg and type(back) is cls


def test_conversations():
    assert set(m.SAMPLER.types) == {m.GenerateRequest, m.Generation, m.GenerateFailed, m.TokenChunk, Rejected}
    assert set(m.FLEET.types) >= set(m.SAMPLER.types) | set(m.WEIGHTS.types)
    assert {m.Join, m.Welcome, m.Refused, m.Heartbeat, m.Leave} <= set(m.FLEET.types)
    assert Rejected not in m.WEIGHTS.types and not m.WEIGHTS.error_reply
    assert all(c.error_reply for c in (m.SAMPLER, m.FLEET, m.ROLLOUTS, m.CONTROL))
    assert len(m.ALL_MESSAGES) == len(set(m.ALL_MESSAGES))


def test_a_message_of_another_conversation_is_unknown_here():
    data = m.CONTROL.encode(m.Pause(reason="x"))
    with pytest.raises(BadMessage) as info:
        m.SAMPLER.decode(data)
    assert info.value.kind == "unknown_type" and "'Pause'" in info.value.detail


# --------------------------------------------------------------------------- invariants


def vec(values, dtype="int32") -> Tensor:
    return Tensor.from_numpy(np.array(values, dtype=dtype))


def support(counts) -> m.SupportCSR:
    total = sum(counts)
    return m.SupportCSR(
        ids=vec(range(total)),
        logprobs=vec([-1.0] * total, "float32"),
        offsets=Tensor.from_numpy(np.cumsum([0, *counts], dtype=np.int64)),
    )


IDENTITY = m.SamplerIdentity(sampler_id="s0", backend="torch", device_kind="cpu", dtype="bfloat16")


def generation(n=3, **changes) -> m.Generation:
    fields = dict(
        request_id="r",
        token_ids=vec(range(n)),
        logprobs=vec([-0.5] * n, "float32"),
        support=support([2] * n),
        versions=vec([4] * n, "int64"),
        sampler=IDENTITY,
        finish_reason="stop",
    )
    fields.update(changes)
    return m.Generation(**fields)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"logprobs": vec([-0.5] * 2, "float32")}, "logprobs has 2 entries but token_ids has 3"),
        ({"versions": vec([1] * 4)}, "versions has 4 entries but token_ids has 3"),
        ({"support": support([1, 1])}, "support covers 2 positions but token_ids has 3"),
        ({"token_ids": vec([1.0, 2.0, 3.0], "float32")}, "token_ids must have dtype int32 or int64"),
        ({"logprobs": vec([1, 2, 3])}, "logprobs must have dtype float32 or float64"),
        ({"token_ids": Tensor.from_numpy(np.zeros((3, 1), np.int32))}, "token_ids must be 1-d"),
    ],
)
def test_generation_arrays_must_agree(changes, message):
    with pytest.raises(ValueError, match=message):
        generation(**changes)
    # the same message arriving from a peer (constructed around __post_init__)
    good = msgspec.to_builtins(generation(), builtin_types=(bytes,))
    good.update(msgspec.to_builtins(changes, builtin_types=(bytes,)))
    with pytest.raises(BadMessage, match=message) as info:
        m.SAMPLER.decode(ENC.encode(good))
    assert info.value.kind == "invalid" and "Generation" in info.value.detail


@pytest.mark.parametrize(
    ("offsets", "message"),
    [
        ([1, 2, 4], "must start at 0, got 1"),
        ([0, 2, 3], "ends at 3 but support.ids has 4 entries"),
        ([0, 2, 2, 4], r"strictly increase \(empty support at position 1\)"),
        ([], "at least one entry"),
    ],
)
def test_support_csr_must_be_well_formed(offsets, message):
    with pytest.raises(ValueError, match=message):
        m.SupportCSR(
            ids=vec(range(4)),
            logprobs=vec([-1.0] * 4, "float32"),
            offsets=Tensor.from_numpy(np.array(offsets, dtype=np.int64)),
        )


def test_support_csr_offsets_are_int64_and_ids_match_logprobs():
    with pytest.raises(ValueError, match="support.offsets must have dtype int64"):
        m.SupportCSR(ids=vec([1]), logprobs=vec([0.0], "float32"), offsets=vec([0, 1]))
    with pytest.raises(ValueError, match="support.logprobs has 2 entries but support.ids has 1"):
        m.SupportCSR(ids=vec([1]), logprobs=vec([0.0, 0.0], "float32"), offsets=vec([0, 1], "int64"))


def test_support_from_padded_drops_padding_and_keeps_order():
    ids = np.array([[5, 3, -1], [7, -1, -1], [1, 2, 9]], dtype=np.int64)
    lps = np.array([[-0.1, -2.4, -np.inf], [0.0, -np.inf, -np.inf], [-1, -1.5, -2]], dtype=np.float32)
    s = m.SupportCSR.from_padded(ids, lps)
    assert s.positions == 3 and s.ids.dtype == "int32" and s.logprobs.dtype == "float32"  # int32 ids on the wire
    assert s.offsets.to_numpy().tolist() == [0, 2, 3, 6]
    row_ids, row_lps = s.row(0)
    assert row_ids.tolist() == [5, 3] and row_lps.tolist() == pytest.approx([-0.1, -2.4])
    assert s.row(2)[0].tolist() == [1, 2, 9]
    with pytest.raises(ValueError, match="N x K of one shape"):
        m.SupportCSR.from_padded(ids, lps[:2])


def test_sampling_params_ranges_are_checked_at_the_boundary():
    req = m.GenerateRequest(
        request_id="r", attempt_id="a", prompt_ids=vec([1, 2]), params=m.SamplingParams(max_tokens=8)
    )
    good = msgspec.to_builtins(req, builtin_types=(bytes,))
    for field, value, message in [
        ("top_p", 0.0, "Expected `float` > 0.0 at `$.params.top_p`"),
        ("top_p", 1.5, "Expected `float` <= 1.0 at `$.params.top_p`"),
        ("temperature", -1.0, "Expected `float` >= 0.0 at `$.params.temperature`"),
        ("max_tokens", 0, "Expected `int` >= 1 at `$.params.max_tokens`"),
        ("top_k", 0, "Expected `int` >= 1 at `$.params.top_k`"),
        ("stop_ids", [3, -1], "Expected `int` >= 0 at `$.params.stop_ids[1]`"),
    ]:
        bad = {**good, "params": {**good["params"], field: value}}
        with pytest.raises(BadMessage) as info:
            m.SAMPLER.decode(ENC.encode(bad))
        assert message in info.value.detail, info.value.detail


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"stop_ids": (3, -1)}, r"stop_ids\[1\]"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field_when_built_and_when_decoded(changes, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        m.SamplingParams(**({"max_tokens": 4} | changes))
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert({"max_tokens": 4} | changes, m.SamplingParams)


def test_sampling_params_ignore_unknown_fields_as_the_evolution_rule_asks():
    """A field appended by a later release is ignored, not refused (``protocol``)."""
    assert msgspec.convert({"max_tokens": 4, "topp": 0.5}, m.SamplingParams) == m.SamplingParams(max_tokens=4)


def test_generation_counts_its_tokens_and_carries_its_seed():
    g = generation(4, seed=12)
    assert g.num_tokens == 4 and m.SAMPLER.decode(m.SAMPLER.encode(g)).seed == 12
    old_frame = msgspec.to_builtins(g, builtin_types=(bytes,))
    del old_frame["seed"]  # a sampler of an earlier release
    assert m.SAMPLER.decode(ENC.encode(old_frame)).seed is None


def test_generate_request_needs_a_prompt():
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        m.GenerateRequest(
            request_id="r", attempt_id="a", prompt_ids=vec([]), params=m.SamplingParams(max_tokens=1)
        )


def test_rollout_failure_reason_is_one_of_the_known_kinds():
    bad = {"type": "RolloutFailed", "attempt_id": "a", "task_id": "t", "reason": "oops", "detail": ""}
    with pytest.raises(BadMessage, match=r"Invalid enum value 'oops' at `\$.reason`"):
        m.ROLLOUTS.decode(ENC.encode(bad))


def test_weight_delta_base_must_be_older():
    with pytest.raises(ValueError, match="delta base 5 must be older than version 5"):
        m.WeightVersionAvailable(version=5, digest="d", base=5, blobs=())
    anchor = m.WeightVersionAvailable(version=5, digest="d", base=None, blobs=())
    assert m.WEIGHTS.decode(m.WEIGHTS.encode(anchor)) == anchor


def segment(versions) -> m.TokenSegment:
    return m.TokenSegment.from_generation(vec([1]), generation(len(versions), versions=vec(versions, "int64")))


def test_group_rewards_and_oldest_version():
    t1 = m.Trajectory(attempt_id="a1", task_id="t", group_id="g", segments=(segment([4, 5]), segment([3])), reward=1.0)
    t2 = m.Trajectory(attempt_id="a2", task_id="t", group_id="g", segments=(segment([]),), reward=0.0)
    group = m.RolloutGroup(group_id="g", task_id="t", trajectories=(t1, t2))
    assert group.rewards == (1.0, 0.0)
    assert t1.oldest_version == 3 and t2.oldest_version is None and group.oldest_version == 3
    assert t1.n_generated == 3
    stray = m.Trajectory(attempt_id="a3", task_id="t", group_id="other", segments=(), reward=0.0)
    with pytest.raises(ValueError, match=r"trajectories\[1\] belongs to group 'other'"):
        m.RolloutGroup(group_id="g", task_id="t", trajectories=(t1, stray))


def test_join_never_shows_its_token():
    join = m.Join(token="s3cret", identity=IDENTITY)
    assert "s3cret" not in repr(join) and "s3cret" not in str(join)
    assert join.protocol == PROTOCOL_VERSION
    assert m.FLEET.decode(m.FLEET.encode(join)).token == "s3cret"


# --------------------------------------------------------------------------- the typical trajectory


def test_example_trajectory_is_typical_and_round_trips():
    t = example_trajectory(n_tokens=2000, k=20)
    assert t.n_generated == 2000 and len(t.segments) == 4
    for s in t.segments:
        offsets = s.support.offsets.to_numpy()
        assert (np.diff(offsets) == 20).all()
        for i in range(0, s.token_ids.shape[0], 97):  # sampled token is in its support
            ids, lps = s.support.row(i)
            assert s.token_ids.to_numpy()[i] in ids and len(set(ids.tolist())) == 20
            assert np.exp(lps.astype(np.float64)).sum() == pytest.approx(1.0, abs=1e-5)
            assert (np.diff(lps) <= 0).all()  # most likely first
    prompts = [s.prompt_ids.shape[0] for s in t.segments]
    assert prompts == sorted(prompts) and prompts[0] == 512  # the context grows
    data = m.ROLLOUTS.encode(t)
    assert 300_000 < len(data) < 500_000  # ~ 2000 * 20 * (4 + 4) bytes of support
    assert m.ROLLOUTS.decode(data) == t


def test_example_trajectory_sizes():
    t = example_trajectory(n_tokens=10, k=3, n_segments=3, prompt_tokens=4, seed=2)
    assert [s.token_ids.shape[0] for s in t.segments] == [4, 3, 3]
    assert t.segments[0].support.ids.shape == (12,)  # 4 positions x k=3
    with pytest.raises(ValueError, match="n_segments"):
        example_trajectory(n_tokens=2, n_segments=3)


# --------------------------------------------------------------------------- the released schema

RELEASED_V1 = json.loads(
    """
{
    "ActorStatus": {"fields":["name","state","restarts","last_error"],"required":["name","state"],"properties":{"name":{"type":"string"},"state":{"type":"string"},"restarts":{"type":"integer","minimum":0,"default":0},"last_error":{"anyOf":[{"type":"string"},{"type":"null"}],"default":null}}},
    "BlobRef": {"fields":["hash","size","url"],"required":["hash","size","url"],"properties":{"hash":{"type":"string"},"size":{"type":"integer","minimum":0},"url":{"type":"string"}}},
    "GenerateFailed": {"fields":["type","request_id","reason","retryable"],"required":["reason","request_id","type"],"properties":{"type":{"enum":["GenerateFailed"]},"request_id":{"type":"string"},"reason":{"type":"string"},"retryable":{"type":"boolean","default":false}}},
    "GenerateRequest": {"fields":["type","request_id","attempt_id","prompt_ids","params","min_version"],"required":["attempt_id","params","prompt_ids","request_id","type"],"properties":{"type":{"enum":["GenerateRequest"]},"request_id":{"type":"string"},"attempt_id":{"type":"string"},"prompt_ids":{"$ref":"#/$defs/Tensor"},"params":{"$ref":"#/$defs/SamplingParams"},"min_version":{"type":"integer","minimum":0,"default":0}}},
    "Generation": {"fields":["type","request_id","token_ids","logprobs","support","versions","sampler","finish_reason"],"required":["finish_reason","logprobs","request_id","sampler","support","token_ids","type","versions"],"properties":{"type":{"enum":["Generation"]},"request_id":{"type":"string"},"token_ids":{"$ref":"#/$defs/Tensor"},"logprobs":{"$ref":"#/$defs/Tensor"},"support":{"$ref":"#/$defs/SupportCSR"},"versions":{"$ref":"#/$defs/Tensor"},"sampler":{"$ref":"#/$defs/SamplerIdentity"},"finish_reason":{"enum":["abort","length","stop"]}}},
    "Heartbeat": {"fields":["type","sampler_id","sent_at"],"required":["sampler_id","sent_at","type"],"properties":{"type":{"enum":["Heartbeat"]},"sampler_id":{"type":"string"},"sent_at":{"type":"number"}}},
    "Join": {"fields":["type","token","identity","protocol","capacity"],"required":["identity","token","type"],"properties":{"type":{"enum":["Join"]},"token":{"type":"string"},"identity":{"$ref":"#/$defs/SamplerIdentity"},"protocol":{"type":"integer","minimum":0,"default":1},"capacity":{"type":"integer","minimum":1,"default":1}}},
    "Leave": {"fields":["type","sampler_id","reason"],"required":["sampler_id","type"],"properties":{"type":{"enum":["Leave"]},"sampler_id":{"type":"string"},"reason":{"type":"string","default":""}}},
    "Pause": {"fields":["type","reason"],"required":["type"],"properties":{"type":{"enum":["Pause"]},"reason":{"type":"string","default":""}}},
    "Refused": {"fields":["type","reason","retry_after_s"],"required":["reason","type"],"properties":{"type":{"enum":["Refused"]},"reason":{"type":"string"},"retry_after_s":{"anyOf":[{"type":"number","minimum":0.0},{"type":"null"}],"default":null}}},
    "Rejected": {"fields":["type","kind","detail"],"required":["detail","kind","type"],"properties":{"type":{"enum":["Rejected"]},"kind":{"type":"string"},"detail":{"type":"string"}}},
    "Resume": {"fields":["type"],"required":["type"],"properties":{"type":{"enum":["Resume"]}}},
    "RolloutFailed": {"fields":["type","attempt_id","task_id","reason","detail","group_id"],"required":["attempt_id","detail","reason","task_id","type"],"properties":{"type":{"enum":["RolloutFailed"]},"attempt_id":{"type":"string"},"task_id":{"type":"string"},"reason":{"enum":["evaluator_error","harness_crash","sampler_error","sandbox_error","timeout"]},"detail":{"type":"string"},"group_id":{"type":"string","default":""}}},
    "RolloutGroup": {"fields":["type","group_id","task_id","trajectories"],"required":["group_id","task_id","trajectories","type"],"properties":{"type":{"enum":["RolloutGroup"]},"group_id":{"type":"string"},"task_id":{"type":"string"},"trajectories":{"type":"array","items":{"$ref":"#/$defs/Trajectory"}}}},
    "SamplerIdentity": {"fields":["sampler_id","backend","device_kind","dtype"],"required":["backend","device_kind","dtype","sampler_id"],"properties":{"sampler_id":{"type":"string"},"backend":{"type":"string"},"device_kind":{"type":"string"},"dtype":{"type":"string"}}},
    "SamplerStatus": {"fields":["type","sampler_id","version","digest","queue_depth","tokens_per_s"],"required":["digest","queue_depth","sampler_id","tokens_per_s","type","version"],"properties":{"type":{"enum":["SamplerStatus"]},"sampler_id":{"type":"string"},"version":{"type":"integer","minimum":0},"digest":{"type":"string"},"queue_depth":{"type":"integer","minimum":0},"tokens_per_s":{"type":"number","minimum":0.0}}},
    "SamplingParams": {"fields":["max_tokens","temperature","top_p","top_k","stop_ids","seed"],"required":["max_tokens"],"properties":{"max_tokens":{"type":"integer","minimum":1},"temperature":{"type":"number","minimum":0.0,"default":1.0},"top_p":{"type":"number","exclusiveMinimum":0.0,"maximum":1.0,"default":1.0},"top_k":{"anyOf":[{"type":"integer","minimum":1},{"type":"null"}],"default":null},"stop_ids":{"type":"array","items":{"type":"integer","minimum":0},"default":[]},"seed":{"anyOf":[{"type":"integer"},{"type":"null"}],"default":null}}},
    "Shutdown": {"fields":["type","grace_s","reason"],"required":["type"],"properties":{"type":{"enum":["Shutdown"]},"grace_s":{"anyOf":[{"type":"number","minimum":0.0},{"type":"null"}],"default":null},"reason":{"type":"string","default":""}}},
    "StatusReply": {"fields":["type","run_id","state","version","actors"],"required":["run_id","state","type","version"],"properties":{"type":{"enum":["StatusReply"]},"run_id":{"type":"string"},"state":{"enum":["draining","paused","running","starting"]},"version":{"type":"integer","minimum":0},"actors":{"type":"array","items":{"$ref":"#/$defs/ActorStatus"},"default":[]}}},
    "StatusRequest": {"fields":["type"],"required":["type"],"properties":{"type":{"enum":["StatusRequest"]}}},
    "SupportCSR": {"fields":["ids","logprobs","offsets"],"required":["ids","logprobs","offsets"],"properties":{"ids":{"$ref":"#/$defs/Tensor"},"logprobs":{"$ref":"#/$defs/Tensor"},"offsets":{"$ref":"#/$defs/Tensor"}}},
    "Tensor": {"fields":["data","dtype","shape"],"required":["data","dtype","shape"],"properties":{"data":{"type":"string","contentEncoding":"base64"},"dtype":{"type":"string"},"shape":{"type":"array","items":{"type":"integer","minimum":0}}}},
    "TokenSegment": {"fields":["prompt_ids","token_ids","logprobs","support","versions","sampler","finish_reason"],"required":["finish_reason","logprobs","prompt_ids","sampler","support","token_ids","versions"],"properties":{"prompt_ids":{"$ref":"#/$defs/Tensor"},"token_ids":{"$ref":"#/$defs/Tensor"},"logprobs":{"$ref":"#/$defs/Tensor"},"support":{"$ref":"#/$defs/SupportCSR"},"versions":{"$ref":"#/$defs/Tensor"},"sampler":{"$ref":"#/$defs/SamplerIdentity"},"finish_reason":{"enum":["abort","length","stop"]}}},
    "Trajectory": {"fields":["type","attempt_id","task_id","group_id","segments","reward","metrics"],"required":["attempt_id","group_id","reward","segments","task_id","type"],"properties":{"type":{"enum":["Trajectory"]},"attempt_id":{"type":"string"},"task_id":{"type":"string"},"group_id":{"type":"string"},"segments":{"type":"array","items":{"$ref":"#/$defs/TokenSegment"}},"reward":{"type":"number"},"metrics":{"type":"object","additionalProperties":{"type":"number"},"default":{}}}},
    "WeightVersionAvailable": {"fields":["type","version","digest","base","blobs"],"required":["base","blobs","digest","type","version"],"properties":{"type":{"enum":["WeightVersionAvailable"]},"version":{"type":"integer","minimum":0},"digest":{"type":"string"},"base":{"anyOf":[{"type":"integer","minimum":0},{"type":"null"}]},"blobs":{"type":"array","items":{"$ref":"#/$defs/BlobRef"}}}},
    "Welcome": {"fields":["type","sampler_id","run_id","protocol","heartbeat_s","version"],"required":["heartbeat_s","protocol","run_id","sampler_id","type","version"],"properties":{"type":{"enum":["Welcome"]},"sampler_id":{"type":"string"},"run_id":{"type":"string"},"protocol":{"type":"integer","minimum":0},"heartbeat_s":{"type":"number","exclusiveMinimum":0.0},"version":{"type":"integer","minimum":0}}}
}
"""
)
"""The wire schema of protocol version 1, as released. Never edit an entry: the test
below checks that today's catalogue only appends defaulted fields and adds structs."""


def test_catalogue_keeps_the_released_schema():
    problems = evolution_problems(RELEASED_V1, schema_snapshot(m.ALL_MESSAGES))
    assert problems == [], "the message catalogue broke the evolution rule:\n" + "\n".join(problems)


def test_catalogue_messages_are_tagged_by_class_name():
    for codec in CODECS:
        assert isinstance(codec, Codec)
        for tag, cls in codec.tags.items():
            assert tag == cls.__name__  # catalogue messages are tagged by class name

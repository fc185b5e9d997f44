"""Fields appended for the sampler fleet: `Generation.cost_usd`, `TokenSegment.cost_usd`
and `Join.price_per_hour` (appended with defaults, under the evolution rule)."""

from __future__ import annotations

import math

import msgspec
import pytest

from fleetrl.daemon import messages as m
from fleetrl.daemon.errors import BadMessage
from fleetrl.daemon.examples import example_generation
from fleetrl.daemon.protocol import Tensor

IDENTITY = m.SamplerIdentity(sampler_id="s0", backend="torch", device_kind="cpu", dtype="bfloat16")


def _generation(**changes) -> m.Generation:
    g = example_generation(4, 3)
    return msgspec.structs.replace(g, **changes) if changes else g


def test_cost_defaults_to_zero_round_trips_and_is_copied_into_segments():
    assert _generation().cost_usd == 0.0
    g = _generation(cost_usd=0.0125)
    back = m.SAMPLER.decode(m.SAMPLER.encode(g))
    assert back == g and back.cost_usd == 0.0125
    seg = m.TokenSegment.from_generation(Tensor.from_numpy(g.token_ids.to_numpy()[:1]), g)
    assert seg.cost_usd == 0.0125
    traj = m.Trajectory(attempt_id="a", task_id="t", group_id="g", segments=(seg,), reward=1.0)
    assert m.ROLLOUTS.decode(m.ROLLOUTS.encode(traj)).segments[0].cost_usd == 0.0125


@pytest.mark.parametrize("bad", [-0.01, math.nan, math.inf, -math.inf])
def test_negative_or_non_finite_costs_are_refused(bad):
    with pytest.raises(ValueError, match=r"Generation\.cost_usd must be a finite number of dollars >= 0"):
        _generation(cost_usd=bad)
    g = _generation()
    with pytest.raises(ValueError, match=r"TokenSegment\.cost_usd must be a finite number of dollars >= 0"):
        m.TokenSegment(prompt_ids=g.token_ids, token_ids=g.token_ids, logprobs=g.logprobs, support=g.support,
                       versions=g.versions, sampler=g.sampler, finish_reason="stop", cost_usd=bad)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_a_frame_with_a_bad_cost_is_rejected_naming_the_field(bad):
    frame = msgspec.msgpack.encode(msgspec.to_builtins(_generation(), builtin_types=(bytes,)) | {"cost_usd": bad})
    with pytest.raises(BadMessage) as info:
        m.SAMPLER.decode(frame)
    assert info.value.kind == "invalid" and "cost_usd" in str(info.value)


def test_old_and_new_peers_understand_each_other():
    """A frame from a sender without the field decodes with the default; a receiver of
    an earlier release (a struct without it) ignores it."""
    g = _generation(cost_usd=0.5)
    old_frame = msgspec.to_builtins(g, builtin_types=(bytes,))
    del old_frame["cost_usd"]
    assert m.SAMPLER.decode(msgspec.msgpack.encode(old_frame)).cost_usd == 0.0

    class OldJoin(msgspec.Struct, tag="Join", tag_field="type"):
        token: str
        identity: m.SamplerIdentity
        protocol: int = 1
        capacity: int = 1

    join = m.Join(token="t", identity=IDENTITY, capacity=2, price_per_hour=1.25)
    old = msgspec.msgpack.decode(m.FLEET.encode(join), type=OldJoin)
    assert (old.token, old.capacity) == ("t", 2)
    no_price = msgspec.msgpack.encode(OldJoin(token="t", identity=IDENTITY))
    assert m.FLEET.decode(no_price).price_per_hour == 0.0


def test_join_carries_a_price_and_never_shows_its_token():
    join = m.Join(token="s3cret", identity=IDENTITY, price_per_hour=2.5)
    assert m.FLEET.decode(m.FLEET.encode(join)).price_per_hour == 2.5
    assert "s3cret" not in repr(join) and "price_per_hour=2.5" in repr(join)
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"Join\.price_per_hour must be a finite number of dollars >= 0"):
            m.Join(token="t", identity=IDENTITY, price_per_hour=bad)

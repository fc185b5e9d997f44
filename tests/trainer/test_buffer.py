"""Rollout buffer: staleness admission against a fake version source, zero variance,
duplicates, capacity, checkpoint round trip; Hypothesis for 'never lost, never stale'."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import example, HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.actors.buffer import (
    Admitted,
    BadGroup,
    BufferConfig,
    BufferFull,
    BufferState,
    Duplicate,
    RolloutBuffer,
    StaleGroup,
    ZeroVariance,
)


class FakeVersions:
    """A fake trainer version source: the version moves only when told to."""

    def __init__(self) -> None:
        self.version = 0

    def advance(self, by: int = 1) -> None:
        self.version += by


def test_admission_bound_is_inclusive_and_rejections_are_typed(groups):
    buf = RolloutBuffer(BufferConfig(max_staleness=2))
    v = FakeVersions()
    v.advance(5)
    assert buf.offer(groups.versioned("ok", 3), v.version) == Admitted(group_id="ok", staleness=2)
    rej = buf.offer(groups.versioned("old", 2), v.version)
    assert rej == StaleGroup(group_id="old", task_id="task", oldest_version=2, trainer_version=5,
                             max_staleness=2, reason="too_stale")
    assert rej.staleness == 3
    assert buf.counters.stale == 1 and buf.counters.admitted == 1 and len(buf) == 1
    assert buf.staleness_hist == {2: 1}
    with pytest.raises(BadGroup, match="newer than the trainer's version 5"):
        buf.offer(groups.versioned("future", 6), v.version)


def test_zero_variance_skipped_and_counted_unless_configured(groups):
    buf = RolloutBuffer(BufferConfig())
    assert buf.offer(groups.versioned("z", 0, (1.0, 1.0, 1.0)), 0) == ZeroVariance(
        group_id="z", task_id="task", reward=1.0)
    assert buf.counters.zero_variance == 1 and len(buf) == 0
    keep = RolloutBuffer(BufferConfig(skip_zero_variance=False))
    assert isinstance(keep.offer(groups.versioned("z", 0, (1.0, 1.0)), 0), Admitted)


def test_duplicates_queued_or_trained_are_refused(groups):
    buf = RolloutBuffer(BufferConfig(max_staleness=10))
    g = groups.versioned("a", 0)
    buf.offer(g, 0)
    assert buf.offer(g, 0) == Duplicate(group_id="a", trained=False)
    batch, expired = buf.take(1, 0)
    assert [x.group_id for x in batch] == ["a"] and expired == []
    assert buf.offer(g, 0) == Duplicate(group_id="a", trained=True)


def test_capacity_pushes_back_without_taking_the_group(groups):
    buf = RolloutBuffer(BufferConfig(capacity=2))
    buf.offer(groups.versioned("a", 0), 0)
    buf.offer(groups.versioned("b", 0), 0)
    assert not buf.has_room
    with pytest.raises(BufferFull):
        buf.offer(groups.versioned("c", 0), 0)
    assert buf.queued_ids == ("a", "b") and buf.counters.offered == 2
    buf.take(2, 0)
    assert isinstance(buf.offer(groups.versioned("c", 0), 0), Admitted)


def test_groups_that_go_stale_in_the_queue_expire_with_a_report(groups):
    buf = RolloutBuffer(BufferConfig(max_staleness=1))
    buf.offer(groups.versioned("a", 0), 0)
    buf.offer(groups.versioned("b", 1), 1)
    batch, expired = buf.take(1, 2)  # a: staleness 2 > 1
    assert [g.group_id for g in batch] == ["b"]
    assert [(e.group_id, e.reason, e.staleness) for e in expired] == [("a", "expired", 2)]
    assert buf.counters.expired == 1


def test_take_needs_a_full_batch_and_put_back_restores_order(groups):
    buf = RolloutBuffer(BufferConfig(max_staleness=5))
    for name in "abc":
        buf.offer(groups.versioned(name, 0), 0)
    assert buf.take(4, 0) == ([], [])
    batch, _ = buf.take(2, 0)
    assert buf.queued_ids == ("c",) and buf.was_trained("a")
    buf.put_back(batch)
    assert buf.queued_ids == ("a", "b", "c") and not buf.was_trained("a")
    assert buf.counters.trained == 0


def test_snapshot_round_trips_through_msgpack(groups):
    buf = RolloutBuffer(BufferConfig(max_staleness=5))
    for name in "abc":
        buf.offer(groups.versioned(name, 1), 2)
    buf.take(1, 2)
    data = msgspec.msgpack.encode(buf.snapshot())
    again = RolloutBuffer(BufferConfig(max_staleness=5), msgspec.msgpack.decode(data, type=BufferState))
    assert again.queued_ids == ("b", "c") and again.was_trained("a")
    assert again.counters == buf.counters and again.staleness_hist == {1: 3}
    assert again.snapshot() == buf.snapshot()


def test_config_bounds_are_named():
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        BufferConfig(max_staleness=-1)
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        BufferConfig(capacity=0)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("offer"), st.integers(0, 8), st.booleans(), st.integers(0, 11)),
        st.tuples(st.just("advance"), st.integers(1, 3)),
        st.tuples(st.just("take"), st.integers(1, 3)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, max_staleness=st.integers(0, 3), capacity=st.integers(1, 6))
@example(ops=[("offer", 0, False, 0), ("advance", 1), ("take", 1), ("offer", 0, False, 0)],
         max_staleness=0, capacity=1)  # an id admitted again after it expired untrained
def test_never_stale_never_lost(groups, ops, max_staleness, capacity):
    """Every offered group ends up exactly once: queued, trained, or reported (stale,
    expired, zero variance, duplicate, or left with the caller when full); no admitted
    or trained group ever exceeds the staleness bound at that moment."""
    buf = RolloutBuffer(BufferConfig(max_staleness=max_staleness, capacity=capacity))
    v = FakeVersions()
    fates: dict[str, list[str]] = {}
    life: dict[str, str] = {}  # group id -> key of its current admission (an id may be
    # admitted again after it expired untrained: a regenerated group under the same id)
    cache = {}
    offered = 0
    for op in ops:
        if op[0] == "offer":
            _, lag, flat, ident = op
            gid = f"g{ident}"
            oldest = max(0, v.version - lag)
            key = (gid, oldest, flat)
            g = cache.setdefault(key, groups.versioned(gid, oldest, (1.0, 1.0) if flat else (0.0, 1.0)))
            offered += 1
            try:
                out = buf.offer(g, v.version)
            except BufferFull:
                fates.setdefault(f"full#{offered}", []).append("full")
                continue
            if isinstance(out, Admitted):
                assert out.staleness <= max_staleness
                # an id is admitted again only after its previous group expired untrained
                assert gid not in life or fates[life[gid]][-1] == "expired"
                life[gid] = f"{gid}@{offered}"
                fates.setdefault(life[gid], []).append("admitted")
            elif isinstance(out, StaleGroup):
                assert out.staleness > max_staleness
                fates.setdefault(f"{gid}#{offered}", []).append("stale")
            elif isinstance(out, ZeroVariance):
                fates.setdefault(f"{gid}#{offered}", []).append("flat")
            else:
                assert isinstance(out, Duplicate)
                assert gid in buf.queued_ids or buf.was_trained(gid)
                fates.setdefault(f"{gid}#{offered}", []).append("dup")
        elif op[0] == "advance":
            v.advance(op[1])
        else:
            batch, expired = buf.take(op[1], v.version)
            for g in batch:
                assert v.version - g.oldest_version <= max_staleness
                fates[life[g.group_id]].append("trained")
            for e in expired:
                assert e.staleness > max_staleness and e.reason == "expired"
                fates[life[e.group_id]].append("expired")
        assert len(buf) <= capacity
    # admitted groups are queued, trained or expired: exactly one of these, once
    for gid, fate in fates.items():
        if fate[0] == "admitted":
            assert len(fate) <= 2
            assert (life[gid.split("@")[0]] == gid and gid.split("@")[0] in buf.queued_ids) \
                == (len(fate) == 1)
            assert fate.count("admitted") == 1
    c = buf.counters
    assert c.offered + sum(f == ["full"] for f in fates.values()) == offered
    assert c.offered == c.admitted + c.stale + c.zero_variance + c.duplicate
    assert c.admitted == len(buf) + c.trained + c.expired

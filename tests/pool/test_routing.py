"""Routing policies: Hypothesis properties plus the cases that define them."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from fleetrl.actors.pool.routing import (Bounds, SamplerView, cost_aware, expected_latency_s, feasible,
                                         least_loaded, policy_named, with_affinity)

views_st = st.lists(
    st.builds(
        SamplerView,
        sampler_id=st.sampled_from([f"s{i}" for i in range(8)]),
        alive=st.booleans(),
        version=st.integers(0, 12),
        assigned=st.integers(0, 10),
        capacity=st.integers(1, 4),
        usd_per_token=st.none() | st.floats(0, 1e-3, allow_nan=False),
        latency_s=st.none() | st.floats(0.01, 100, allow_nan=False),
    ),
    max_size=8, unique_by=lambda v: v.sampler_id,
)
bounds_st = st.builds(Bounds, trainer_version=st.integers(0, 12), max_staleness=st.integers(0, 4),
                      min_version=st.integers(0, 12),
                      max_latency_s=st.just(math.inf) | st.floats(0.01, 200, allow_nan=False))


@given(views_st, bounds_st, st.sampled_from(["least_loaded", "cost_aware"]))
def test_never_dead_or_stale(views, bounds, name):
    chosen = policy_named(name)(views, bounds)
    ok = feasible(views, bounds)
    if chosen is None:
        assert ok == []
        return
    v = next(v for v in views if v.sampler_id == chosen)
    assert v.alive
    assert v.version >= bounds.min_version
    assert bounds.trainer_version - v.version <= bounds.max_staleness


@given(views_st, bounds_st)
def test_least_loaded_picks_minimum_load(views, bounds):
    chosen = least_loaded(views, bounds)
    ok = feasible(views, bounds)
    if ok:
        best = min(v.assigned / v.capacity for v in ok)
        v = next(v for v in ok if v.sampler_id == chosen)
        assert v.assigned / v.capacity == best


@given(views_st, bounds_st)
def test_cost_aware_picks_cheapest_within_latency(views, bounds):
    chosen = cost_aware(views, bounds)
    ok = feasible(views, bounds)
    if not ok:
        assert chosen is None
        return
    exploring = [v for v in ok if v.usd_per_token is None and v.assigned < v.capacity]
    v = next(v for v in ok if v.sampler_id == chosen)
    if exploring:
        assert v.usd_per_token is None
        return
    within = [w for w in ok if w.usd_per_token is not None
              and (expected_latency_s(w) is None or expected_latency_s(w) <= bounds.max_latency_s)]
    if within:
        assert v.usd_per_token == min(w.usd_per_token for w in within)
        lat = expected_latency_s(v)
        assert lat is None or lat <= bounds.max_latency_s
    else:  # nobody keeps the bound: least loaded, work is never stalled
        assert v.assigned / v.capacity == min(w.assigned / w.capacity for w in ok)


def _v(sid, **kw):
    base = dict(alive=True, version=5, assigned=0, capacity=1, usd_per_token=None, latency_s=None)
    base.update(kw)
    return SamplerView(sampler_id=sid, **base)


def test_cost_aware_prefers_cheap_until_latency_bound():
    cheap = _v("cheap", usd_per_token=1e-6, latency_s=1.0, assigned=3)
    dear = _v("dear", usd_per_token=5e-6, latency_s=0.2)
    b = Bounds(trainer_version=5, max_staleness=1, max_latency_s=10.0)
    assert cost_aware([cheap, dear], b) == "cheap"  # 4 s expected <= 10 s
    b_tight = Bounds(trainer_version=5, max_staleness=1, max_latency_s=2.0)
    assert cost_aware([cheap, dear], b_tight) == "dear"
    assert least_loaded([cheap, dear], b) == "dear"


def test_unmeasured_sampler_is_explored_first():
    cheap = _v("cheap", usd_per_token=1e-6, latency_s=1.0)
    new = _v("new")
    assert cost_aware([cheap, new], Bounds(trainer_version=5, max_staleness=0)) == "new"


def test_stale_sampler_is_skipped_even_if_cheapest():
    old = _v("old", version=2, usd_per_token=1e-9, latency_s=0.1)
    cur = _v("cur", version=5, usd_per_token=1e-3, latency_s=0.1)
    b = Bounds(trainer_version=5, max_staleness=2)
    assert cost_aware([old, cur], b) == "cur"
    assert cost_aware([old], b) is None
    assert least_loaded([old, _v("dead", alive=False)], b) is None


def test_unknown_policy_is_named():
    import pytest
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'.*cost_aware, least_loaded"):
        policy_named("fastest")


# -- prompt affinity (routing.with_affinity) ------------------------------------------------

@given(views_st, bounds_st, st.sampled_from(["least_loaded", "cost_aware"]),
       st.none() | st.sampled_from([f"s{i}" for i in range(9)]))
def test_affinity_keeps_the_invariants_and_otherwise_defers_to_the_policy(views, bounds, name, remembered):
    policy = policy_named(name)
    chosen = with_affinity(policy, views, bounds, remembered)
    ok = feasible(views, bounds)
    if chosen is None:
        assert ok == []
        return
    v = next(v for v in views if v.sampler_id == chosen)  # never dead, never too stale
    assert v.alive
    assert v.version >= bounds.min_version
    assert bounds.trainer_version - v.version <= bounds.max_staleness
    takes = [w for w in ok if w.sampler_id == remembered and w.assigned < w.capacity]
    if takes:  # the remembered sampler can take it: affinity decides
        assert chosen == remembered
    else:  # dead, stale, full, unknown or none: exactly the policy's choice
        assert chosen == policy(views, bounds)

"""The fleet simulator's engine: max-min fair sharing (Hypothesis), closed forms it must
reproduce, accounting invariants of each strategy, and the codec-measured delta sizes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.simulate.engine import build_tree, fair_rates, simulate
from fleetrl.simulate.fleet import Cloud, Fleet, preset_fleet

GB = 1e9


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fair_rates_are_feasible_and_max_min(data):
    nodes = data.draw(st.integers(2, 6))
    flows = data.draw(st.integers(1, 12))
    up = np.array(data.draw(st.lists(st.floats(1, 100), min_size=nodes, max_size=nodes)))
    down = np.array(data.draw(st.lists(st.floats(1, 100), min_size=nodes, max_size=nodes)))
    src = np.array(data.draw(st.lists(st.integers(0, nodes - 1), min_size=flows, max_size=flows)))
    dst = np.array(data.draw(st.lists(st.integers(0, nodes - 1), min_size=flows, max_size=flows)))
    cap = np.array(data.draw(st.lists(st.floats(0.5, 200), min_size=flows, max_size=flows)))
    r = fair_rates(up, down, src, dst, cap)
    tol = 1e-6
    assert (r >= -tol).all() and (r <= cap * (1 + tol)).all()
    used_up = np.bincount(src, weights=r, minlength=nodes)
    used_down = np.bincount(dst, weights=r, minlength=nodes)
    assert (used_up <= up * (1 + tol) + tol).all() and (used_down <= down * (1 + tol) + tol).all()
    # max-min: every flow is at its cap or crosses a full link on which no flow runs faster
    for f in range(flows):
        if r[f] >= cap[f] * (1 - 1e-6):
            continue
        up_full = used_up[src[f]] >= up[src[f]] * (1 - 1e-6) and r[f] >= r[src == src[f]].max() * (1 - 1e-6)
        down_full = used_down[dst[f]] >= down[dst[f]] * (1 - 1e-6) and r[f] >= r[dst == dst[f]].max() * (1 - 1e-6)
        assert up_full or down_full, (f, r, cap)


def _fleet(*clouds: Cloud, **kw) -> Fleet:
    return Fleet(clouds=clouds, **kw)


def test_one_sampler_moves_at_its_bottleneck_plus_a_round_trip_per_chunk():
    c = Cloud(name="a", samplers=1, gbps=8.0, rtt_ms=0.0)
    fleet = _fleet(c, origin_gbps=100.0, local_rtt_ms=10.0, chunk_mib=64.0, apply_gbps=1e9)
    size = 10 * GB
    r = simulate(fleet, "direct", size)
    chunks = math.ceil(size / (64 << 20))
    expect = size / (8.0e9 / 8) + chunks * 0.010  # 1 GB/s, one 10 ms request per chunk
    assert r.all_s == pytest.approx(expect, rel=1e-3)
    assert r.origin_egress_gb == pytest.approx(10.0) and r.egress_gb == {} and r.breaks == 0


def test_direct_pulls_share_the_trainer_uplink():
    fleet = _fleet(Cloud(name="o", samplers=0), Cloud(name="b", samplers=40, gbps=100.0, rtt_ms=5.0),
                   origin_gbps=40.0, apply_gbps=1e9)
    r = simulate(fleet, "direct", 1 * GB)
    assert r.all_s == pytest.approx(40 * 1.0 / 5.0, rel=0.02)  # 40 GB over 5 GB/s
    assert r.egress_gb == {"o": pytest.approx(40.0)} and r.origin_egress_gb == pytest.approx(40.0)


@pytest.mark.parametrize("strategy", ["direct", "cache", "relay"])
def test_accounting_of_each_strategy(strategy):
    fleet = preset_fleet(60, 5)
    size = 2 * GB
    r = simulate(fleet, strategy, size, seed=1)
    assert r.samplers == 60 and r.p50_s <= r.p99_s <= r.all_s
    clouds_with_samplers = sum(1 for c in fleet.clouds if c.samplers)
    if strategy == "direct":
        assert r.origin_egress_gb == pytest.approx(60 * 2.0, rel=1e-6)
    else:  # one copy per cloud leaves the trainer (the cache, or the root relay)
        assert r.origin_egress_gb == pytest.approx(clouds_with_samplers * 2.0, rel=1e-6)
    # what leaves the trainer's cloud for the others is billed at its price
    out = sum(r.egress_gb.values())
    assert r.egress_usd == pytest.approx(out * fleet.clouds[0].egress_usd_per_gb, rel=1e-6)


def test_caches_beat_direct_pulls_at_scale_and_bigger_deltas_take_longer():
    fleet = preset_fleet(300, 15)
    direct, cache = simulate(fleet, "direct", 2 * GB), simulate(fleet, "cache", 2 * GB)
    assert cache.all_s < direct.all_s and cache.egress_usd < direct.egress_usd
    no_failures = Fleet(clouds=tuple(Cloud(**{**{f: getattr(c, f) for f in c.__struct_fields__},
                                              "failure_per_gb": 0.0}) for c in fleet.clouds))
    small, big = simulate(no_failures, "relay", 1 * GB), simulate(no_failures, "relay", 4 * GB)
    assert small.all_s < big.all_s


def test_breaks_resume_without_losing_bytes():
    flaky = Cloud(name="f", samplers=5, gbps=10.0, rtt_ms=20.0, failure_per_gb=0.5)
    fleet = _fleet(Cloud(name="o", samplers=0), flaky, reconnect_s=2.0)
    clean = _fleet(Cloud(name="o", samplers=0), Cloud(name="f", samplers=5, gbps=10.0, rtt_ms=20.0))
    r, r0 = simulate(fleet, "direct", 4 * GB, seed=3), simulate(clean, "direct", 4 * GB)
    assert r.breaks > 0 and r.all_s > r0.all_s
    assert r.origin_egress_gb == pytest.approx(r0.origin_egress_gb, rel=1e-6)  # resumed, not re-sent


def test_relay_tree_shape():
    fleet = preset_fleet(9, 1, relay_fanout=2)
    parent, cloud, kind = build_tree(fleet, "relay")
    assert kind.count("sampler") == 9 and parent[1] == 0  # the root relay is fed by the trainer
    assert parent[2:] == [1, 1, 2, 2, 3, 3, 4, 4]


def test_bad_fleets_are_refused():
    with pytest.raises(ValueError, match="failure_per_gb"):
        Cloud(name="x", samplers=1, failure_per_gb=1.5)
    with pytest.raises(ValueError, match="gpu"):
        Cloud(name="x", samplers=1, gpu="TPU9")
    with pytest.raises(ValueError, match="clouds must be in"):
        preset_fleet(10, 16)


def test_codec_sizes_grow_with_density():
    from fleetrl.simulate.sizes import bytes_per_param

    low, high = bytes_per_param(0.002, sample=1 << 18), bytes_per_param(0.014, sample=1 << 18)
    assert 0 < low < high < 2 * 0.014 * 2  # about 1.4 bytes per changed weight, far below bf16


def test_the_command_prints_a_table_and_one_json_line(fleetrl_bin):
    import json
    import subprocess

    out = subprocess.run([fleetrl_bin, "simulate", "--params", "1e10", "--samplers", "30", "--clouds", "3",
                          "--density", "0.01"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["strategy"] for r in last["rows"]] == ["direct", "cache", "relay"]
    assert all(r["p50_s"] <= r["p99_s"] <= r["all_s"] for r in last["rows"])
    assert "direct" in out.stdout and "density 1%" in out.stdout
    bad = subprocess.run([fleetrl_bin, "simulate", "--samplers", "20000"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--samplers must be in [1, 10000]" in bad.stderr

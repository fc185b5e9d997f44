"""The simulator against a measured fleet, reduced: two sampler hosts in network
namespaces (two followers each) pull a real delta over HTTP from the trainer's store
through link-mode fault proxies (round trips, per-host caps, one shared trainer uplink),
directly or through a real nginx cache per host (fleetrl's cache config); the simulator,
given the same topology and the measured delta size, must land within 35% of the
measured time to p50 and to all followers (the bench, bench/fleet_validate.py, holds it
to 20%). And the closed forms of what the validation added to the model: the round trips
a follower spends before its transfer, and nginx's cache lock (the first request
streams the fill, the others re-check every 500 ms)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from fleetrl.simulate.engine import simulate
from fleetrl.simulate.fleet import Cloud, Fleet

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fleet_validate.py"


def _bench():
    spec = importlib.util.spec_from_file_location("fleet_validate", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_sampler_spends_its_sync_round_trips_before_its_first_chunk_request():
    c = Cloud(name="far", samplers=1, gbps=0.008, rtt_ms=40.0)  # 1 MB/s
    base = dict(clouds=(Cloud(name="trainer", samplers=0, rtt_ms=0.0), c), origin_gbps=1.0,
                tcp_window_mib=1024.0, apply_gbps=1e9)
    for trips in (0, 2):
        r = simulate(Fleet(**base, sync_round_trips=trips), "direct", 1e6)
        assert r.all_s == pytest.approx((1 + trips) * 0.040 + 1.0, rel=1e-6)
    with pytest.raises(ValueError):
        Fleet(**base, sync_round_trips=-1)


def _behind_a_cache(**kw) -> Fleet:
    c = Cloud(name="far", samplers=2, gbps=1.0, cache_gbps=0.008, rtt_ms=40.0)  # the cache: 1 MB/s
    return Fleet(clouds=(Cloud(name="trainer", samplers=0, rtt_ms=0.0), c), origin_gbps=1.0, tcp_window_mib=1024.0,
                 apply_gbps=1e9, local_rtt_ms=1.0, **kw)


def test_behind_nginx_s_cache_lock_the_first_sampler_streams_the_fill_and_the_other_waits_for_a_poll():
    # ideal: the cache fetches 1 MB from publication (40 ms + 1 s), then serves both at once (2 MB at 1 MB/s)
    ideal = simulate(_behind_a_cache(), "cache", 1e6)
    assert ideal.p50_s == pytest.approx(ideal.all_s) and ideal.all_s == pytest.approx(0.040 + 1.0 + 0.001 + 2.0)
    # nginx: the first request (at 0.5 ms) fills the cache by 1.0405 s and streams it to its sampler ...
    r = simulate(_behind_a_cache(cache_lock_poll_s=0.5), "cache", 1e6)
    first = 2 * r.p50_s - r.all_s
    assert 1.0405 <= first <= 1.0405 + 2 * 1e6 / 256 / 1e6
    # ... the other re-checks every 500 ms from its request: it finds it whole at 1.5005 s, then 1 s alone
    assert r.all_s == pytest.approx(0.0005 + 3 * 0.5 + 0.0005 + 1.0, rel=1e-6)
    # the sync through the cache: the pointer goes to the origin (1 ms + 2 round trips of 40 ms: a new connection
    # per request), the manifest too for the first sampler (the fill starts at 2 * 81 + 0.5 + 40 + 40 ms); the
    # other sampler gets the manifest at its first re-check (82 + 500 ms), then waits 2 polls for the delta
    r = simulate(_behind_a_cache(cache_lock_poll_s=0.5, cache_origin_round_trips=2, sync_round_trips=2), "cache", 1e6)
    assert r.all_s == pytest.approx(0.582 + 0.0005 + 2 * 0.5 + 0.0005 + 1.0, rel=1e-6)
    with pytest.raises(ValueError):
        _behind_a_cache(cache_lock_poll_s=-1)
    with pytest.raises(ValueError):
        _behind_a_cache(cache_origin_round_trips=0)


@pytest.mark.slow
async def test_simulated_time_to_all_followers_is_within_35_percent_of_the_measured_one():
    import trio

    bench = _bench()
    args = argparse.Namespace(versions=1, origin_mbps=16.0, mbps=[6.0, 24.0], rtt_ms=[10.0, 60.0], per_host=2,
                              params=2e6, density=0.3, tolerance=0.35, timeout_s=60.0, seed=0)
    with trio.fail_after(90):
        (row,) = await bench.measure(args)
    sim = bench.simulated(args, row["delta_bytes"])
    assert row["delta_bytes"] > 200_000  # a transfer of a second or more, not round trips alone
    for figure in ("p50_s", "all_s"):
        assert abs(sim[figure] / row[figure] - 1) <= args.tolerance, (figure, row, sim)


@pytest.mark.slow
async def test_through_an_nginx_cache_per_host_the_simulated_times_are_within_35_percent_of_the_measured_ones():
    """nginx is not optional here: measure_cache fails when it is missing (scripts/setup.sh installs it)."""
    import trio

    bench = _bench()
    args = argparse.Namespace(versions=1, origin_mbps=16.0, mbps=[6.0, 24.0], rtt_ms=[10.0, 60.0], per_host=2,
                              params=2e6, density=0.3, tolerance=0.35, timeout_s=60.0, seed=0, local_mbps=64.0,
                              local_rtt_ms=1.0, lock_s=600)
    with trio.fail_after(90):
        (row,) = await bench.measure_cache(args)
    assert row["origin_requests"]["delta"] == 2  # one per cache: the lock collapsed the followers' misses
    sim = bench.simulated_cache(args, row["delta_bytes"])
    for figure in ("p50_s", "all_s"):
        assert abs(sim[figure] / row[figure] - 1) <= args.tolerance, (figure, row, sim)

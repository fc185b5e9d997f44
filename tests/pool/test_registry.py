"""Registry bookkeeping: busy time, cost per token, latency, mismatch reports."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.pool.registry import Registry, UnknownSampler
from fleetrl.daemon.messages import MismatchFigures, SamplerIdentity, SamplerMismatch


def _ident(sid="s"):
    return SamplerIdentity(sampler_id=sid, backend="torch", device_kind="cpu", dtype="bfloat16")


def test_cost_counts_busy_time_once_for_overlapping_requests():
    reg = Registry()
    reg.add(_ident(), price_per_hour=3600.0, capacity=2, remote=False)  # $1 per busy second
    reg.assign("s"); reg.assign("s")
    reg.started("s", 10.0); reg.started("s", 11.0)  # overlapping: busy 10..14
    reg.ended("s", 13.0, ran=True, tokens=100, latency_s=3.0)
    reg.ended("s", 14.0, ran=True, tokens=100, latency_s=3.0)
    r = reg.get("s")
    assert r.busy_s == 4.0 and r.tokens == 200 and r.assigned == 0 and r.running == 0
    assert r.usd_per_token(None) == pytest.approx(4.0 / 200)
    assert r.usd_per_1k_tokens(20.0) == pytest.approx(20.0)  # idle time is not billed to tokens
    assert r.tokens_per_s(None) == 50.0 and r.latency_s() == 3.0
    reg.started("s", 30.0)  # a running request counts up to now
    assert r.busy_total(31.0) == 5.0


def test_failed_and_unstarted_requests_are_not_measured():
    reg = Registry()
    reg.add(_ident(), price_per_hour=1.0, capacity=1, remote=True)
    reg.assign("s")
    reg.ended("s", 5.0, ran=False, failed=True)
    r = reg.get("s")
    assert (r.assigned, r.failures, r.requests, r.usd_per_token(5.0)) == (0, 1, 0, None)
    assert reg.views(5.0)[0].usd_per_token is None


def test_a_request_of_a_replaced_registration_leaves_the_new_one_alone():
    # a local sampler restarted under the same id while an old request was in flight:
    # the old request's start and end belong to the old record, never to the new one
    reg = Registry()
    reg.add(_ident(), price_per_hour=3600.0, capacity=2, remote=False)
    old = reg.assign("s")
    mark = reg.started("s", 1.0, record=old)
    new = reg.add(_ident(), price_per_hour=3600.0, capacity=2, remote=False, now=2.0)
    assert reg.started("s", 2.5, record=old) == 0.0  # a late start of the old request
    ticket = reg.assign("s")
    assert ticket is new and new.assigned == 1
    assert reg.ended("s", 3.0, ran=True, tokens=7, latency_s=2.0, mark=mark, record=old) == 0.0
    assert (new.assigned, new.running, new.tokens, new.requests, new.busy_s) == (1, 0, 0, 0, 0.0)
    m = reg.started("s", 4.0, record=ticket)
    assert reg.ended("s", 6.0, ran=True, tokens=5, latency_s=2.0, mark=m, record=ticket) == pytest.approx(2.0)
    assert (new.assigned, new.running, new.tokens, new.requests, new.busy_s) == (0, 0, 5, 1, 2.0)
    reg.remove("s")
    assert reg.ended("s", 7.0, ran=False, record=ticket) == 0.0  # gone: nothing to count


def test_versions_liveness_and_mismatch():
    reg = Registry()
    reg.add(_ident("a"), price_per_hour=1.0, capacity=1, remote=False, version=3)
    reg.add(_ident("b"), price_per_hour=1.0, capacity=1, remote=False, version=5)
    assert reg.oldest_live_version() == 3
    reg.mark_dead("a")
    assert reg.oldest_live_version() == 5
    reg.set_version("b", 6, "d6", now=1.0)
    assert reg.views(1.0)[1].version == 6
    reg.report_mismatch("torch", "cpu", "bfloat16", 1e-4)
    assert reg.mismatch_kl == {("torch", "cpu", "bfloat16"): 1e-4}
    with pytest.raises(ValueError, match="mismatch KL must be >= 0"):
        reg.report_mismatch("torch", "cpu", "fp8", -1.0)
    with pytest.raises(UnknownSampler):
        reg.get("zz")
    with pytest.raises(ValueError, match="sampler 'c': capacity must be >= 1"):
        reg.add(_ident("c"), price_per_hour=1.0, capacity=0, remote=False)


def test_each_request_is_charged_its_share_of_the_busy_time():
    reg = Registry()
    reg.add(_ident(), price_per_hour=3600.0, capacity=2, remote=False)
    reg.assign("s"); reg.assign("s")
    a = reg.started("s", 0.0)
    b = reg.started("s", 5.0)  # 5..10: two running, each second split in half
    charged_a = reg.ended("s", 10.0, ran=True, tokens=10, latency_s=10.0, mark=a)
    reg.assign("s")
    c = reg.started("s", 10.0)  # 10..12 shared by b and c
    charged_b = reg.ended("s", 12.0, ran=True, tokens=10, latency_s=7.0, mark=b)
    charged_c = reg.ended("s", 20.0, ran=True, tokens=10, latency_s=10.0, mark=c)
    assert (charged_a, charged_b, charged_c) == (7.5, 3.5, 9.0)
    assert reg.get("s").busy_s == 20.0 == charged_a + charged_b + charged_c
    assert reg.ended("nobody", 1.0, ran=True) == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20)), min_size=1, max_size=12))
def test_charges_add_up_to_the_busy_time(intervals):
    """Whatever the overlap, the requests' charges sum to the sampler's busy seconds."""
    reg = Registry()
    reg.add(_ident(), price_per_hour=1.0, capacity=len(intervals), remote=False)
    events = sorted([(s, 1, i) for i, (s, _) in enumerate(intervals)] +
                    [(s + d, 0, i) for i, (s, d) in enumerate(intervals)])  # ends before starts at a tie
    marks, charged = {}, {}
    for t, kind, i in events:
        if kind:
            reg.assign("s")
            marks[i] = reg.started("s", float(t))
        else:
            charged[i] = reg.ended("s", float(t), ran=True, tokens=1, latency_s=1.0, mark=marks[i])
    assert sum(charged.values()) == pytest.approx(reg.get("s").busy_s)
    assert all(0 < charged[i] <= d + 1e-9 for i, (_, d) in enumerate(intervals))


def _fig(tokens: int, kl: float, out: float = 0.0) -> MismatchFigures:
    return MismatchFigures(tokens=tokens, kl_k3=kl, frac_out_of_band=out, log_ratio_mean=0.0, log_ratio_std=0.1,
                           log_ratio_max_abs=0.3)


def _who(sid: str, dtype: str, device: str = "cpu") -> SamplerIdentity:
    return SamplerIdentity(sampler_id=sid, backend="torch", device_kind=device, dtype=dtype)


def _report(version: int, *entries: tuple[SamplerIdentity, MismatchFigures]) -> SamplerMismatch:
    return SamplerMismatch(step=version, version=version, mask_low=0.5, mask_high=5.0,
                           by_kind={}, by_sampler=tuple(entries))


def test_the_trainers_measurements_feed_the_pools_mismatch_gauge():
    """`SamplerPool.record_mismatch` keeps each sampler's figures on its record and the
    token-weighted k3 KL of each (backend, device kind, dtype), which the pool's
    ``fleetrl_sampler_mismatch_kl`` gauge exports."""
    from prometheus_client import CollectorRegistry, generate_latest

    from fleetrl.actors.pool import SamplerPool
    from fleetrl.actors.pool.metrics import PoolMetrics

    pool = SamplerPool()
    for ident in (_who("a", "bfloat16"), _who("b", "bfloat16"), _who("h", "bfloat16", "H100")):
        pool.registry.add(ident, price_per_hour=0.0, capacity=1, remote=False)
    pool.record_mismatch(_report(3, (_who("a", "bfloat16"), _fig(100, 0.01, 0.1)),
                                 (_who("b", "bfloat16"), _fig(300, 0.05)),
                                 (_who("h", "bfloat16", "H100"), _fig(10, 0.2)),
                                 (_who("gone", "float32"), _fig(5, 1e-9))))  # left the fleet since
    kl = pool.registry.mismatch_kl
    assert kl[("torch", "cpu", "bfloat16")] == pytest.approx((100 * 0.01 + 300 * 0.05) / 400)
    assert kl[("torch", "H100", "bfloat16")] == 0.2 and kl[("torch", "cpu", "float32")] == 1e-9
    a = pool.registry.get("a")
    assert a.mismatch == _fig(100, 0.01, 0.1) and a.mismatch_version == 3
    assert "gone" not in pool.registry and pool.statistics().mismatch_reports == 1
    # an older report arriving late overwrites neither a sampler's newer figures nor its kind's
    pool.record_mismatch(_report(5, (_who("a", "bfloat16"), _fig(7, 0.5))))
    pool.record_mismatch(_report(4, (_who("a", "bfloat16"), _fig(9, 0.9))))
    assert a.mismatch == _fig(7, 0.5) and a.mismatch_version == 5
    prom = CollectorRegistry()
    prom.register(PoolMetrics(pool, "pool"))
    text = generate_latest(prom).decode()
    assert 'fleetrl_sampler_mismatch_kl{actor="pool",backend="torch",device="H100",dtype="bfloat16"} 0.2' in text
    assert 'fleetrl_sampler_mismatch_kl{actor="pool",backend="torch",device="cpu",dtype="bfloat16"} 0.5' in text

"""The pool core with real torch backends: routing, staleness waits, and failover."""

from __future__ import annotations

import trio

from fleetrl.actors.pool.local import LocalSampler
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.daemon import messages as m

from .conftest import ScriptedBackend, request
from .conftest import TimedDevice as _TimedDevice
from .conftest import serve_all


def _torch(model_dir, dtype="fp32"):
    return TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype=dtype))


def _add(pool, sid, backend, *, price=1.0, capacity=1):
    s = LocalSampler(sid, backend, capacity=capacity)
    v = backend.weight_version
    pool.add(s, s.identity, price_per_hour=price, capacity=capacity, remote=False,
             version=v.version, digest=v.digest)
    return s


_serve_all = serve_all


async def test_requests_are_spread_and_answered(model_dir):
    pool = SamplerPool(policy="least_loaded")
    _add(pool, "a", _torch(model_dir))
    _add(pool, "b", _torch(model_dir, "bf16"))
    with trio.fail_after(120):
        out = await _serve_all(pool, [request(i) for i in range(6)])
    assert sorted(out) == [f"r{i}" for i in range(6)]
    assert all(isinstance(g, m.Generation) for g in out.values())
    used = {g.sampler.sampler_id for g in out.values()}
    assert used == {"a", "b"}
    assert {g.sampler.dtype for g in out.values()} == {"float32", "bfloat16"}
    rec = pool.registry.get("a")
    assert rec.tokens > 0 and rec.assigned == 0 and rec.requests >= 1
    assert rec.usd_per_1k_tokens(trio.current_time()) > 0


async def test_hung_sampler_is_taken_out_rerouted_and_restarted(model_dir):
    pool = SamplerPool(request_timeout_s=3.0)
    _add(pool, "good", _torch(model_dir))
    built = []

    def factory():  # first incarnation hangs, the restarted one works
        b = ScriptedBackend(_torch(model_dir), mode="hang" if not built else "ok")
        built.append(b)
        return b

    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            n.start_soon(lambda: pool.keep_local("flaky", factory, price_per_hour=1.0, capacity=2,
                                                 restart_backoff_s=0.1))
            while "flaky" not in pool.handles:
                await trio.sleep(0.01)
            out = await _serve_all(pool, [request(i) for i in range(6)])
            while len(built) < 2 or "flaky" not in pool.handles:
                await trio.sleep(0.05)  # the restart
            again = await pool.generate(request(99))
            n.cancel_scope.cancel()
    built[0].release.set()
    assert all(isinstance(g, m.Generation) for g in out.values()), out
    assert len(out) == 6
    assert built[0].calls >= 1  # it did take requests, which were re-routed
    assert pool.rerouted >= 1
    restarted = pool.statistics().restarted
    assert restarted["flaky"].get("deadline", 0) >= 1 and "good" not in restarted  # counted by cause
    assert isinstance(again, m.Generation)
    assert pool.registry.get("flaky").alive


async def test_crashing_sampler_fails_over(model_dir):
    pool = SamplerPool()
    _add(pool, "crashy", ScriptedBackend(_torch(model_dir), mode="crash"))
    _add(pool, "good", _torch(model_dir))
    with trio.fail_after(120):
        out = await _serve_all(pool, [request(i) for i in range(4)])
    assert all(g.sampler.sampler_id == "good" for g in out.values())
    assert not pool.registry.get("crashy").alive
    assert "crashy" not in pool.handles


async def test_bad_request_is_answered_not_retried(model_dir):
    pool = SamplerPool()
    _add(pool, "a", _torch(model_dir))
    with trio.fail_after(60):
        res = await pool.generate(request(1, prompt=[10**6]))
    assert isinstance(res, m.GenerateFailed) and not res.retryable
    assert "prompts[0][0] = 1000000" in res.reason
    assert pool.registry.get("a").alive


async def test_every_sampler_broken_gives_a_failure_after_max_tries(model_dir):
    pool = SamplerPool(max_tries=2)
    _add(pool, "x", ScriptedBackend(_torch(model_dir), mode="crash"))
    _add(pool, "y", ScriptedBackend(_torch(model_dir), mode="crash"))
    with trio.fail_after(60):
        res = await pool.generate(request(1))
    assert isinstance(res, m.GenerateFailed) and res.retryable
    assert "failed on 2 samplers" in res.reason and "device lost" in res.reason


async def test_stale_samplers_get_nothing_until_they_catch_up(model_dir):
    pool = SamplerPool(max_staleness=2, trainer_version=0)
    _add(pool, "a", _torch(model_dir))  # version 0
    pool.set_trainer_version(3)  # a is 3 behind
    got = []
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            async def ask():
                got.append(await pool.generate(request(1)))
            n.start_soon(ask)
            await trio.sleep(0.3)
            assert got == [] and pool.registry.get("a").assigned == 0
            pool.set_sampler_version("a", 1, "d1")  # within the bound now
    assert isinstance(got[0], m.Generation)


async def test_health_check_takes_out_a_sick_sampler(model_dir):
    pool = SamplerPool()
    sick = ScriptedBackend(_torch(model_dir), mode="sick")
    _add(pool, "sick", sick)
    _add(pool, "well", _torch(model_dir))
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            n.start_soon(pool.health_loop, 0.05)
            await pool.wait_dead("sick")
            n.cancel_scope.cancel()
    assert "well" in pool.handles and "sick" not in pool.handles


async def test_admission_waits_for_the_fleet(model_dir):
    pool = SamplerPool(max_staleness=0, attempts_per_step=1)
    _add(pool, "a", _torch(model_dir))
    with trio.fail_after(30):
        first = await pool.admit("t0")
        assert first.train_version == 0
        admitted = []
        async with trio.open_nursery() as n:
            async def second():
                admitted.append(await pool.admit("t1"))
            n.start_soon(second)
            await trio.sleep(0.2)
            assert admitted == []  # t1 would be trained at version 1 from version-0 weights
            pool.set_trainer_version(1)
            pool.set_sampler_version("a", 1, "d1")
    assert admitted[0].train_version == 1


async def test_each_generation_carries_its_cost(autojump_clock):
    pool = SamplerPool(policy="least_loaded")
    dear = _TimedDevice("dear", seconds=2.0, capacity=2)
    free = _TimedDevice("free", seconds=2.0, capacity=1)
    pool.add(dear, dear.identity, price_per_hour=3600.0, capacity=2, remote=False)  # $1 per busy second
    pool.add(free, free.identity, price_per_hour=0.0, capacity=1, remote=False)
    alone = await pool.generate(request(0))
    assert (alone.sampler.sampler_id, alone.cost_usd) == ("dear", 2.0)  # 2 s alone on it
    out = await _serve_all(pool, [request(i) for i in range(1, 4)])  # dear runs two at once
    by = {g.request_id: (g.sampler.sampler_id, g.cost_usd) for g in out.values()}
    assert sorted(by.values()) == [("dear", 1.0), ("dear", 1.0), ("free", 0.0)]  # shared seconds split
    rec = pool.registry.get("dear")
    assert rec.busy_s == 4.0 == alone.cost_usd + sum(c for s, c in by.values() if s == "dear")


async def test_a_request_a_weight_switch_restarts_is_counted_per_sampler_with_its_cause(model_dir):
    """The pool believes "old" holds version 2 (its last report); it holds 0 (it fell back to
    an older anchor), so it refuses a request needing version 2 with cause weight_version.
    Each such restart is counted against "old" (statistics and /metrics); once "new" joins
    at version 2 the request is answered there."""
    from prometheus_client import CollectorRegistry, generate_latest

    from fleetrl.actors.pool.metrics import PoolMetrics
    from fleetrl.actors.samplers import WeightVersion

    pool = SamplerPool(trainer_version=2, max_tries=3)
    old = LocalSampler("old", _torch(model_dir), capacity=1)
    pool.add(old, old.identity, price_per_hour=0.0, capacity=1, remote=False, version=2, digest="d2")
    with trio.fail_after(120):
        res = await pool.generate(request(1, min_version=2))
        assert isinstance(res, m.GenerateFailed) and "min_version 2" in res.reason
        assert pool.statistics().restarted == {"old": {"weight_version": 3}}
        _add(pool, "new", TorchBackend(TorchBackendConfig(model_dir=str(model_dir)), version=WeightVersion(2, "d2")))
        res = await pool.generate(request(2, min_version=2))
    assert isinstance(res, m.Generation) and res.sampler.sampler_id == "new"
    assert res.sampling == m.SamplingRecord(temperature=1.0, top_p=1.0, top_k=512, seed=2)  # the cap it applied
    stats = pool.statistics()
    assert stats.restarted["old"]["weight_version"] >= 3 and "new" not in stats.restarted
    assert stats.discarded_tokens == {}  # nothing had been streamed
    reg = CollectorRegistry()
    reg.register(PoolMetrics(pool, "pool"))
    text = generate_latest(reg).decode()
    assert 'fleetrl_sampler_requests_restarted_total{actor="pool",cause="weight_version",sampler="old"}' in text

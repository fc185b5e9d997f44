"""Prompt affinity: a GRPO group's requests (same prompt token ids) go to one sampler, and
so into one batch. The pure choice and table (actors/pool/routing.py), then the real
`SamplerPool`: with real torch backends behind batching `LocalSampler`s, and with
in-memory timed devices on Trio's virtual clock for deaths, full and stale samplers,
and cancellation."""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.actors.model import BOS_ID
from fleetrl.actors.pool.local import LocalSampler
from fleetrl.actors.pool import PoolConfig, SamplerPool
from fleetrl.actors.pool.routing import (AffinityTable, Bounds, SamplerView, cost_aware, least_loaded,
                                         prompt_key, with_affinity)
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor

from .conftest import TimedDevice as Device
from .conftest import running_pool, serve_all

# -- the pure choice --------------------------------------------------------------------------

B = Bounds(trainer_version=5, max_staleness=1)


def _v(sid: str, **kw) -> SamplerView:
    base = dict(alive=True, version=5, assigned=0, capacity=4, usd_per_token=None, latency_s=None)
    base.update(kw)
    return SamplerView(sampler_id=sid, **base)


def test_the_remembered_sampler_takes_the_request_over_the_policy():
    views = [_v("a", assigned=3), _v("b"), _v("c", assigned=1)]
    assert least_loaded(views, B) == "b"
    assert with_affinity(least_loaded, views, B, "a") == "a"
    assert with_affinity(least_loaded, views, B, "c") == "c"
    priced = [_v("cheap", usd_per_token=1e-6, latency_s=1.0), _v("dear", usd_per_token=1e-5, latency_s=1.0,
                                                                  assigned=2)]
    assert cost_aware(priced, B) == "cheap"
    assert with_affinity(cost_aware, priced, B, "dear") == "dear"


@pytest.mark.parametrize("remembered, bounds", [
    (_v("a", alive=False), B),                                                  # dead
    (_v("a", version=3), B),                                                    # too far behind the trainer
    (_v("a", version=5), Bounds(trainer_version=5, max_staleness=1, min_version=6)),  # older than min_version
    (_v("a", assigned=4, capacity=4), B),                                      # no free slot
    (_v("a", assigned=9, capacity=4), B),                                      # over-full
], ids=["dead", "stale", "min_version", "full", "over-full"])
def test_an_unfit_remembered_sampler_falls_back_to_the_policy(remembered, bounds):
    views = [remembered, _v("b", version=6, assigned=2), _v("c", version=6, assigned=1)]
    assert with_affinity(least_loaded, views, bounds, "a") == least_loaded(views, bounds) == "c"


def test_no_memory_or_an_unknown_sampler_is_the_policy():
    views = [_v("a", assigned=1), _v("b")]
    assert with_affinity(least_loaded, views, B, None) == "b"
    assert with_affinity(least_loaded, views, B, "gone") == "b"
    assert with_affinity(least_loaded, [_v("a", alive=False)], B, "a") is None


def test_prompt_key_is_the_token_ids_only():
    ids = np.asarray([BOS_ID, 5, 6, 7], dtype=np.int64)
    t = Tensor.from_numpy(ids)
    assert prompt_key(t.dtype, t.data) == prompt_key("int64", ids.tobytes())
    assert len(prompt_key(t.dtype, t.data)) == 16
    assert prompt_key("int64", ids.tobytes()) != prompt_key("int64", ids[:-1].tobytes())
    assert prompt_key("int64", ids.tobytes()) != prompt_key("int32", ids.tobytes())  # another dtype, other ids


# -- the table --------------------------------------------------------------------------------

KEYS = [prompt_key("int64", bytes([k]) * 8) for k in range(4)]
ops_st = st.lists(st.one_of(
    st.tuples(st.just("route"), st.integers(0, 3), st.sampled_from("abc")),
    st.tuples(st.just("end"), st.integers(0, 100)),
    st.tuples(st.just("forget"), st.sampled_from("abc")),
), max_size=80)


@given(ops_st)
def test_table_remembers_while_requests_are_outstanding_and_then_forgets(ops):
    table = AffinityTable()
    live: list[bytes] = []  # one key per outstanding request
    memory: dict[bytes, str | None] = {}
    for op in ops:
        if op[0] == "route":
            key = KEYS[op[1]]
            table.routed(key, op[2])
            live.append(key)
            memory[key] = op[2]  # the memory moves with every choice
        elif op[0] == "end":
            if not live:
                continue
            key = live.pop(op[1] % len(live))
            table.ended(key)
            if key not in live:
                del memory[key]
        else:
            table.forget_sampler(op[1])
            memory = {k: (None if s == op[1] else s) for k, s in memory.items()}
        assert len(table) == len(set(live)) <= len(live)  # never more entries than outstanding requests
        for key in KEYS:
            assert table.outstanding(key) == live.count(key)
            assert table.sampler_for(key) == memory.get(key)
    for key in list(live):
        table.ended(key)
    assert len(table) == 0


def test_ending_a_request_that_was_never_routed_is_an_error():
    table = AffinityTable()
    with pytest.raises(KeyError, match="no outstanding request with prompt key " + KEYS[0].hex()):
        table.ended(KEYS[0])


# -- the pool with real torch backends behind batching local samplers ---------------------------


class Recorder:
    """A real torch backend that records the prompts of each backend call."""

    def __init__(self, inner: TorchBackend) -> None:
        self.inner = inner
        self.calls: list[list[tuple[int, ...]]] = []

    identity = property(lambda self: self.inner.identity)
    weight_version = property(lambda self: self.inner.weight_version)

    def generate(self, prompts, params):
        self.calls.append([tuple(p) for p in prompts])
        return self.inner.generate(prompts, params)

    def health(self):
        return self.inner.health()


@pytest.fixture(scope="module")
def torch_backends(model_dir):
    return [TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="fp32")) for _ in range(3)]


def _group_prompt(g: int) -> list[int]:
    return [BOS_ID, *f"def task_{g}(x):\n    return x + {g}".encode()][: 8 + 3 * g]


def _group_request(g: int, i: int, *, max_tokens: int = 4) -> m.GenerateRequest:
    # unseeded, as a group's attempts are: seeded requests would each run alone
    return m.GenerateRequest(request_id=f"g{g}-r{i}", attempt_id=f"g{g}-a{i}",
                             prompt_ids=Tensor.from_numpy(np.asarray(_group_prompt(g), dtype=np.int64)),
                             params=m.SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95))


_serve = serve_all


@pytest.mark.parametrize("affinity", [True, False])
async def test_each_group_goes_to_one_sampler_and_one_batch(torch_backends, affinity):
    """3 samplers, 4 groups of 8 concurrent requests (4 prompts): with affinity each group
    is answered by one sampler, in one backend call; without it least-loaded spreads them."""
    pool = SamplerPool(policy="least_loaded", affinity=affinity)
    recorders = {}
    for sid, backend in zip("abc", torch_backends, strict=True):
        rec = recorders[sid] = Recorder(backend)
        s = LocalSampler(sid, rec, capacity=64)
        pool.add(s, s.identity, price_per_hour=1.0, capacity=64, remote=False,
                 version=backend.weight_version.version, digest=backend.weight_version.digest)
    reqs = [_group_request(g, i) for g in range(4) for i in range(8)]
    with trio.fail_after(180):
        out = await _serve(pool, reqs)
    assert sorted(out) == sorted(r.request_id for r in reqs)
    assert all(isinstance(a, m.Generation) and a.token_ids.shape[0] == 4 for a in out.values()), out
    served = {g: Counter(out[f"g{g}-r{i}"].sampler.sampler_id for i in range(8)) for g in range(4)}
    assert {s for c in served.values() for s in c} == {"a", "b", "c"}  # all samplers worked either way
    if affinity:
        assert all(len(c) == 1 for c in served.values()), served
        for g in range(4):
            [sid] = served[g]
            prompt = tuple(_group_prompt(g))
            holding = [call for call in recorders[sid].calls if prompt in call]
            assert len(holding) == 1 and holding[0].count(prompt) == 8, recorders[sid].calls  # one batch
        assert len(pool.affinity) == 0  # nothing remembered once every request ended
    else:
        assert pool.affinity is None
        assert all(len(c) >= 2 for c in served.values()), served
    assert all(pool.registry.get(sid).assigned == 0 for sid in "abc")


# -- the pool with timed in-memory devices (virtual clock) -------------------------------------


def _fleet(ids: str = "abc", *, capacity: int = 8, affinity: bool = True, **kw) -> tuple[SamplerPool, dict]:
    pool = SamplerPool(policy="least_loaded", affinity=affinity, **kw)
    devices = {}
    for sid in ids:
        d = devices[sid] = Device(sid, capacity=capacity)
        pool.add(d, d.identity, price_per_hour=1.0, capacity=capacity, remote=False)
    return pool, devices


def _idle(pool: SamplerPool) -> bool:
    return all(r.assigned == 0 and r.running == 0 for r in pool.registry.records())


async def test_a_sampler_lost_mid_group_sends_the_rest_elsewhere(autojump_clock):
    pool, devices = _fleet()
    out: dict[str, object] = {}

    async def ask(i):
        out[f"g0-r{i}"] = await pool.generate(_group_request(0, i))

    async with trio.open_nursery() as n:
        for i in range(4):
            n.start_soon(ask, i)
        await trio.sleep(1.0)  # four in flight on one sampler
        assert [pool.registry.get(s).assigned for s in "abc"] == [4, 0, 0]
        key = prompt_key("int64", np.asarray(_group_prompt(0), np.int64).tobytes())
        assert pool.affinity.outstanding(key) == 4 and pool.affinity.sampler_for(key) == "a"
        pool.mark_dead("a", "test: lost mid-group")
        assert pool.affinity.sampler_for(key) is None  # no memory leads back to it
        for i in range(4, 8):  # the group's remaining attempts start after the loss
            n.start_soon(ask, i)
    assert sorted(out) == [f"g0-r{i}" for i in range(8)]
    assert all(isinstance(a, m.Generation) for a in out.values()), out
    by = Counter(a.sampler.sampler_id for a in out.values())
    assert "a" not in by and devices["a"].answered == []  # never back to the dead sampler
    assert by == {"b": 8}  # the re-routed four chose b, and the group followed them there
    assert pool.rerouted == 4
    assert len(pool.affinity) == 0 and _idle(pool)


async def test_a_full_sampler_passes_the_group_on(autojump_clock):
    pool, devices = _fleet(capacity=2)
    out = await _serve(pool, [_group_request(0, i) for i in range(5)])
    assert all(isinstance(a, m.Generation) for a in out.values())
    # a fills (2), then least-loaded picks b and the memory moves there (2), then c
    assert Counter(a.sampler.sampler_id for a in out.values()) == {"a": 2, "b": 2, "c": 1}
    assert len(pool.affinity) == 0 and _idle(pool)


async def test_a_sampler_too_stale_for_the_request_passes_the_group_on(autojump_clock):
    pool, devices = _fleet("ab", max_staleness=1)
    out: dict[str, object] = {}

    async def ask(i):
        out[i] = await pool.generate(_group_request(0, i))

    async with trio.open_nursery() as n:
        n.start_soon(ask, 0)
        await trio.sleep(1.0)
        n.start_soon(ask, 1)
        await trio.sleep(1.0)
        assert pool.registry.get("a").assigned == 2  # both on a
        pool.set_sampler_version("b", 2, "d2")
        pool.set_trainer_version(2)  # a (version 0) is now too far behind
        n.start_soon(ask, 2)
    assert [out[i].sampler.sampler_id for i in range(3)] == ["a", "a", "b"]
    assert len(pool.affinity) == 0 and _idle(pool)


async def test_cancelled_requests_leave_no_memory_and_no_load(autojump_clock):
    pool, devices = _fleet()
    with trio.move_on_after(2.0):  # the caller gives up while all are in flight
        await _serve(pool, [_group_request(g, i) for g in range(2) for i in range(3)])
    assert len(pool.affinity) == 0
    assert _idle(pool)  # routing sees no phantom load after cancellation
    again = await pool.generate(_group_request(1, 0))
    assert isinstance(again, m.Generation) and again.sampler.sampler_id == "a"  # least-loaded, ties by id


async def test_affinity_ignores_sampling_params_and_different_prompts_spread(autojump_clock):
    pool, devices = _fleet()
    reqs = [msgspec.structs.replace(_group_request(0, i), params=m.SamplingParams(max_tokens=3 + i))
            for i in range(3)] + [_group_request(1, 0), _group_request(2, 0)]
    out = await _serve(pool, reqs)
    [g0] = {out[f"g0-r{i}"].sampler.sampler_id for i in range(3)}  # one sampler, whatever the params
    # each new prompt finds an idle sampler (in whatever order Trio runs the requests)
    assert sorted([g0, out["g1-r0"].sampler.sampler_id, out["g2-r0"].sampler.sampler_id]) == ["a", "b", "c"]


# -- configuration ----------------------------------------------------------------------------


def test_affinity_is_on_by_default_and_can_be_turned_off():
    assert PoolConfig().affinity is True
    assert msgspec.convert({"affinity": False}, PoolConfig).affinity is False
    with pytest.raises(msgspec.ValidationError, match=r"Expected `bool`, got `str` - at `\$.affinity`"):
        msgspec.convert({"affinity": "sometimes"}, PoolConfig)
    assert SamplerPool().affinity is not None and SamplerPool(affinity=False).affinity is None


@pytest.mark.parametrize("setting", [True, False])
async def test_the_pool_actor_takes_affinity_from_its_config(tmp_path, setting):
    async with running_pool(tmp_path, f"join = false\naffinity = {str(setting).lower()}", timeout_s=60) as (pool, *_):
        assert (pool.affinity is not None) is setting

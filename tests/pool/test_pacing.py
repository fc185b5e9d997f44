"""Staleness pacing: the bound holds against a slow trainer and nothing finished is dropped.

The simulations run the wired path: attempts through `SamplerPool.attempt`, model calls
through `SamplerPool.generate` (routing keeps requests off too-stale samplers), the
trainer consuming `SamplerPool.released`; the bound is checked on the versions the
generated tokens actually carry."""

from __future__ import annotations

import random

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.pool.pacing import Pacer, PacingError
from fleetrl.actors.pool import SamplerPool
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor


class _FleetDevice:
    """An in-memory fake device behind the pool's handle interface: each request takes a
    random time and its tokens carry the weight version the device held when it began."""

    def __init__(self, sampler_id: str, rng: random.Random) -> None:
        self.sampler_id = sampler_id
        self.rng = rng
        self.version = 0
        self.identity = m.SamplerIdentity(sampler_id=sampler_id, backend="fake", device_kind="cpu",
                                          dtype="bfloat16")

    async def generate(self, request: m.GenerateRequest, started) -> m.Generation:
        started()
        version = self.version
        await trio.sleep(self.rng.uniform(0.05, 1.5))
        n = request.params.max_tokens
        ids = np.arange(n, dtype=np.int64)
        zeros = Tensor.from_numpy(np.zeros(n, np.float32))
        return m.Generation(request_id=request.request_id, token_ids=Tensor.from_numpy(ids), logprobs=zeros,
                            support=m.SupportCSR(ids=Tensor.from_numpy(ids), logprobs=zeros,
                                                 offsets=Tensor.from_numpy(np.arange(n + 1, dtype=np.int64))),
                            versions=Tensor.from_numpy(np.full(n, version, np.int64)), sampler=self.identity,
                            finish_reason="length")

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass


async def _simulate(*, max_staleness: int, per_step: int, n_workers: int, attempts: int,
                    train_s: float, seed: int, lags: tuple[float, ...] = (0.3, 2.5)) -> dict:
    """Eager workers run attempts through `SamplerPool.attempt` (each makes a few model
    calls through `SamplerPool.generate`, ~10 % fail); a deliberately slow trainer takes
    the pool's releases `per_step` successful attempts per version; each sampler picks up
    a new version its own lag after it is published."""
    rng = random.Random(seed)
    pool = SamplerPool(max_staleness=max_staleness, attempts_per_step=per_step)
    devices = [_FleetDevice(f"s{i}", rng) for i in range(len(lags))]
    for d in devices:
        pool.add(d, d.identity, price_per_hour=1.0, capacity=2, remote=False)
    state = {"trained": [], "failed": 0, "succeeded": 0, "admitted": 0}
    numbers = iter(range(attempts))

    async def worker() -> None:
        for i in numbers:
            try:
                async with pool.attempt(f"a{i}") as att:
                    state["admitted"] += 1
                    oldest = None
                    for call in range(rng.randint(1, 3)):
                        req = m.GenerateRequest(request_id=f"a{i}-{call}", attempt_id=f"a{i}",
                                                prompt_ids=Tensor.from_numpy(np.array([1, 2], np.int64)),
                                                params=m.SamplingParams(max_tokens=3))
                        g = await pool.generate(req)
                        assert isinstance(g, m.Generation)
                        v = int(g.versions.to_numpy().min())
                        oldest = v if oldest is None else min(oldest, v)
                    await trio.sleep(rng.uniform(0.0, 2.0))  # scoring; attempts end out of order
                    if rng.random() < 0.1:
                        raise RuntimeError("sandbox broke")
                    att.result = oldest
                state["succeeded"] += 1
            except RuntimeError:
                state["failed"] += 1

    async def follow(device: _FleetDevice, version: int, lag: float) -> None:
        await trio.sleep(lag)
        if version > device.version:
            device.version = version
            pool.set_sampler_version(device.sampler_id, version, f"d{version}")

    async def trainer(nursery: trio.Nursery) -> None:
        batch: list = []
        while len(state["trained"]) + state["failed"] < attempts:
            for adm, oldest, failed in await pool.released():
                if not failed:
                    batch.append((adm, oldest))
            while len(batch) >= per_step or (batch and len(state["trained"]) + len(batch) + state["failed"]
                                              == attempts):
                step, batch = batch[:per_step], batch[per_step:]
                for adm, oldest in step:
                    state["trained"].append((pool.trainer_version, adm, oldest))
                await trio.sleep(train_s)  # deliberately slow
                pool.set_trainer_version(pool.trainer_version + 1)
                for d, lag in zip(devices, lags):
                    nursery.start_soon(follow, d, pool.trainer_version, lag)

    with trio.fail_after(100_000):
        async with trio.open_nursery() as n:
            n.start_soon(trainer, n)
            async with trio.open_nursery() as workers:
                for _ in range(n_workers):
                    workers.start_soon(worker)
            while len(state["trained"]) + state["failed"] < attempts:
                await trio.sleep(1)
            n.cancel_scope.cancel()
    state["pacer"] = pool.pacer
    return state


async def test_slow_trainer_bound_holds_and_nothing_dropped(autojump_clock):
    s = await _simulate(max_staleness=2, per_step=4, n_workers=16, attempts=80, train_s=20.0, seed=1)
    trained = s["trained"]
    assert s["failed"] > 0 and s["succeeded"] == len(trained)  # every finished attempt is trained...
    assert len({adm.attempt_id for _, adm, _ in trained}) == len(trained)  # ...once
    assert s["admitted"] == 80 and s["pacer"].in_flight == 0 and s["pacer"].waiting == 0
    for version, adm, oldest in trained:
        assert version - oldest <= 2, (adm, version, oldest)  # the tokens it really carries
        assert version <= adm.train_version  # failures only make attempts train sooner
    # the bound actually paced sampling: the trainer reached the edge of it
    assert max(v - o for v, _, o in trained) == 2


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 3), st.integers(1, 5), st.integers(1, 12), st.integers(0, 10_000))
def test_bound_holds_for_any_setting(max_staleness, per_step, workers, seed):
    async def main():
        n = 3 * per_step * (max_staleness + 1)
        s = await _simulate(max_staleness=max_staleness, per_step=per_step, n_workers=workers,
                            attempts=n, train_s=7.0, seed=seed)
        assert len(s["trained"]) + s["failed"] == n
        for version, _, oldest in s["trained"]:
            assert version - oldest <= max_staleness

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_release_is_in_admission_order_and_keeps_results():
    p = Pacer(max_staleness=1, attempts_per_step=2)
    a = p.try_admit("a", 0)
    b = p.try_admit("b", 0)
    assert (a.train_version, b.train_version) == (0, 0)
    p.finish("b", "B")
    assert p.take_ready() == []  # b waits for a
    assert p.waiting == 1 and p.in_flight == 1
    p.finish("a", None, failed=True)
    out = p.take_ready()
    assert [(x.attempt_id, r, f) for x, r, f in out] == [("a", None, True), ("b", "B", False)]


def test_admission_refused_beyond_the_bound():
    p = Pacer(max_staleness=1, attempts_per_step=2)
    for i in range(4):  # tickets 0..3 train at versions 0, 0, 1, 1
        assert p.try_admit(f"x{i}", 0) is not None
    assert p.try_admit("x4", 0) is None  # would train at version 2 from version-0 weights
    assert p.try_admit("x4", 1) is not None  # fine once the fleet holds version 1


def test_misuse_is_named():
    p = Pacer(max_staleness=0, attempts_per_step=1)
    p.try_admit("a", 0)
    with pytest.raises(PacingError, match="already admitted"):
        p.try_admit("a", 0)
    with pytest.raises(PacingError, match="'zz' was not admitted"):
        p.finish("zz")
    p.finish("a")
    with pytest.raises(PacingError, match="already finished"):
        p.finish("a")
    p.advance(3)
    with pytest.raises(PacingError, match="went back"):
        p.advance(2)
    with pytest.raises(PacingError, match="attempts_per_step"):
        Pacer(max_staleness=0, attempts_per_step=0)


def test_a_failed_attempt_gives_its_training_slot_back():
    p = Pacer(max_staleness=0, attempts_per_step=2)
    assert p.try_admit("a", 0).train_version == 0
    assert p.try_admit("b", 0).train_version == 0
    assert p.try_admit("c", 0) is None  # slot 2 trains at version 1: too stale from version 0
    p.finish("a", failed=True)  # the trainer will never see a: b and the next one fill step 0
    c = p.try_admit("c", 0)
    assert c is not None and (c.ticket, c.train_version) == (2, 0)
    p.finish("c", "C")
    assert [x.attempt_id for x, _, _ in p.take_ready()] == ["a"]  # c waits for b
    p.finish("b", "B")
    assert [(x.attempt_id, r) for x, r, _ in p.take_ready()] == [("b", "B"), ("c", "C")]


async def test_pool_attempt_releases_in_order_and_fails_on_exceptions(autojump_clock):
    pool = SamplerPool(max_staleness=1, attempts_per_step=10)
    out = []

    async def consume():
        while len(out) < 4:
            out.extend((adm.attempt_id, result, failed) for adm, result, failed in await pool.released())

    async def run(i: int, delay: float, how: str) -> None:
        async with pool.attempt(f"a{i}") as att:
            await trio.sleep(delay)
            if how == "raise":
                raise KeyError("harness crashed")
            att.result = f"R{i}"

    async def crashing(i, delay):
        with pytest.raises(KeyError):
            await run(i, delay, "raise")

    async with trio.open_nursery() as n:
        n.start_soon(consume)
        with trio.move_on_after(5):  # cancelled inside: finished as failed
            await run(0, 100, "ok")
        n.start_soon(run, 1, 3.0, "ok")
        await trio.sleep(0.1)
        n.start_soon(crashing, 2, 2.0)
        await trio.sleep(0.1)
        n.start_soon(run, 3, 1.0, "ok")
    assert out == [("a0", None, True), ("a1", "R1", False), ("a2", None, True), ("a3", "R3", False)]
    assert pool.pacer.in_flight == 0 and pool.pacer.waiting == 0


def test_a_pacer_behind_a_resumed_trainer_is_rebased():
    """A pool restarted at version 0 under a trainer resumed at version 7: without the
    rebase it would predict version 0 and admit attempts served by version-0 weights."""
    p = Pacer(max_staleness=2, attempts_per_step=2)
    assert p.try_admit("a", 0).train_version == 0
    p.advance(7)
    assert p.rebased == 1
    assert p.try_admit("b", 0) is None  # would train at >= 7 from version-0 weights
    b = p.try_admit("b", 5)
    assert b is not None and b.train_version == 7  # the next slot trains at the trainer's version
    assert p.try_admit("c", 5) is None  # the next slot trains at 8: 8 - 5 = 3 > 2
    assert p.try_admit("c", 6).train_version == 8


def test_normal_flow_never_rebases():
    p = Pacer(max_staleness=1, attempts_per_step=2)
    for v in range(5):
        got = [p.try_admit(f"{v}-{i}", v) for i in range(4)]
        assert all(a is not None for a in got[:2])
        for a in got:
            if a is not None:
                p.finish(a.attempt_id, "r")
        p.take_ready()
        p.advance(v + 1)
    assert p.rebased == 0

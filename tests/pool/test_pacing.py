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
from hypothesis import example, given, settings
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


# --------------------------------------------------------------------------- deep staleness, any interleaving

_OPS = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 12)),          # promised version: trainer's - n (clamped at 0)
    st.tuples(st.just("finish"), st.integers(0, 63), st.booleans()),  # k-th open attempt; failed?
    st.tuples(st.just("train")),
    st.tuples(st.just("stale"), st.integers(0, 3)),           # a stale-group report, with this excess
)


def _consume(queue: list, per_step: int, version: int, trained: list, *, final: bool = False) -> int:
    """The trainer: ``per_step`` released successful attempts per version, in release
    order (``final``: the partial batch left at the end trains at the current version)."""
    while len(queue) >= per_step or (final and queue):
        batch, queue[:] = queue[:per_step], queue[per_step:]
        trained.extend((version, adm, oldest) for adm, oldest in batch)
        if len(batch) == per_step:
            version += 1
    return version


@pytest.mark.parametrize("max_staleness", [4, 8])
@settings(max_examples=150, deadline=None)
@given(per_step=st.integers(1, 4), ops=st.lists(_OPS, min_size=20, max_size=120), restore=st.integers(1, 5))
def test_the_bound_holds_for_any_interleaving(max_staleness, per_step, ops, restore):
    """`Pacer`: for any order of admissions (with any promised version), completions,
    failures, train steps and stale-group reports (which lower the allowance), every
    attempt the trainer consumes in release order is consumed at a version <= its
    predicted ``train_version`` and is at most ``allowance <= max_staleness`` versions
    older than it (its tokens from the version it was admitted with, the worst case)."""
    p = Pacer(max_staleness=max_staleness, attempts_per_step=per_step, restore_versions=restore)
    version, n, open_ids, queue, trained, allowed = 0, 0, [], [], [], {}
    for op in ops:
        if op[0] == "admit":
            adm = p.try_admit(f"a{n}", max(0, version - op[1]))
            if adm is not None:
                open_ids.append(adm.attempt_id)
                allowed[adm.attempt_id] = p.allowance
                n += 1
        elif op[0] == "finish" and open_ids:
            aid = open_ids.pop(op[1] % len(open_ids))
            p.finish(aid, aid, failed=op[2])
        elif op[0] == "train":
            queue.extend((adm, adm.oldest_version) for adm, _, failed in p.take_ready() if not failed)
            version = _consume(queue, per_step, version, trained)
            p.advance(version)
        elif op[0] == "stale":
            p.tighten(op[1], version)
        assert 0 <= p.allowance <= max_staleness
    for aid in open_ids:
        p.finish(aid, aid)
    queue.extend((adm, adm.oldest_version) for adm, _, failed in p.take_ready() if not failed)
    _consume(queue, per_step, version, trained, final=True)
    assert p.rebased == 0 and p.in_flight == 0 and p.waiting == 0
    for at, adm, oldest in trained:
        assert at <= adm.train_version, (at, adm)
        assert at - oldest <= allowed[adm.attempt_id] <= max_staleness, (at, adm)


def test_a_stale_report_lowers_the_allowance_once_and_it_comes_back():
    p = Pacer(max_staleness=8, attempts_per_step=1, restore_versions=2)
    for i in range(9):  # slots 0..8 train at versions 0..8, all from version-0 weights
        assert p.try_admit(f"a{i}", 0) is not None
    assert p.try_admit("x", 0) is None
    assert p.tighten(3, refused_at=0) and p.allowance == 5 and p.cuts == 1
    # refusals up to version 8 (where the last attempt admitted before the cut trains)
    # come from attempts admitted under the old allowance: no new evidence
    assert not p.tighten(3, refused_at=8) and p.allowance == 5
    assert p.tighten(0, refused_at=9) and p.allowance == 4  # later: cut again, by at least 1
    for v in range(1, 6):
        p.advance(v)
    assert p.allowance == 4 + 5 // 2  # one back every 2 versions since the cut
    p.advance(20)
    assert p.allowance == 8  # never above max_staleness
    assert p.rebased == 1  # (the jump to 20 was not consumed here: rebased)
    with pytest.raises(PacingError, match="restore_versions"):
        Pacer(max_staleness=1, attempts_per_step=1, restore_versions=0)


def test_the_floor_is_the_newest_promise_in_flight():
    p = Pacer(max_staleness=4, attempts_per_step=2)
    assert p.floor is None
    p.try_admit("a", 0)
    p.try_admit("b", 1)
    p.try_admit("c", 1)
    assert p.floor == 1
    p.finish("b")
    assert p.floor == 1  # c still holds version 1
    p.finish("c", failed=True)
    assert p.floor == 0
    p.finish("a")
    assert p.floor is None


class _InstantDevice:
    """Answers at once; its tokens carry the version it holds."""

    def __init__(self, sampler_id: str, version: int) -> None:
        self.sampler_id = sampler_id
        self.version = version
        self.identity = m.SamplerIdentity(sampler_id=sampler_id, backend="fake", device_kind="cpu", dtype="bfloat16")

    async def generate(self, request: m.GenerateRequest, started) -> m.Generation:
        started()
        await trio.sleep(0)
        ids = Tensor.from_numpy(np.arange(2, dtype=np.int64))
        lps = Tensor.from_numpy(np.zeros(2, np.float32))
        return m.Generation(request_id=request.request_id, token_ids=ids, logprobs=lps,
                            support=m.SupportCSR(ids=ids, logprobs=lps,
                                                 offsets=Tensor.from_numpy(np.arange(3, dtype=np.int64))),
                            versions=Tensor.from_numpy(np.full(2, self.version, np.int64)), sampler=self.identity,
                            finish_reason="length")

    async def health(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass


_POOL_OPS = st.one_of(
    st.tuples(st.just("admit"), st.integers(1, 12)),  # admit up to this many now, then wait for one more
    st.tuples(st.just("calls")),  # every open attempt makes a model call
    st.tuples(st.just("call"), st.integers(0, 15)),  # a model call of the k-th newest open attempt
    # a sampler leaves (maybe) and one joins this many versions behind the trainer, under
    # an id that sorts first (routing prefers it among idle samplers)
    st.tuples(st.just("rejoin"), st.integers(0, 3), st.integers(1, 9)),
    st.tuples(st.just("cycle")),  # a whole step: admit, call, finish, train, every sampler catches up
    st.tuples(st.just("finish"), st.integers(0, 63), st.booleans()),
    st.tuples(st.just("train")),
    st.tuples(st.just("sync"), st.integers(0, 7)),
    st.tuples(st.just("stale"), st.integers(0, 3)),
)


@pytest.mark.parametrize("max_staleness", [4, 8])
@settings(max_examples=150, deadline=None)
@given(per_step=st.integers(1, 3), ops=st.lists(_POOL_OPS, min_size=15, max_size=60))
# found by this test (shrunk): a sampler joins one version behind after attempts were
# admitted against the whole fleet at the trainer's version, and serves the newest one
@example(per_step=1, ops=[("cycle",), ("admit", 12), ("rejoin", 0, 1), ("calls",)])
def test_the_pool_keeps_the_bound_when_samplers_rejoin_with_old_weights(max_staleness, per_step, ops):
    """The wired path, for any interleaving: admissions through `SamplerPool.admit` (one
    may wait while the others go on), model calls routed by the pool (the tokens carry
    the serving sampler's version), completions and failures, train steps, samplers
    catching up, samplers leaving and coming back (or joining) with older weights, and
    stale-group reports. The tokens an attempt really carries are never more than
    ``max_staleness`` versions older than the version the trainer consumes it at.
    (Without the pacer's floor in routing, a sampler rejoining with old weights serves an
    attempt admitted against newer ones, and this fails.)"""
    from fleetrl.actors.buffer import StaleGroup

    async def main() -> None:
        pool = SamplerPool(max_staleness=max_staleness, attempts_per_step=per_step, restore_versions=2)
        devices = {sid: _InstantDevice(sid, 0) for sid in "abc"}
        for d in devices.values():
            pool.add(d, d.identity, price_per_hour=0.0, capacity=4, remote=False)
        state = {"version": 0, "n": 0, "calls": 0}
        open_ids: list[str] = []
        oldest: dict[str, int] = {}
        queue: list = []
        trained: list = []
        waiting: list[tuple[str, trio.CancelScope]] = []  # at most one admission waits

        async def admit(aid: str, scope: trio.CancelScope) -> None:
            with scope:
                await pool.admit(aid)
                open_ids.append(aid)

        async def call(aid: str, scope: trio.CancelScope) -> None:
            state["calls"] += 1
            with scope:
                g = await pool.generate(m.GenerateRequest(
                    request_id=f"{aid}-{state['calls']}", attempt_id=aid, params=m.SamplingParams(max_tokens=2),
                    prompt_ids=Tensor.from_numpy(np.array([1, 2], np.int64))))
                v = int(g.versions.to_numpy().min())
                oldest[aid] = min(oldest.get(aid, v), v)

        def new_id() -> str:
            state["n"] += 1
            return f"a{state['n']}"

        def train() -> None:
            queue.extend((adm, None) for adm, _, failed in pool.released_nowait() if not failed)
            state["version"] = _consume(queue, per_step, state["version"], trained)
            pool.set_trainer_version(state["version"])

        def sync(sid: str) -> None:
            d = devices[sid]
            if sid not in pool.handles:
                return
            d.version = max(d.version, state["version"])
            pool.set_sampler_version(sid, d.version, f"d{d.version}")

        async with trio.open_nursery() as nursery:
            async def settle() -> None:
                await trio.testing.wait_all_tasks_blocked()
                waiting[:] = [w for w in waiting if w[0] not in open_ids]

            async def call_now(aid: str) -> None:
                scope = trio.CancelScope()
                nursery.start_soon(call, aid, scope)
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()  # no sampler can take it now: the call gives up

            for op in ops:
                kind = op[0]
                if kind == "cycle":
                    for _ in range(per_step):
                        if waiting or not pool.pacer.would_admit(pool.promised_version()):
                            break
                        aid = new_id()
                        await admit(aid, trio.CancelScope())
                        await call_now(aid)
                        open_ids.remove(aid)
                        pool.finish(aid, aid)
                    train()
                    for sid in list(pool.handles):
                        sync(sid)
                elif kind == "admit" and not waiting:
                    for _ in range(op[1]):
                        if not pool.pacer.would_admit(pool.promised_version()):
                            break
                        await admit(new_id(), trio.CancelScope())
                    waiting.append((new_id(), trio.CancelScope()))
                    nursery.start_soon(admit, *waiting[-1])
                elif kind == "call" and open_ids:
                    await call_now(open_ids[-1 - op[1] % len(open_ids)])
                elif kind == "calls":
                    for aid in list(open_ids):
                        await call_now(aid)
                elif kind == "finish" and open_ids:
                    aid = open_ids.pop(op[1] % len(open_ids))
                    pool.finish(aid, aid, failed=op[2])
                elif kind == "train":
                    train()
                elif kind == "sync":
                    sync(sorted(pool.handles)[op[1] % len(pool.handles)])
                elif kind == "rejoin":
                    if op[1] < len(pool.handles) and len(pool.handles) > 1:
                        pool.mark_dead(sorted(pool.handles)[op[1]], "restarted")
                    sid = f"0{99 - len(devices)}"  # sorts before every earlier one
                    devices[sid] = _InstantDevice(sid, max(0, state["version"] - op[2]))
                    pool.add(devices[sid], devices[sid].identity, price_per_hour=0.0, capacity=4, remote=False,
                             version=devices[sid].version)
                elif kind == "stale":
                    v = state["version"]
                    pool.on_stale_group(StaleGroup(group_id=f"g{state['n']}", task_id="t", oldest_version=max(0, v - 3),
                                                   trainer_version=v, max_staleness=max(0, 2 - op[1])))
                await settle()
            for _, scope in waiting:
                scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            for aid in list(open_ids):
                pool.finish(aid, aid)
            queue.extend((adm, None) for adm, _, failed in pool.released_nowait() if not failed)
            _consume(queue, per_step, state["version"], trained, final=True)
        assert pool.pacer.rebased == 0
        for at, adm, _ in trained:
            assert at <= adm.train_version
            if adm.attempt_id in oldest:
                assert at - oldest[adm.attempt_id] <= max_staleness, (at, adm, oldest[adm.attempt_id])

    trio.run(main)


# --------------------------------------------------------------------------- stale-group reports


def _stale(trainer_version: int, oldest: int, accepted: int, reason: str = "too_stale"):
    from fleetrl.actors.buffer import StaleGroup

    return StaleGroup(group_id=f"g-{trainer_version}-{oldest}", task_id="t", oldest_version=oldest,
                      trainer_version=trainer_version, max_staleness=accepted, reason=reason)


def _fleet(pool: SamplerPool, **versions: int) -> dict[str, _InstantDevice]:
    devs = {sid: _InstantDevice(sid, v) for sid, v in versions.items()}
    for d in devs.values():
        pool.add(d, d.identity, price_per_hour=0.0, capacity=4, remote=False, version=d.version)
    return devs


def _req(i: int) -> m.GenerateRequest:
    return m.GenerateRequest(request_id=f"r{i}", attempt_id=f"x{i}", params=m.SamplingParams(max_tokens=2),
                             prompt_ids=Tensor.from_numpy(np.array([1, 2, i], np.int64)))


async def test_stale_reports_are_counted_and_lower_the_allowance(autojump_clock):
    pool = SamplerPool(max_staleness=4, attempts_per_step=1, restore_versions=2)
    _fleet(pool, a=0)
    pool.on_stale_group(_stale(1, 0, 0, "expired"))  # one too many: a cut of 1
    assert pool.pacer.allowance == 3
    pool.set_trainer_version(2)
    assert pool.pacer.allowance == 4  # restored: one every 2 versions after the cut
    pool.set_trainer_version(6)
    pool.set_sampler_version("a", 6, "d6")
    pool.on_stale_group(_stale(6, 1, 2))  # 5 behind, 2 accepted: 3 too many
    stats = pool.statistics()
    assert (stats.stale_reports, stats.stale_by_reason) == (2, {"expired": 1, "too_stale": 1})
    assert stats.pacing_allowance == 1 == pool.pacer.allowance
    # attempts now run at most one version ahead of the weights they are served by
    admitted = [await pool.admit(f"a{i}") for i in range(2)]
    assert [(a.oldest_version, a.train_version) for a in admitted] == [(6, 6), (6, 7)]
    assert not pool.pacer.would_admit(pool.promised_version())
    pool.on_stale_group(_stale(6, 2, 2))  # refused at the cut's version: from before it, no new cut
    assert pool.pacer.allowance == 1 and pool.pacer.cuts == 2
    for v in (7, 8, 9, 10):
        pool.set_trainer_version(v)
    assert pool.pacer.allowance == 3
    pool.set_trainer_version(20)
    assert pool.pacer.allowance == 4  # never above max_staleness


async def test_lagging_samplers_are_deprioritised_not_stalled_and_asked_to_resync(autojump_clock):
    pool = SamplerPool(max_staleness=8, attempts_per_step=1)
    devs = _fleet(pool, a=1, b=5)  # a sorts first: routing would pick it among idle samplers
    pool.set_trainer_version(5)
    got = [await pool.generate(_req(0))]
    assert got[0].sampler.sampler_id == "a"  # within max_staleness 8: fine so far
    synced: list[int] = []

    async def follower(msg: m.WeightVersionAvailable) -> None:
        synced.append(msg.version)

    pool.on_version(follower)
    async with trio.open_nursery() as nursery:
        pool.announce(m.WeightVersionAvailable(version=5, digest="d5", base=None, blobs=()), nursery)
        await trio.testing.wait_all_tasks_blocked()
        assert synced == [5]
        # the trainer (accepting 2 versions) refuses a group of version-1 tokens at version 5
        pool.on_stale_group(_stale(5, 1, 2), nursery)
        await trio.testing.wait_all_tasks_blocked()
        assert synced == [5, 5] and pool.resyncs == 1  # the followers were sent the newest version again
        pool.on_stale_group(_stale(5, 1, 2), nursery)
        await trio.testing.wait_all_tasks_blocked()
        assert synced == [5, 5]  # once per trainer version
    assert pool.lag_floor == 3
    for i in range(1, 4):
        g = await pool.generate(_req(i))
        assert g.sampler.sampler_id == "b"  # a's version-1 tokens would be refused: b serves
    pool.mark_dead("b", "gone")
    g = await pool.generate(_req(9))
    assert g.sampler.sampler_id == "a"  # the only one left: deprioritised, not stalled
    devs["a"].version = 5
    pool.set_sampler_version("a", 5, "d5")
    assert pool.statistics().resyncs == 1


async def test_a_report_without_lagging_samplers_resyncs_nothing(autojump_clock):
    pool = SamplerPool(max_staleness=4, attempts_per_step=1)
    _fleet(pool, a=5)
    pool.set_trainer_version(5)
    calls = []

    async def follower(msg):
        calls.append(msg)

    pool.on_version(follower)
    async with trio.open_nursery() as nursery:
        pool.announce(m.WeightVersionAvailable(version=5, digest="d5", base=None, blobs=()), nursery)
        pool.on_stale_group(_stale(5, 1, 2), nursery)  # produced by a sampler that has caught up since
        await trio.testing.wait_all_tasks_blocked()
    assert len(calls) == 1 and pool.resyncs == 0 and pool.stale_reports == 1

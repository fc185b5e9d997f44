"""Staleness pacing: the bound holds against a slow trainer and nothing finished is dropped."""

from __future__ import annotations

import random

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.pool.pacing import Pacer, PacingError


async def _simulate(*, max_staleness: int, per_step: int, n_workers: int, attempts: int,
                    train_s: float, seed: int) -> dict:
    """Workers start attempts as fast as the pacer allows; a slow trainer takes
    `per_step` released attempts per version. Samplers follow the trainer with a lag."""
    rng = random.Random(seed)
    pacer = Pacer(max_staleness=max_staleness, attempts_per_step=per_step)
    state = {"trainer": 0, "fleet": 0, "trained": [], "admitted": 0, "finished": 0}
    changed = trio.Condition()
    ready: list = []

    async def notify():
        async with changed:
            changed.notify_all()

    async def worker(wid: int):
        while state["admitted"] < attempts:
            adm = pacer.try_admit(f"a{state['admitted']}", state["fleet"])
            if adm is None:
                async with changed:
                    await changed.wait()
                continue
            state["admitted"] += 1
            oldest_token = state["fleet"]  # the fleet's version when it started
            assert adm.oldest_version == oldest_token
            await trio.sleep(rng.uniform(0.1, 3.0))  # attempts finish out of order
            pacer.finish(adm.attempt_id, result=(adm, oldest_token), failed=rng.random() < 0.1)
            state["finished"] += 1
            ready.extend(pacer.take_ready())
            await notify()

    async def trainer():
        while len(state["trained"]) < attempts:
            if len(ready) < per_step and len(state["trained"]) + len(ready) < attempts:
                async with changed:
                    await changed.wait()
                continue
            batch, ready[:] = ready[:per_step], ready[per_step:]
            for adm, (adm2, oldest), failed in batch:
                state["trained"].append((state["trainer"], adm, oldest, failed))
            await trio.sleep(train_s)  # deliberately slow
            state["trainer"] += 1
            pacer.advance(state["trainer"])
            await notify()

    async def fleet():  # samplers pick up a version a little after it is published
        while len(state["trained"]) < attempts:
            await trio.sleep(0.5)
            if state["fleet"] < state["trainer"]:
                state["fleet"] += 1
                await notify()

    with trio.fail_after(10_000):
        async with trio.open_nursery() as n:
            n.start_soon(trainer)
            n.start_soon(fleet)
            for w in range(n_workers):
                n.start_soon(worker, w)
            while len(state["trained"]) < attempts:
                await trio.sleep(1)
            n.cancel_scope.cancel()
    return state


async def test_slow_trainer_bound_holds_and_nothing_dropped(autojump_clock):
    s = await _simulate(max_staleness=2, per_step=4, n_workers=16, attempts=80, train_s=20.0, seed=1)
    trained = s["trained"]
    assert len(trained) == 80
    assert len({adm.attempt_id for _, adm, _, _ in trained}) == 80  # every finished attempt, once
    for version, adm, oldest, _ in trained:
        assert version - oldest <= 2, (adm, version, oldest)
        assert version == adm.train_version
    # the bound actually paced sampling: the trainer reached the edge of it
    assert max(v - o for v, _, o, _ in trained) == 2


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 3), st.integers(1, 5), st.integers(1, 12), st.integers(0, 10_000))
def test_bound_holds_for_any_setting(max_staleness, per_step, workers, seed):
    async def main():
        s = await _simulate(max_staleness=max_staleness, per_step=per_step, n_workers=workers,
                            attempts=3 * per_step * (max_staleness + 1), train_s=7.0, seed=seed)
        assert len(s["trained"]) == 3 * per_step * (max_staleness + 1)
        for version, _, oldest, _ in s["trained"]:
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

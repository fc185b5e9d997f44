"""Scoring several groups in one lease and one engine exec (`ScoreBatcher`).

Against an in-memory pool under Trio's autojump clock: when a batch runs (full, after
the linger, when a slot frees), which jobs share it (same image and limits only, the
oldest first, at most ``max_groups``), that every job gets exactly its own results
(Hypothesis over arrival patterns), and what failures and cancellations do. Against
real Docker: synthetic groups scored in shared batches get the rewards they get alone,
with a hanging and a process-killing solution in the batch.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

import msgspec
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.envworker.config import EnvWorkerConfig
from fleetrl.actors.envworker.score_batches import ScoreBatcher
from fleetrl.sandboxes import ExecSpec, SandboxError

from .conftest import Result


class FakePool:
    """Leases that record (start time, image, limits, programs); a batch takes
    ``delay`` seconds; each program answers its own argv."""

    def __init__(self, delay: float = 1.0, fail: BaseException | None = None) -> None:
        self.delay = delay
        self.fail = fail
        self.runs: list[tuple[float, str, object, list[str]]] = []
        self.leaders: list[object] = []  # the task each batch ran in
        self.held = 0
        self.max_held = 0

    @asynccontextmanager
    async def lease(self, image, limits):
        self.held += 1
        self.max_held = max(self.max_held, self.held)
        try:
            yield _FakeSandbox(self, image, limits)
        finally:
            self.held -= 1


class _FakeSandbox:
    def __init__(self, pool: FakePool, image: str, limits: object) -> None:
        self.pool, self.image, self.limits = pool, image, limits

    async def exec_many(self, programs, *, final=False):
        assert final
        names = [" ".join(p.cmd) for p in programs]
        self.pool.runs.append((trio.current_time(), self.image, self.limits, names))
        self.pool.leaders.append(trio.lowlevel.current_task())
        await trio.sleep(self.pool.delay)
        if self.pool.fail is not None:
            raise self.pool.fail
        return [Result(0, n.encode()) for n in names]


def specs(job: str, n: int = 2) -> list[ExecSpec]:
    return [ExecSpec(cmd=["run", job, str(k)]) for k in range(n)]


async def submit(b: ScoreBatcher, job: str, out: dict, at: float = 0.0, n: int = 2, limits: object = "L",
                 image: str = "img") -> None:
    await trio.sleep(at)
    rs = await b.exec_many(image, limits, specs(job, n))
    out[job] = ([r.stdout.decode() for r in rs], trio.current_time())


def own(job: str, n: int = 2) -> list[str]:
    return [f"run {job} {k}" for k in range(n)]


async def test_a_full_batch_runs_at_once_and_each_group_gets_its_own_results(autojump_clock):
    pool, out = FakePool(), {}
    sizes: list[int] = []
    b = ScoreBatcher(pool, max_groups=3, linger_s=10.0, slots=2, on_batch=sizes.append)
    async with trio.open_nursery() as n:
        for i, job in enumerate("abc"):
            n.start_soon(submit, b, job, out, 0.01 * i)
    assert [(t, names) for t, _, _, names in pool.runs] == [(0.02, own("a") + own("b") + own("c"))]
    assert {j: r for j, (r, _) in out.items()} == {j: own(j) for j in "abc"}
    assert sizes == [3] and (b.batches_run, b.jobs_run) == (1, 3)


async def test_a_lone_group_waits_the_linger_then_runs_alone(autojump_clock):
    pool, out = FakePool(), {}
    b = ScoreBatcher(pool, max_groups=4, linger_s=0.5, slots=2)
    await submit(b, "a", out)
    assert [(t, names) for t, _, _, names in pool.runs] == [(0.5, own("a"))]
    assert out["a"] == (own("a"), 1.5)


async def test_groups_that_finish_while_the_slots_are_busy_fill_the_next_batch(autojump_clock):
    pool, out = FakePool(delay=1.0), {}
    b = ScoreBatcher(pool, max_groups=4, linger_s=0.0, slots=1)
    async with trio.open_nursery() as n:
        n.start_soon(submit, b, "a", out)
        for i, job in enumerate("bcdef"):
            n.start_soon(submit, b, job, out, 0.1 * (i + 1))
    assert [(t, names) for t, _, _, names in pool.runs] == [
        (0.0, own("a")),
        (1.0, own("b") + own("c") + own("d") + own("e")),  # the oldest four
        (2.0, own("f")),
    ]
    assert {j: r for j, (r, _) in out.items()} == {j: own(j) for j in "abcdef"}
    assert pool.max_held == 1


async def test_groups_with_different_limits_or_images_never_share_a_batch(autojump_clock):
    pool, out = FakePool(), {}
    b = ScoreBatcher(pool, max_groups=8, linger_s=0.2, slots=4)
    async with trio.open_nursery() as n:
        n.start_soon(submit, b, "a", out)
        n.start_soon(submit, b, "b", out, 0.0, 2, "other")
        n.start_soon(submit, b, "c", out, 0.05)
        n.start_soon(submit, b, "d", out, 0.0, 2, "L", "img2")
    keys = sorted((image, limits, tuple(names)) for _, image, limits, names in pool.runs)
    assert keys == [("img", "L", tuple(own("a") + own("c"))), ("img", "other", tuple(own("b"))),
                    ("img2", "L", tuple(own("d")))]


async def test_a_sandbox_error_is_the_error_of_every_group_of_the_batch(autojump_clock):
    pool = FakePool(fail=SandboxError("engine said no"))
    b = ScoreBatcher(pool, max_groups=2, linger_s=1.0, slots=1)
    errors = []

    async def one(job):
        with pytest.raises(SandboxError, match="engine said no") as info:
            await b.exec_many("img", "L", specs(job))
        errors.append(info.value)

    async with trio.open_nursery() as n:
        n.start_soon(one, "a")
        n.start_soon(one, "b")
    assert len(errors) == 2 and len(pool.runs) == 1


async def test_a_group_cancelled_while_queued_leaves_the_queue(autojump_clock):
    pool, out = FakePool(delay=1.0), {}
    b = ScoreBatcher(pool, max_groups=4, linger_s=0.0, slots=1)
    async with trio.open_nursery() as n:
        n.start_soon(submit, b, "a", out)
        with trio.move_on_after(0.5):  # "b" queues behind "a" and is cancelled before a slot frees
            await submit(b, "b", out, at=0.1)
        n.start_soon(submit, b, "c", out)
    assert [names for _, _, _, names in pool.runs] == [own("a"), own("c")]
    assert set(out) == {"a", "c"}


async def test_when_the_leader_is_cancelled_the_others_of_its_batch_get_a_sandbox_error(autojump_clock):
    pool = FakePool(delay=5.0)
    b = ScoreBatcher(pool, max_groups=2, linger_s=10.0, slots=1)
    scopes, outcome = {}, {}

    async def one(job):
        with trio.CancelScope() as scopes[trio.lowlevel.current_task()]:
            try:
                await b.exec_many("img", "L", specs(job))
                outcome[job] = "results"
            except SandboxError as exc:
                outcome[job] = str(exc)
            return
        outcome[job] = "cancelled"

    async with trio.open_nursery() as n:
        n.start_soon(one, "a")
        n.start_soon(one, "b")
        await trio.sleep(1.0)  # the full batch runs in the task of one of them (its leader)
        (leader,) = pool.leaders
        scopes[leader].cancel()
    assert [names for _, _, _, names in pool.runs] in ([own("a") + own("b")], [own("b") + own("a")])
    assert sorted(outcome.values()) == ["cancelled", "the scoring batch this group shared ended early: Cancelled"]


@settings(max_examples=60, deadline=None)
@given(jobs=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 3), st.sampled_from(["L", "M"])),
                     min_size=1, max_size=12),
       max_groups=st.integers(1, 4), linger=st.sampled_from([0.0, 0.05, 0.3]), slots=st.integers(1, 3),
       delay=st.sampled_from([0.01, 0.2, 1.0]))
def test_every_group_gets_exactly_its_own_results_in_batches_of_one_key(jobs, max_groups, linger, slots, delay):
    pool, out = FakePool(delay=delay), {}
    sizes: list[int] = []
    b = ScoreBatcher(pool, max_groups=max_groups, linger_s=linger, slots=slots, on_batch=sizes.append)

    async def main():
        async with trio.open_nursery() as n:
            for i, (at, size, limits) in enumerate(jobs):
                n.start_soon(lambda i=i, at=at, size=size, limits=limits: submit(
                    b, f"j{i}", out, at=at / 10, n=size, limits=limits))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert {j: r for j, (r, _) in out.items()} == {f"j{i}": own(f"j{i}", size) for i, (_, size, _) in enumerate(jobs)}
    ran = [name for _, _, _, names in pool.runs for name in names]
    assert sorted(ran) == sorted(n for i, (_, size, _) in enumerate(jobs) for n in own(f"j{i}", size))  # once each
    assert pool.max_held <= slots
    for _, _, limits, names in pool.runs:
        groups = {name.split()[1] for name in names}
        assert 1 <= len(groups) <= max_groups
        assert {jobs[int(g[1:])][2] for g in groups} == {limits}
    assert sum(sizes) == b.jobs_run == len(jobs) and len(sizes) == b.batches_run == len(pool.runs)


def test_bad_settings_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="max_groups"):
        ScoreBatcher(FakePool(), max_groups=0, linger_s=0.1, slots=1)
    with pytest.raises(ValueError, match="linger_s"):
        ScoreBatcher(FakePool(), max_groups=2, linger_s=float("inf"), slots=1)
    with pytest.raises(ValueError, match="slots"):
        ScoreBatcher(FakePool(), max_groups=2, linger_s=0.1, slots=0)
    base = {"model": {"kind": "local", "model_dir": "unused"}}
    for bad, field in (({"max_groups": 0}, "max_groups"), ({"linger_s": -1}, "linger_s"),
                       ({"slots": 0}, "slots"), ({"groups": 4}, "groups")):
        with pytest.raises(msgspec.ValidationError, match=field):
            msgspec.convert({**base, "score_batching": bad}, EnvWorkerConfig)
    assert msgspec.convert(base, EnvWorkerConfig).score_batching.max_groups == 1  # off by default


# -- real Docker --------------------------------------------------------------------------

HANG = "def f(x):\n    while True:\n        pass\n"
KILL_ALL = "import os\nos.kill(-1, 9)\n"  # kills the checker and the batch runner: re-run alone


@pytest.mark.docker
async def test_groups_scored_in_shared_batches_get_the_rewards_they_get_alone(tmp_path):
    from fleetrl.actors.envworker.sandboxing import GroupScorer
    from fleetrl.actors.envworker import sandbox_limits
    from fleetrl.harness.synthetic import make_task, reference_solution, solution_text
    from fleetrl.sandboxes import Ownership, WarmPolicy, open_sandbox_pool

    tasks = [make_task(5, "train", i) for i in range(4)]
    wrong = "def f(x):\n    return 0\n"
    sols = []
    for i, task in enumerate(tasks):
        good = solution_text(task, reference_solution(task))
        sols.append([good, wrong, HANG if i == 1 else good, KILL_ALL if i == 2 else wrong])
    cfg = msgspec.convert({"model": {"kind": "local", "model_dir": "unused"}, "sandbox": {"memory_mb": 256}},
                          EnvWorkerConfig)
    own_ = Ownership.for_state_dir(tmp_path, owner="test-score-batches")

    async def score_all(pool, batcher):
        rewards = {}
        async with trio.open_nursery() as nursery:
            scorers = [GroupScorer(pool, t, sandbox_limits(t, cfg.sandbox), nursery=nursery, scopes=set(),
                                   batcher=batcher) for t in tasks]

            async def one(g, k):
                r = await scorers[g].score({"solution.py": sols[g][k]})
                rewards[g, k] = getattr(r, "reward", None) if not hasattr(r, "kind") else r.kind

            for s in scorers:
                for _ in range(4):
                    s.join()
            with trio.fail_after(300):
                async with trio.open_nursery() as inner:
                    for g in range(len(tasks)):
                        for k in range(4):
                            inner.start_soon(one, g, k)
        return rewards, scorers

    async with open_sandbox_pool(own_, policy=WarmPolicy(min_warm=0, max_warm=2, max_containers=4)) as pool:
        alone, _ = await score_all(pool, None)
        sizes: list[int] = []
        batcher = ScoreBatcher(pool, max_groups=4, linger_s=0.5, slots=1, on_batch=sizes.append)
        shared, scorers = await score_all(pool, batcher)
    assert shared == alone
    assert sizes[0] == 4  # the four groups' checkers ran in one engine exec
    for g in range(4):
        assert shared[g, 0] == 1.0 and shared[g, 1] < 1.0
    assert shared[1, 2] == 0.0  # the hanging solution, and its batch-mates unharmed
    assert shared[2, 3] == "evaluator_error"  # killed its checker: no verdict (as alone)
    assert sum(s.group_runs for s in scorers) == 4

"""Pacing bookkeeping of the worker against a real in-process `SamplerPool` (its real
pacer), with in-memory sandboxes and a scripted model, on Trio's virtual clock.

Every admitted slot is finished in the pacer whatever happens to its group (emitted,
retried, incomplete, abandoned while running or while waiting for admission), groups
go out in admission order even when they finish out of order, and a group's slots are
admitted consecutively."""

from __future__ import annotations

from contextlib import asynccontextmanager

import msgspec
import pytest
import structlog
import trio

from fleetrl.actors.envworker.actor import pacing_of
from fleetrl.actors.envworker.config import EnvWorkerConfig
from fleetrl.actors.envworker.cursor import TaskCursor
from fleetrl.actors.envworker.sources import TaskSource
from fleetrl.actors.envworker.worker import _Worker
from fleetrl.actors.pool import SamplerPool
from fleetrl.daemon.examples import example_generation
from fleetrl.daemon.messages import RolloutFailed, RolloutGroup
from fleetrl.daemon.metrics import ActorMetrics, MetricsRegistry
from fleetrl.harness.builtin import CompletionHarness
from fleetrl.harness.tasks import Evaluator, Task

from .conftest import Result


class Box:
    async def exec(self, cmd, *, timeout=None, stdin=None, env=None, workdir=None):
        await trio.sleep(0)
        return Result(0)

    async def exec_many(self, programs, *, final=False):
        await trio.sleep(0)
        # reward by the solution's length parity: groups with variance
        return [Result(0, f'{{"reward": {len(str(p.files["/work/solution.py"])) % 2}}}\n'.encode())
                for p in programs]

    async def write_files(self, files):
        await trio.sleep(0)

    async def read_file(self, path, *, max_bytes=1 << 20):
        return b""


class Pool:
    @asynccontextmanager
    async def lease(self, image, limits):
        yield Box()


class Ctx:
    def __init__(self) -> None:
        self.log = structlog.get_logger()
        self.metrics = ActorMetrics(MetricsRegistry(), "env")
        self.name = "env"
        self.draining = False
        self._drain = trio.Event()

    async def wait_draining(self) -> None:
        await self._drain.wait()

    async def wait_unpaused(self) -> None:
        await trio.lowlevel.checkpoint()

    def drain(self) -> None:
        self.draining = True
        self._drain.set()


class PacedModel:
    """A pool model client: ``pool`` is a real `SamplerPool`; answers are scripted,
    each after ``delay(attempt_id)`` seconds."""

    def __init__(self, pool: SamplerPool, delay=lambda attempt_id: 1.0, attempt_id: str = "") -> None:
        from fleetrl.actors.model import build_byte_tokenizer
        from fleetrl.harness.model import HFChatTokenizer

        self.pool = pool
        self.delay = delay
        self.attempt_id = attempt_id
        self._tok = HFChatTokenizer(build_byte_tokenizer())

    @property
    def tokenizer(self):
        return self._tok

    def for_attempt(self, attempt_id):
        view = PacedModel(self.pool, self.delay, attempt_id)
        view._tok = self._tok
        return view

    async def generate(self, prompt_ids, params):
        await trio.sleep(self.delay(self.attempt_id))
        slot = int(self.attempt_id.rsplit("/", 1)[1].split(".")[0])
        return example_generation(2 + slot, 1, vocab=259)


class Flaky(msgspec.Struct, frozen=True):
    """The completion harness, except that first tries of slot 1 crash."""

    sandbox_use = "files"

    async def run(self, task, sandbox, model):
        if model.attempt_id.endswith("/1.1"):
            raise RuntimeError("first try of slot 1 crashes")
        return await CompletionHarness(max_tokens=4).run(task, sandbox, model)


TASK = Task(id="t", prompt="x = ", evaluator=Evaluator(command="score", reward="json"))


def make_worker(pool: SamplerPool, *, harness=None, delay=lambda a: 1.0, model=None, **cfg):
    config = msgspec.convert({"model": {"kind": "pool", "tokenizer_dir": "unused", **(model or {})}, "group_size": 3,
                              "max_concurrent_attempts": 12, "max_groups_in_flight": 4, **cfg}, EnvWorkerConfig)
    ctx = Ctx()
    send, recv = trio.open_memory_channel(1000)
    client = PacedModel(pool, delay)
    w = _Worker(config, ctx, harness=harness or CompletionHarness(max_tokens=4), model=client,
                pool=Pool(), out=send, failures_out=send, cursor=TaskCursor(),
                paced_by=pacing_of(client, config.model))
    return w, ctx, recv


def drain_channel(recv) -> list:
    out = []
    while True:
        try:
            out.append(recv.receive_nowait())
        except trio.WouldBlock:
            return out


async def test_groups_go_out_in_admission_order_and_every_slot_is_finished(autojump_clock):
    pool = SamplerPool(max_staleness=100, attempts_per_step=3)
    # the first group is slow, later ones fast: they finish first but wait for it
    w, ctx, recv = make_worker(pool, harness=Flaky(), delay=lambda a: 50.0 if a.startswith("t#0@") else 1.0,
                               max_tasks=4, retry={"max_tries": {"harness_crash": 2}})
    with trio.fail_after(10_000):  # virtual seconds: a deadlock fails instead of hanging
        async with trio.open_nursery() as n:
            n.start_soon(w.run, TaskSource("x", tasks=[TASK]))
            await trio.sleep(500)
            ctx.drain()
    msgs = drain_channel(recv)
    groups = [m for m in msgs if isinstance(m, RolloutGroup)]
    assert [g.group_id for g in groups] == [f"t#{i}@env" for i in range(4)]
    retried = [m for m in msgs if isinstance(m, RolloutFailed)]
    assert len(retried) == 4 and all("retrying" in m.detail for m in retried)  # slot 1's retry ran under its admission
    assert all(len(g.trajectories) == 3 for g in groups)
    assert pool.pacer.in_flight == 0 and pool.pacer.waiting == 0 and not w.awaiting
    assert pool.pacer._next_ticket == 12  # one admission per slot: the retries ran under theirs


async def test_zero_variance_and_incomplete_groups_give_their_slots_back(autojump_clock):
    class AllCrash(msgspec.Struct, frozen=True):
        async def run(self, task, sandbox, model):
            raise RuntimeError("boom")

    pool = SamplerPool(max_staleness=0, attempts_per_step=3)
    # max_staleness 0 and a trainer that never advances: only groups that give their
    # slots back let the next group in; incomplete groups do, so the worker goes on
    w, ctx, recv = make_worker(pool, harness=AllCrash(), max_tasks=3)
    with trio.fail_after(10_000):  # virtual seconds: a deadlock fails instead of hanging
        async with trio.open_nursery() as n:
            n.start_soon(w.run, TaskSource("x", tasks=[TASK]))
            await trio.sleep(100)
            ctx.drain()
    msgs = drain_channel(recv)
    assert len([m for m in msgs if isinstance(m, RolloutFailed)]) == 9
    assert not [m for m in msgs if isinstance(m, RolloutGroup)] and w.cursor.state().floor == 3  # all 3 ran
    assert pool.pacer.in_flight == 0 and pool.pacer._slots == 0


async def test_drain_while_waiting_for_admission_abandons_and_finishes_everything(autojump_clock):
    pool = SamplerPool(max_staleness=0, attempts_per_step=3)
    # one group fits the bound; the trainer never advances, so the second waits for ever
    # (every group counts as a training slot, whatever its rewards)
    w, ctx, recv = make_worker(pool, max_tasks=2, drain_grace_s=5.0, model={"trainer_skips_zero_variance": False})
    with trio.fail_after(10_000):  # virtual seconds: a deadlock fails instead of hanging
        async with trio.open_nursery() as n:
            n.start_soon(w.run, TaskSource("x", tasks=[TASK]))
            await trio.sleep(30)
            assert pool.pacer.in_flight == 0 and pool.pacer.waiting == 0
            ctx.drain()
            # a group that waits for admission has started nothing: it is abandoned at
            # once, not after drain_grace_s (the pacer would never admit it: no more steps)
            await trio.sleep(1.0)
            msgs = drain_channel(recv)
            assert len([m for m in msgs if isinstance(m, RolloutFailed)]) == 3
            await trio.sleep(30)
    msgs += drain_channel(recv)
    groups = [m for m in msgs if isinstance(m, RolloutGroup)]
    abandoned = [m for m in msgs if isinstance(m, RolloutFailed)]
    assert [g.group_id for g in groups] == ["t#0@env"]
    assert len(abandoned) == 3 and all("waited for the sampler pool's pacer" in m.detail for m in abandoned)
    assert all(m.group_id == "t#1@env" for m in abandoned)
    assert w.cursor.state().floor == 1  # the abandoned task stays due
    assert pool.pacer.in_flight == 0 and pool.pacer.waiting == 0 and not w.awaiting


async def test_drain_cancels_running_paced_attempts_and_finishes_their_slots(autojump_clock):
    pool = SamplerPool(max_staleness=5, attempts_per_step=3)
    w, ctx, recv = make_worker(pool, delay=lambda a: 1000.0, max_tasks=2, drain_grace_s=5.0)
    with trio.fail_after(10_000):  # virtual seconds: a deadlock fails instead of hanging
        async with trio.open_nursery() as n:
            n.start_soon(w.run, TaskSource("x", tasks=[TASK]))
            await trio.sleep(10)
            assert pool.pacer.in_flight == 6
            ctx.drain()
            await trio.sleep(30)
    msgs = drain_channel(recv)
    assert len(msgs) == 6 and all(isinstance(m, RolloutFailed) and "abandoned" in m.detail for m in msgs)
    assert pool.pacer.in_flight == 0 and pool.pacer.waiting == 0 and pool.pacer._slots == 0


async def test_a_release_this_worker_did_not_admit_is_an_error(autojump_clock):
    pool = SamplerPool(max_staleness=5, attempts_per_step=3)
    w, ctx, recv = make_worker(pool, max_tasks=1)
    await pool.admit("someone-else/0")
    pool.finish("someone-else/0", None)
    with pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as n:
            n.start_soon(w.run, TaskSource("x", tasks=[TASK]))
    assert info.group_contains(RuntimeError, match="at most one environment worker may pace through a pool", depth=None)


async def test_attempts_per_step_must_be_a_multiple_of_the_group_size():
    w, ctx, recv = make_worker(SamplerPool(attempts_per_step=4))
    with pytest.raises(ValueError, match="attempts_per_step=4 is not a multiple of group_size=3"):
        await w.run(TaskSource("x", tasks=[TASK]))

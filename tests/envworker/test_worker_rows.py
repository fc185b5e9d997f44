"""The environment worker's row in /status (`fleet_row.WorkerRow`, its statistics'
``worker_rows``), read while a group runs against an in-memory sandbox pool (no Docker):
the attempts running, the group held, the sandboxes leased and warm as the pool's own
statistics say, then the group done and the failed try counted by kind."""

from __future__ import annotations

from contextlib import asynccontextmanager
from types import SimpleNamespace

import msgspec
import structlog
import trio

from fleetrl.actors.envworker import EnvWorkerStatistics, WorkerRow
from fleetrl.actors.envworker.config import EnvWorkerConfig
from fleetrl.actors.envworker.cursor import TaskCursor
from fleetrl.actors.envworker.fleet_row import sandbox_counts
from fleetrl.actors.envworker.worker import _Worker
from fleetrl.daemon.handles import statistics_of
from fleetrl.daemon.messages import RolloutFailed, RolloutGroup
from fleetrl.daemon.metrics import ActorMetrics, MetricsRegistry
from fleetrl.harness.builtin import CompletionHarness
from fleetrl.harness.tasks import Evaluator, Task
from fleetrl.sandboxes.metrics import SandboxMetrics

from .conftest import Result
from .test_attempt_outcomes import MemorySandbox, ScriptedModel

TASK = Task(id="t", prompt="def f(x):\n", evaluator=Evaluator(command="check", reward="json"))


class CountingPool:
    """Leases in-memory sandboxes; its statistics count the leased and the warm (one idle
    container per lease that ended), like `sandboxes.SandboxPool.statistics`."""

    def __init__(self) -> None:
        self.leased = 0
        self.idle = 0

    def statistics(self):
        return msgspec.structs.replace(SandboxMetrics().snapshot(), leases_active=self.leased, idle=self.idle)

    @asynccontextmanager
    async def lease(self, image, limits):
        self.idle = max(0, self.idle - 1)
        self.leased += 1
        try:
            yield MemorySandbox({"check": Result(0, b'{"reward": 0.5}\n')})
        finally:
            self.leased -= 1
            self.idle += 1


class Gated(msgspec.Struct, frozen=True):
    """The completion harness once ``gate`` is set; slot 0's first try raises."""

    gate: object

    async def run(self, task, sandbox, model):
        if model.attempt_id.endswith("/0.1"):
            raise RuntimeError("first try of slot 0")
        await self.gate.wait()
        return await CompletionHarness(max_tokens=3).run(task, sandbox, model)


class AttemptModel(ScriptedModel):
    def for_attempt(self, attempt_id):
        view = AttemptModel()
        view.attempt_id = attempt_id
        return view


def row_of(w: _Worker) -> dict:
    """The worker's statistics as /status carries them (plain data), and its one row."""
    stats = statistics_of(w)
    assert stats is not None and "error" not in stats, stats
    (row,) = stats["worker_rows"]
    assert msgspec.convert(row, WorkerRow) == w.row()  # the typed row and the JSON agree
    return row


async def test_the_row_follows_a_running_group_and_its_sandboxes():
    config = msgspec.convert({"model": {"kind": "local", "model_dir": "unused"}, "group_size": 3,
                              "max_concurrent_attempts": 3, "retry": {"max_tries": {"harness_crash": 2}},
                              "sandbox": {"max_warm": 2, "max_containers": 5}}, EnvWorkerConfig)
    ctx = SimpleNamespace(log=structlog.get_logger(), metrics=ActorMetrics(MetricsRegistry(), "env"),
                          draining=False, name="env-a")
    send, recv = trio.open_memory_channel(100)
    gate = trio.Event()
    pool = CountingPool()
    w = _Worker(config, ctx, harness=Gated(gate), model=AttemptModel(), pool=pool, out=send, failures_out=send,
                cursor=TaskCursor())
    idle = row_of(w)
    assert idle == {"worker": "env-a", "host": idle["host"], "remote": False, "address": "", "attempts_running": 0,
                    "groups_running": 0, "groups": {}, "failures": {}, "sandboxes_warm": 0, "sandboxes_leased": 0,
                    "sandboxes_limit": 5, "health": "up", "last_seen_s": None, "ended": None}
    assert idle["host"]
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            n.start_soon(w.group, w.cursor.take(), TASK, trio.Semaphore(0))
            while row_of(w)["attempts_running"] < 3:  # slot 0 failed once and runs its second try
                await trio.sleep(0.01)
            running = row_of(w)
            assert running["groups_running"] == 1 and running["sandboxes_leased"] == 3 == pool.leased
            assert running["failures"] == {"harness_crash": 1} and running["groups"] == {}
            gate.set()
    done = row_of(w)
    assert done["attempts_running"] == 0 and done["groups_running"] == 0
    assert done["groups"] == {"emitted": 1} and done["failures"] == {"harness_crash": 1}
    assert done["sandboxes_leased"] == 0 and done["sandboxes_warm"] == pool.idle > 0
    msgs = []
    while True:
        try:
            msgs.append(recv.receive_nowait())
        except trio.WouldBlock:
            break
    assert [type(m) for m in msgs] == [RolloutFailed, RolloutGroup]
    ctx.draining = True
    assert row_of(w)["health"] == "draining"
    # the statistics' other fields are unchanged by the row
    assert isinstance(w.statistics(), EnvWorkerStatistics) and w.statistics().groups == {"emitted": 1}


def test_a_pool_without_statistics_reports_no_sandbox_counts():
    assert sandbox_counts(object()) == (None, None)
    assert sandbox_counts(CountingPool()) == (0, 0)

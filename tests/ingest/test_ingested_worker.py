"""The environment worker's task loop over the ``ingested`` source (in memory: fake
sandboxes and a scripted model): it waits while the store is empty, runs a task
ingested while it waits, and stops waiting when the daemon drains."""

from __future__ import annotations

from contextlib import asynccontextmanager

import msgspec
import structlog
import trio
from ingest_traces import body, session

from fleetrl.actors.envworker.config import EnvWorkerConfig, IngestedTasks
from fleetrl.actors.envworker.cursor import TaskCursor
from fleetrl.actors.envworker.sources import open_task_source
from fleetrl.actors.envworker.worker import _Worker
from fleetrl.actors.ingest import TaskStore, parse
from fleetrl.daemon.examples import example_generation
from fleetrl.daemon.messages import RolloutGroup
from fleetrl.daemon.metrics import ActorMetrics, MetricsRegistry
from fleetrl.harness.builtin import CompletionHarness


class Result(msgspec.Struct):
    exit_code: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False


class Box:
    async def exec(self, cmd, *, timeout=None, stdin=None, env=None, workdir=None):
        await trio.sleep(0)
        return Result(0)

    async def exec_many(self, programs, *, final=False):
        await trio.sleep(0)
        return [Result(i % 2) for i, _ in enumerate(programs)]

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


class Model:
    def __init__(self) -> None:
        from fleetrl.actors.model import build_byte_tokenizer
        from fleetrl.harness.model import HFChatTokenizer

        self._tok = HFChatTokenizer(build_byte_tokenizer())

    @property
    def tokenizer(self):
        return self._tok

    def for_attempt(self, attempt_id):
        return self

    async def generate(self, prompt_ids, params):
        await trio.sleep(0)
        return example_generation(3, 1, vocab=259)


def add(store_dir, *ids):
    tasks, _ = parse(body(*(session(i) for i in ids)), "fleetrl", "t")
    with TaskStore(store_dir) as st:
        st.append(tasks, origin="test")


async def test_the_worker_waits_for_ingested_tasks_and_runs_them(tmp_path):
    cfg = msgspec.convert({"model": {"kind": "pool", "tokenizer_dir": "unused", "pacing": False},
                           "tasks": {"kind": "ingested", "poll_s": 0.01}, "group_size": 2,
                           "max_concurrent_attempts": 2}, EnvWorkerConfig)
    assert isinstance(cfg.tasks, IngestedTasks)
    source = open_task_source(cfg.tasks, None, daemon_dir=tmp_path, state_dir=tmp_path / "actors" / "env")
    ctx = Ctx()
    send, recv = trio.open_memory_channel(100)
    cursor = TaskCursor()
    worker = _Worker(cfg, ctx, harness=CompletionHarness(max_tokens=4), model=Model(), pool=Pool(), out=send,
                     failures_out=send, cursor=cursor)
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            n.start_soon(worker.run, source)
            await trio.sleep(0.2)
            assert worker.tasks_taken == 0  # nothing ingested yet: it waits
            await trio.to_thread.run_sync(add, tmp_path / "ingest", 1)
            group = await recv.receive()
            assert isinstance(group, RolloutGroup) and group.task_id == "trace:s01"
            assert group.group_id == "trace:s01#0@env"
            await trio.sleep(0.1)
            ctx.drain()  # the worker is waiting for task 1: draining ends the wait
    assert worker.tasks_taken == 1 and cursor.state().floor == 1

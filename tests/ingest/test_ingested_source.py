"""The ``ingested`` task source (actors/envworker/ingested.py): ingested tasks first,
each once, the same task number -> task after a restart, waiting when there is none."""

from __future__ import annotations

import trio
from ingest_traces import body, session

from fleetrl.actors.envworker.config import EnvWorkerConfig, IngestedTasks, SyntheticTasks
from fleetrl.actors.envworker.ingested import IngestedSource
from fleetrl.actors.envworker.sources import open_task_source
from fleetrl.actors.ingest import TaskStore, parse
from fleetrl.harness.synthetic import make_task


def add(store_dir, *ids):
    tasks, _ = parse(body(*(session(i) for i in ids)), "fleetrl", "t")
    with TaskStore(store_dir) as st:
        st.append(tasks, origin="test")


def source(tmp_path, base=True):
    return open_task_source(IngestedTasks(base=SyntheticTasks(seed=1) if base else None, poll_s=0.01), None,
                            daemon_dir=tmp_path, state_dir=tmp_path / "actors" / "env")


def test_config_parses_with_a_base():
    import msgspec
    cfg = msgspec.convert({"model": {"kind": "local", "model_dir": "m"},
                           "tasks": {"kind": "ingested", "base": {"kind": "synthetic", "seed": 3}}}, EnvWorkerConfig)
    assert cfg.tasks == IngestedTasks(base=SyntheticTasks(seed=3))


def test_ingested_tasks_come_before_the_base_and_run_once(tmp_path):
    add(tmp_path / "ingest", 1)
    src = source(tmp_path)
    assert src.get(0).id == "trace:s01"
    assert src.get(1) == make_task(1, "train", 0)
    add(tmp_path / "ingest", 2, 1)  # s01 again: a duplicate, not stored twice
    assert src.get(2).id == "trace:s02"  # taken before the base's next task
    assert src.get(3) == make_task(1, "train", 1)
    assert src.get(4) == make_task(1, "train", 2)


def test_a_restart_gives_every_decided_number_the_same_task(tmp_path):
    add(tmp_path / "ingest", 1)
    first = source(tmp_path)
    got = [first.get(i) for i in range(3)]
    add(tmp_path / "ingest", 2)
    again = source(tmp_path)  # a restarted worker: the cursor may take 0..2 again
    assert [again.get(i) for i in range(3)] == got
    assert again.get(3).id == "trace:s02"
    assert again.get(4) == make_task(1, "train", 2)


def test_switching_a_run_to_this_source_continues_the_base_numbering(tmp_path):
    src = source(tmp_path)
    assert src.get(100) == make_task(1, "train", 100)


async def test_without_a_base_the_worker_waits_for_the_next_ingested_task(tmp_path):
    src = source(tmp_path, base=False)
    assert isinstance(src, IngestedSource) and src.get(0) is None
    got = []

    async def take():
        got.append(await src.wait_get(0))
    with trio.fail_after(10):
        async with trio.open_nursery() as n:
            n.start_soon(take)
            await trio.sleep(0.05)
            assert got == []
            await trio.to_thread.run_sync(add, tmp_path / "ingest", 7)
    assert got[0].id == "trace:s07"

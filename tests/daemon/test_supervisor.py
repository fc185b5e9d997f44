"""The supervisor in-process: restart/backoff, escalation, backpressure, drain,
pause, checkpoint hooks. Timing runs on Trio's autojump clock."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import msgspec
import pytest
import structlog
import trio
import trio.testing
from helpers import supervisor_for

from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.daemon.faults import ExitCode
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor, run_inline

BASE = """
[daemon]
grace_s = 5.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
[supervisor.restart]
backoff_base_s = 0.5
backoff_factor = 2.0
backoff_max_s = 4.0
jitter = 0.0
intensity = 5
period_s = 60.0
"""


def make(tmp_path: Path, actors: str, base: str = BASE) -> tuple[Supervisor, StateDir]:
    return supervisor_for(tmp_path, base + actors, inline=True)


async def test_crashing_actor_is_restarted_with_exponential_backoff(
        tmp_path, test_actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.flaky]
factory = "daemon_test_actors:crasher"
config = {tag = "flaky", crash_until = 3}
""")
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            while sup.status()["actors"]["flaky"]["state"] != "running" or \
                    sup.status()["actors"]["flaky"]["incarnation"] < 4:
                await trio.sleep(0.01)
            status = sup.status()["actors"]["flaky"]
            sup.request_shutdown("test")
    starts = test_actors.PROGRESS["flaky"]["starts"]
    gaps = [round(b - a, 6) for a, b in zip(starts, starts[1:])]
    assert gaps == [0.5, 1.0, 2.0]
    assert status["restarts"] == 3
    assert status["last_error"] == "RuntimeError: boom #3"
    assert b'fleetrl_actor_restarts_total{actor="flaky"} 3.0' in sup.metrics_text()


async def test_crash_before_started_is_restarted_and_dependents_wait(
        tmp_path, test_actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.first]
factory = "daemon_test_actors:crasher"
config = {tag = "first", crash_until = 2, before_started = true}
[actors.second]
factory = "daemon_test_actors:crasher"
after = ["first"]
config = {tag = "second", crash_until = 0}
""")
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            sup.request_shutdown("test")
    first = test_actors.PROGRESS["first"]["starts"]
    second = test_actors.PROGRESS["second"]["starts"]
    assert len(first) == 3
    assert second[0] >= first[2]  # started only once `first` was ready


async def test_crash_loop_escalates_with_exit_code_and_log_line(
        tmp_path, test_actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.doomed]
factory = "daemon_test_actors:crasher"
config = {tag = "doomed"}
restart = {intensity = 2, period_s = 100.0}
[actors.bystander]
factory = "daemon_test_actors:crasher"
config = {tag = "bystander", crash_until = 0}
""")
    with state, trio.fail_after(100), structlog.testing.capture_logs() as logs:
        code = await sup.run(handle_signals=False)
    assert code == ExitCode.ESCALATED
    assert sup.escalation is not None and sup.escalation.actor == "doomed"
    assert "boom #3" in str(sup.escalation)
    line = [e for e in logs if e["event"] == "actor escalated"]
    assert len(line) == 1
    assert line[0]["failed_actor"] == "doomed"
    assert line[0]["last_error"] == "RuntimeError: boom #3"
    assert len(test_actors.PROGRESS["doomed"]["starts"]) == 3
    assert sup.status()["actors"]["bystander"]["state"] == "cancelled"


async def test_slow_consumer_blocks_its_producer(tmp_path, test_actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.sink]
factory = "daemon_test_actors:consumer"
inbox = 4
config = {tag = "bp", delay_s = 1.0}
[actors.source]
factory = "daemon_test_actors:producer"
after = ["sink"]
config = {tag = "bp", target = "sink"}
""", BASE.replace("grace_s = 5.0", "grace_s = 30.0"))
    rec = test_actors.PROGRESS["bp"]
    with state, trio.fail_after(1000):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            for _ in range(50):
                await trio.sleep(1.0)
                used, cap = sup.inbox_stats()["sink"]
                assert used <= cap == 4
                # at most: buffer + one in the consumer's hands + one per 1s step
                assert len(rec["sent"]) - len(rec["got"]) <= 4 + 1
            sup.request_shutdown("test")
    assert 45 <= len(rec["got"]) <= 60
    assert rec["got"] == list(range(len(rec["got"])))
    assert rec["sent"] == rec["got"]  # drain: nothing accepted is lost
    assert rec["ended"] == [True]


async def test_drain_ends_pipeline_and_final_checkpoint_runs_hooks(
        tmp_path, test_actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.w]
factory = "daemon_test_actors:worker"
config = {unit_s = 1.0}
""")
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await trio.sleep(3.5)  # mid-unit
            sup.request_shutdown("test")
    ckpt, problems = CheckpointStore(state.checkpoints).load_latest()
    assert problems == [] and ckpt is not None
    assert ckpt.actors["w"] == {"done": 4}  # the in-flight unit finished
    assert sup.status()["actors"]["w"]["state"] == "finished"


async def test_grace_deadline_cancels_a_stuck_actor(tmp_path, test_actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.w]
factory = "daemon_test_actors:worker"
config = {unit_s = 1.0, stubborn = true}
""")
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await trio.sleep(2.5)
            t0 = trio.current_time()
            sup.request_shutdown("test")
        assert trio.current_time() - t0 == pytest.approx(5.0)
    ckpt, _ = CheckpointStore(state.checkpoints).load_latest()
    assert ckpt.actors["w"] == {"done": 7}  # hook ran after cancellation
    assert sup.status()["actors"]["w"]["state"] == "cancelled"


async def test_periodic_checkpoints_are_written_and_pruned(
        tmp_path, test_actors, autojump_clock):
    base = BASE.replace("checkpoint_interval_s = 1000.0", "checkpoint_interval_s = 2.0")
    sup, state = make(tmp_path, """
[actors.w]
factory = "daemon_test_actors:worker"
config = {unit_s = 1.0}
""", base)
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await trio.sleep(4.5)
            seq = sup.status()["checkpoint"]["seq"]
            sup.request_shutdown("test")
    assert seq == 2
    files = CheckpointStore(state.checkpoints).files()
    assert len(files) == 3  # two periodic + final, keep = 3


async def test_hook_failure_keeps_previous_state(tmp_path, test_actors, autojump_clock):
    sup, state = make(tmp_path, "")
    good = {"n": 1}

    async def ok():
        return good

    async def bad():
        raise ValueError("cannot snapshot")

    with state, structlog.testing.capture_logs() as logs:
        sup.set_hook("a", ok)
        await sup.checkpoint()
        sup.set_hook("a", bad)
        await sup.checkpoint()
    ckpt, _ = CheckpointStore(state.checkpoints).load_latest()
    assert ckpt.seq == 2 and ckpt.actors == {"a": {"n": 1}}
    failed = [e for e in logs if e["event"].startswith("checkpoint hook failed")]
    assert failed and failed[0]["failed_actor"] == "a"
    assert "cannot snapshot" in failed[0]["error"]


async def test_restart_resumes_from_newest_checkpoint(tmp_path, test_actors, autojump_clock):
    actors = """
[actors.w]
factory = "daemon_test_actors:worker"
config = {unit_s = 1.0}
"""
    sup, state = make(tmp_path, actors)
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await trio.sleep(2.5)
            sup.request_shutdown("test")
    first, _ = CheckpointStore(state.checkpoints).load_latest()
    sup2, state2 = make(tmp_path, actors)
    with state2, structlog.testing.capture_logs() as logs, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup2.run, handle_signals=False))
            sup2.request_shutdown("test")
    started = [e for e in logs if e["event"] == "worker started"]
    assert started[0]["restored_done"] == first.actors["w"]["done"] == 3
    assert state2.run_id == state.run_id


async def test_pause_blocks_work_until_resume(tmp_path, test_actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.sink]
factory = "daemon_test_actors:consumer"
config = {tag = "p", delay_s = 0.1}
[actors.source]
factory = "daemon_test_actors:producer"
config = {tag = "p", target = "sink", count = 1000000}
""")
    rec = test_actors.PROGRESS["p"]
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            sup.pause()
            await trio.sleep(1)
            frozen = len(rec["sent"])
            await trio.sleep(10)
            assert len(rec["sent"]) == frozen
            assert sup.status()["paused"] is True
            sup.resume()
            await trio.sleep(1)
            assert len(rec["sent"]) > frozen
            sup.request_shutdown("test")


async def test_restored_as_decodes_struct_and_bytes(tmp_path):
    from fleetrl.daemon.actor import ActorContext

    class S(msgspec.Struct):
        x: int

    def ctx(restored):
        send, recv = trio.open_memory_channel(1)
        return ActorContext(name="a", kernel=None, inbox=recv, state_dir=tmp_path,
                            restored=restored, incarnation=1, log=None, metrics=None)

    assert ctx({"x": 3}).restored_as(S) == S(3)
    assert ctx(msgspec.msgpack.encode(S(4))).restored_as(S) == S(4)
    assert ctx(None).restored_as(S) is None
    with pytest.raises(msgspec.ValidationError):
        ctx({"x": "no"}).restored_as(S)


async def test_restarted_actor_gets_the_state_last_checkpointed(
        tmp_path, test_actors, autojump_clock):
    base = BASE.replace("checkpoint_interval_s = 1000.0", "checkpoint_interval_s = 2.5")
    sup, state = make(tmp_path, """
[actors.w]
factory = "daemon_test_actors:worker"
config = {unit_s = 1.0, crash_at = 3}
""", base)
    with state, structlog.testing.capture_logs() as logs, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await trio.sleep(4.0)  # checkpoint at 2.5 (done=2), crash at 3.0, restart 3.5
            sup.request_shutdown("test")
    started = [e["restored_done"] for e in logs if e["event"] == "worker started"]
    assert started == [0, 2]
    assert sup.status()["actors"]["w"]["restarts"] == 1


async def test_default_config_heartbeat_counts_and_resumes(tmp_path, autojump_clock):
    from fleetrl.daemon.config import default_config_path, load_config

    cfg = load_config(default_config_path())
    # The heartbeat alone: the sandbox janitor (needs Docker) is tested in tests/actors.
    cfg = msgspec.structs.replace(cfg, http=msgspec.structs.replace(cfg.http, enabled=False),
                                  actors=tuple(a for a in cfg.actors if a.name == "heartbeat"))
    for expected_start, expected_end in [(0, 5), (5, 10)]:
        state = StateDir(tmp_path / "state").open()
        sup = Supervisor(cfg, state, run_blocking=run_inline)
        with state, trio.fail_after(100):
            async with trio.open_nursery() as n:
                await n.start(partial(sup.run, handle_signals=False))
                assert sup.status()["actors"]["heartbeat"]["versions"]["ticks"] == expected_start
                await trio.sleep(5.5)
                sup.pause()
                await trio.sleep(10)
                sup.request_shutdown("test")
        ckpt, _ = CheckpointStore(state.checkpoints).load_latest()
        assert ckpt.actors["heartbeat"] == {"ticks": expected_end}
        assert b'fleetrl_ticker_ticks{actor="heartbeat"} %d.0' % expected_end in sup.metrics_text()


async def test_corrupted_newest_checkpoint_falls_back_with_a_warning(
        tmp_path, test_actors, autojump_clock):
    actors = """
[actors.w]
factory = "daemon_test_actors:worker"
config = {unit_s = 1.0}
"""
    base = BASE.replace("checkpoint_interval_s = 1000.0", "checkpoint_interval_s = 2.5")
    sup, state = make(tmp_path, actors, base)
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await trio.sleep(5.2)  # periodic at 2.5 (done=2) and 5.0 (done=5)
            sup.request_shutdown("test")
    store = CheckpointStore(state.checkpoints)
    newest, previous = store.files()[:2]
    newest.write_bytes(newest.read_bytes()[:-1])
    expected = store.load_latest()[0].actors["w"]["done"]
    assert expected == 5
    sup2, state2 = make(tmp_path, actors)
    with state2, structlog.testing.capture_logs() as logs, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup2.run, handle_signals=False))
            sup2.request_shutdown("test")
    warned = [e for e in logs if e["event"].startswith("checkpoint unusable")]
    assert len(warned) == 1 and str(newest) in warned[0]["problem"]
    assert [e["restored_done"] for e in logs if e["event"] == "worker started"] == [5]

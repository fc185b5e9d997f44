"""Actors asking the kernel: ``ctx.request_shutdown`` ends the daemon cleanly (exit 0,
final checkpoint), ``ctx.request_checkpoint`` writes a checkpoint at once, and hooks
run producers first (reverse ``after`` order). Autojump clock, in-process supervisor."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import trio
from helpers import supervisor_for

from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.daemon.faults import ExitCode
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor

HERE = Path(__file__).resolve().parent

BASE = """
[daemon]
grace_s = 5.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
[supervisor.restart]
jitter = 0.0
"""


@pytest.fixture
def actors(actors_module) -> object:
    return actors_module("request_test_actors", "LOG")


def make(tmp_path: Path, text: str) -> tuple[Supervisor, StateDir]:
    return supervisor_for(tmp_path, BASE + text, inline=True)


async def test_request_shutdown_drains_writes_final_checkpoint_and_exits_ok(tmp_path, actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.job]
factory = "request_test_actors:quitter"
config = {tag = "job", steps = 3, reason = "budget reached"}
[actors.other]
factory = "request_test_actors:idle"
config = {tag = "other"}
""")
    with state, trio.fail_after(100):
        code = await sup.run(handle_signals=False)
    assert code == ExitCode.OK
    log = actors.LOG["job"]
    assert ("requested", 3) in log and ("drained", 3) in log
    assert sup._shutdown_reason == "requested by actor 'job': budget reached"
    ckpt, _ = CheckpointStore(state.checkpoints).load_latest()
    assert ckpt is not None and ckpt.actors["job"] == 3 and ckpt.actors["other"] == "other"
    assert sup.status()["phase"] == "stopped"
    assert {n: a["state"] for n, a in sup.status()["actors"].items()} == {"job": "finished", "other": "finished"}


async def test_halt_drains_checkpoints_and_exits_halted_naming_the_actor(tmp_path, actors, autojump_clock):
    """``ctx.halt``: an error no restart can fix ends the run like a requested shutdown
    (drain, final checkpoint), but with exit code 7 and the reason in /status."""
    sup, state = make(tmp_path, """
[actors.job]
factory = "request_test_actors:quitter"
config = {tag = "job", steps = 2, reason = "every token masked", halt = true}
[actors.other]
factory = "request_test_actors:idle"
config = {tag = "other"}
""")
    with state, trio.fail_after(100):
        code = await sup.run(handle_signals=False)
    assert code == ExitCode.HALTED == 7
    assert ("drained", 2) in actors.LOG["job"]
    assert sup.status()["halted"] == "actor 'job': every token masked"
    ckpt, _ = CheckpointStore(state.checkpoints).load_latest()
    assert ckpt is not None and ckpt.actors["job"] == 2


async def test_request_shutdown_refuses_an_empty_reason(tmp_path, actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.job]
factory = "request_test_actors:quitter"
restart = {intensity = 1, backoff_base_s = 0.1}
config = {tag = "job", steps = 1, reason = " "}
""")
    with state, trio.fail_after(100):
        code = await sup.run(handle_signals=False)
    assert code == ExitCode.ESCALATED  # the actor crashed on the ValueError, twice
    refused = [e for e in actors.LOG["job"] if e[0] == "refused"]
    assert refused and "reason must be a non-empty string" in refused[0][1]


async def test_request_checkpoint_writes_one_at_once(tmp_path, actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.job]
factory = "request_test_actors:quitter"
config = {tag = "job", steps = 50, checkpoint_at = 2}
""")
    store = CheckpointStore(state.checkpoints)
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            while ("checkpointed", 2) not in actors.LOG.get("job", []):
                await trio.sleep(0.5)
            ckpt, _ = store.load_latest()
            assert ckpt is not None and ckpt.actors["job"] == 2  # written before it returned
            assert sup.status()["checkpoint"]["reason"] == "requested by actor 'job': tick 2"
            sup.request_shutdown("test")


async def test_hooks_run_producers_first(tmp_path, actors, autojump_clock):
    # start order: sink, middle, source (each after the previous); hooks: the reverse
    sup, state = make(tmp_path, """
[actors.source]
factory = "request_test_actors:idle"
after = ["middle"]
config = {tag = "source"}
[actors.sink]
factory = "request_test_actors:idle"
config = {tag = "sink"}
[actors.middle]
factory = "request_test_actors:idle"
after = ["sink"]
config = {tag = "middle"}
""")
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await sup.checkpoint("test")
            assert actors.LOG["hooks"] == ["source", "middle", "sink"]
            sup.request_shutdown("test")
    assert actors.LOG["hooks"][3:] == ["source", "middle", "sink"]  # the final checkpoint too


@pytest.mark.parametrize("target, want", [("srv", ("answer", "answer to q")), ("other", "refused")])
async def test_a_handle_asked_for_as_a_kind_is_checked_and_typed(tmp_path, actors, autojump_clock, target, want):
    """``ctx.handle(name, Kind)``: the handle of an actor of the right kind comes back; a
    config naming another actor fails at once with WrongHandle naming both actors and
    what the handle lacks."""
    sup, state = make(tmp_path, f"""
[actors.srv]
factory = "request_test_actors:server"
[actors.other]
factory = "request_test_actors:idle"
config = {{tag = "other"}}
[actors.ask]
factory = "request_test_actors:asker"
after = ["srv", "other"]
config = {{target = "{target}"}}
""")
    with state, trio.fail_after(100):
        assert await sup.run(handle_signals=False) == ExitCode.OK
    [got] = actors.LOG["asker"]
    if want == "refused":
        assert got[:2] == ("refused", "WrongHandle")
        assert "actor 'ask' needs actor 'other' to be a Generator" in got[2] and "it has no generate" in got[2]
    else:
        assert got == want

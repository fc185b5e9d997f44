"""Kernel-owned actor handles: ``task_status.started(handle)``, ``await ctx.handle(name)``,
statistics in /status and /metrics, drain by channel closing, restarts. Autojump clock."""

from __future__ import annotations

from functools import partial

import pytest
import trio
from helpers import supervisor_for

from fleetrl.daemon.faults import ExitCode
from fleetrl.daemon.handles import HandleTable, numeric_fields, statistics_of
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor

BASE = """
[daemon]
grace_s = 30.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
[supervisor.restart]
backoff_base_s = 0.5
jitter = 0.0
intensity = 5
period_s = 60.0
"""


@pytest.fixture
def actors(actors_module):
    return actors_module("handle_test_actors", "EVENTS")


def make(tmp_path, text: str) -> tuple[Supervisor, StateDir]:
    return supervisor_for(tmp_path, BASE + text, inline=True)


SERVER_CLIENT = """
[actors.server]
factory = "handle_test_actors:server"
[actors.client]
factory = "handle_test_actors:client"
after = ["server"]
"""


async def test_a_client_reaches_the_server_through_its_handle_and_status_shows_statistics(
        tmp_path, actors, autojump_clock):
    sup, state = make(tmp_path, SERVER_CLIENT)
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await trio.sleep(5)
            status = sup.status()["actors"]
            metrics = sup.metrics_text().decode()
            sup.request_shutdown("test")
    stats = status["server"]["statistics"]
    assert stats["calls"] >= 5 and stats["incarnation"] == 1 and stats["serving"] is True
    assert status["client"]["statistics"] is None  # it started with no handle
    assert f'fleetrl_actor_statistic{{actor="server",name="calls"}} {float(stats["calls"])}' in metrics
    assert 'fleetrl_actor_statistic{actor="server",name="serving"} 1.0' in metrics
    assert ("client called", 1) in actors.EVENTS


async def test_the_server_drains_only_after_every_handle_holder_has_returned(
        tmp_path, actors, autojump_clock):
    """No sleep loop: the server's inbox ends once the client (a holder) has returned,
    so the calls the client makes during its drain linger are all served."""
    sup, state = make(tmp_path, SERVER_CLIENT)
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await trio.sleep(2)
            sup.request_shutdown("test")
    names = [e[0] for e in actors.EVENTS]
    assert names.index("client returned") < names.index("server inbox ended")
    returned = dict(actors.EVENTS)["client returned"]
    assert dict(actors.EVENTS)["server inbox ended"] == returned  # every call was served


async def test_a_restarted_server_is_found_again_and_sees_its_previous_handle(
        tmp_path, actors, autojump_clock):
    sup, state = make(tmp_path, SERVER_CLIENT.replace(
        'factory = "handle_test_actors:server"',
        'factory = "handle_test_actors:server"\nconfig = { crash_until = 1, crash_after_s = 2.0 }'))
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await trio.sleep(6)
            status = sup.status()["actors"]["server"]
            sup.request_shutdown("test")
    assert status["restarts"] == 1 and status["statistics"]["incarnation"] == 2
    started = [e[1] for e in actors.EVENTS if e[0] == "server started"]
    assert started[0] == (1, None)
    assert started[1][0] == 2 and started[1][1] >= 3  # the first incarnation's count carried over
    called = [e[1] for e in actors.EVENTS if e[0] == "client called"]
    assert called[0] == 1 and called[-1] == 2  # the client followed the restart


async def test_asking_for_an_unknown_or_later_actor_is_a_clear_error(tmp_path, actors, autojump_clock):
    sup, state = make(tmp_path, """
[actors.client]
factory = "handle_test_actors:client"
config = { early = true }
[actors.server]
factory = "handle_test_actors:server"
""")
    with state, trio.fail_after(100):
        code = await sup.run(handle_signals=False)  # it would wait for ever: it escalates instead
    status = sup.status()["actors"]["client"]
    assert code == ExitCode.ESCALATED
    assert "ValueError" in status["last_error"]
    assert "'server', which starts after it" in status["last_error"]
    assert "after = [...]" in status["last_error"]
    with pytest.raises(KeyError, match="no actor named 'nobody'"):
        await sup.wait_handle("nobody", asker="client")


async def test_handle_table_waits_publishes_and_retracts(autojump_clock):
    table = HandleTable(["a"])
    got = []

    async def waiter() -> None:
        got.append(await table.wait("a"))

    async with trio.open_nursery() as n:
        n.start_soon(waiter)
        await trio.sleep(1)
        assert got == []
        table.publish("a", "first")
    assert got == ["first"] and table.previous("a") is None
    table.retract("a")
    assert table.previous("a") == "first" and table.statistics() == {}
    with trio.move_on_after(1) as scope:
        await table.wait("a")
    assert scope.cancelled_caught  # retracted: waiters wait for the next incarnation


def test_statistics_of_reads_records_and_survives_a_broken_one():
    import dataclasses

    import msgspec

    class S(msgspec.Struct, frozen=True):
        n: int
        label: str

    @dataclasses.dataclass(frozen=True)
    class D:
        x: float

    class Broken:
        def statistics(self):
            raise RuntimeError("bad bookkeeping")

    assert statistics_of(object()) is None
    assert statistics_of(type("H", (), {"statistics": lambda self: S(3, "x")})()) == {"n": 3, "label": "x"}
    assert statistics_of(type("H", (), {"statistics": lambda self: D(0.5)})()) == {"x": 0.5}
    assert statistics_of(Broken()) == {"error": "RuntimeError: bad bookkeeping"}
    assert list(numeric_fields({"a": 1, "b": True, "c": "no", "d": float("nan"), "e": 2.5})) == [
        ("a", 1.0), ("b", 1.0), ("e", 2.5)]

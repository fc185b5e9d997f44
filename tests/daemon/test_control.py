"""The control plane over real HTTP on 127.0.0.1 (hypercorn's Trio worker)."""

from __future__ import annotations

import random
import stat
from functools import partial

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.state import read_control
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor

CONFIG = """
[daemon]
grace_s = 5.0
[http]
port = 0
[actors.heartbeat]
factory = "fleetrl.daemon.ticker:run"
config = {interval_s = 0.05, log_every = 0}
[actors.echo]
factory = "daemon_test_actors:mounter"
config = {prefix = "/echo"}
[actors.open]
factory = "daemon_test_actors:mounter"
config = {prefix = "/public", auth = false}
"""

ENDPOINTS = [("GET", "/status"), ("GET", "/metrics"), ("POST", "/pause"),
             ("POST", "/resume"), ("POST", "/shutdown"), ("GET", "/echo/x")]


@pytest.fixture
async def daemon(tmp_path, test_actors):
    cfg = load_config_text(CONFIG, source="control.toml")
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(cfg, state, rng=random.Random(0))
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            host, port = read_control(state.path)
            assert (host, port) == sup.control_address
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as client:
                yield sup, state, client
            sup.request_shutdown("test over")
    state.close()


def auth(state: StateDir) -> dict[str, str]:
    return {"Authorization": f"Bearer {state.token}"}


@pytest.mark.parametrize("method,path", ENDPOINTS)
@pytest.mark.parametrize("header", [None, "Bearer wrong-token", "Basic abc", "Bearer"])
async def test_endpoints_reject_missing_or_wrong_token(daemon, method, path, header):
    sup, _state, client = daemon
    headers = {"Authorization": header} if header is not None else {}
    with trio.fail_after(10):
        resp = await client.request(method, path, headers=headers)
    assert resp.status_code == 401
    assert resp.json()["error"] == "unauthorized"
    assert resp.headers["www-authenticate"].startswith("Bearer")
    assert not sup.draining_event.is_set() and not sup.gate.closed


async def test_healthz_is_open_and_token_file_is_private(daemon):
    _sup, state, client = daemon
    with trio.fail_after(10):
        resp = await client.get("/healthz")
    assert resp.status_code == 200 and resp.json() == {"ok": True}
    assert stat.S_IMODE((state.path / "token").stat().st_mode) == 0o600


async def test_status_reports_actors_and_versions(daemon):
    sup, state, client = daemon
    with trio.fail_after(10):
        await trio.sleep(0.2)
        body = (await client.get("/status", headers=auth(state))).json()
    assert body["run_id"] == state.run_id and body["instance_id"] == state.instance_id
    assert body["paused"] is False and body["draining"] is False
    hb = body["actors"]["heartbeat"]
    assert hb["state"] == "running" and hb["restarts"] == 0 and hb["last_error"] is None
    assert hb["versions"]["ticks"] >= 1
    assert body["mounts"] == ["/echo", "/public"]


async def test_metrics_parse_with_prometheus_parser(daemon):
    _sup, state, client = daemon
    with trio.fail_after(10):
        await trio.sleep(0.2)
        resp = await client.get("/metrics", headers=auth(state))
    assert resp.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    ticks = [s for s in families["fleetrl_ticker_ticks"].samples
             if s.labels == {"actor": "heartbeat"}]
    assert ticks and ticks[0].value >= 1
    assert "fleetrl_actor_up" in families and "fleetrl_inbox_capacity" in families
    up = {s.labels["actor"]: s.value for s in families["fleetrl_actor_up"].samples}
    assert up["heartbeat"] == 1.0


async def test_pause_resume_and_shutdown(daemon):
    sup, state, client = daemon
    with trio.fail_after(10):
        assert (await client.post("/pause", headers=auth(state))).json() == {"paused": True}
        status = (await client.get("/status", headers=auth(state))).json()
        assert status["paused"] is True
        ticks = status["actors"]["heartbeat"]["versions"]["ticks"]
        await trio.sleep(0.3)
        status = (await client.get("/status", headers=auth(state))).json()
        assert status["actors"]["heartbeat"]["versions"]["ticks"] <= ticks + 1
        assert (await client.post("/resume", headers=auth(state))).json() == {"paused": False}
        resp = await client.post("/shutdown", headers=auth(state))
        assert resp.status_code == 202
        await sup.draining_event.wait()


async def test_mounted_app_gets_prefix_as_root_path(daemon):
    _sup, state, client = daemon
    with trio.fail_after(10):
        resp = await client.get("/echo/a/b", headers=auth(state))
        assert resp.json() == {"root_path": "/echo", "path": "/echo/a/b", "actor": "echo"}
        public = await client.get("/public")
        assert public.status_code == 200 and public.json()["actor"] == "open"
        missing = await client.get("/nope", headers=auth(state))
        assert missing.status_code == 404 and missing.json()["error"] == "not found"
        wrong_method = await client.get("/pause", headers=auth(state))
        assert wrong_method.status_code == 405


def test_mount_table_rejects_bad_prefixes():
    from fleetrl.daemon.control import MountTable

    async def app(scope, receive, send):  # pragma: no cover - never called
        pass

    table = MountTable()
    table.add("/deltas", app, auth=True, owner="weights")
    for bad in ("deltas", "/deltas/", "/status", "/metrics/x", ""):
        with pytest.raises(ValueError, match="mount prefix"):
            table.add(bad, app, auth=True, owner="x")
    with pytest.raises(ValueError, match="already used by actor 'weights'"):
        table.add("/deltas", app, auth=True, owner="other")
    table.add("/deltas", app, auth=False, owner="weights")  # a restart re-mounts
    assert table.match("/deltas/v1").auth is False
    assert table.match("/deltasX") is None


# -- a crash inside hypercorn is contained ------------------------------------------------

def _crash_after(crash: trio.Event):
    async def trigger() -> None:
        await crash.wait()
        raise trio.BusyResourceError("simulated: another task is already sending on this stream")
    return trigger


async def _healthz(port: int) -> int:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        return (await client.get("/healthz")).status_code


async def test_a_crash_inside_hypercorn_restarts_the_server_on_the_same_port():
    """hypercorn 0.18 can raise from one connection and cancel its whole server; the
    control plane serves again on the same socket instead of dying."""
    from hypercorn.trio import serve

    from fleetrl.daemon.control import MountTable, build_app, serve_control

    class Plane:
        def status(self):
            return {}

    crash, stop = trio.Event(), trio.Event()
    calls = []

    async def flaky_serve(app, cfg, *, shutdown_trigger, task_status):
        calls.append(cfg.bind[0])
        trigger = _crash_after(crash) if len(calls) == 1 else shutdown_trigger
        await serve(app, cfg, shutdown_trigger=trigger, task_status=task_status)

    app = build_app(Plane(), "token", MountTable())
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            host, port = await n.start(partial(serve_control, app, "127.0.0.1", 0, shutdown_trigger=stop.wait,
                                               serve_fn=flaky_serve))
            assert await _healthz(port) == 200
            crash.set()
            while len(calls) < 2:
                await trio.sleep(0.01)
            assert await _healthz(port) == 200  # same port, served again
            stop.set()
    assert len(calls) == 2


async def test_a_server_that_keeps_crashing_is_not_restarted_forever():
    from hypercorn.trio import serve

    from fleetrl.daemon.control import MountTable, build_app, serve_control

    class Plane:
        def status(self):
            return {}

    calls = []

    async def always_crashing(app, cfg, *, shutdown_trigger, task_status):
        calls.append(cfg.bind[0])
        crash = trio.Event()
        crash.set()
        await serve(app, cfg, shutdown_trigger=_crash_after(crash), task_status=task_status)

    app = build_app(Plane(), "token", MountTable())
    with trio.fail_after(30), pytest.raises(BaseExceptionGroup) as info:
        async with trio.open_nursery() as n:
            await n.start(partial(serve_control, app, "127.0.0.1", 0, shutdown_trigger=trio.sleep_forever,
                                  serve_fn=always_crashing, max_restarts=2))
    assert info.group_contains(trio.BusyResourceError)
    assert len(calls) == 3


async def test_a_connection_that_sends_its_request_late_is_still_served():
    """A new connection counts as idle until its request is read; a busy server reads
    late. hypercorn's default (5 s) reset such connections; ours waits KEEP_ALIVE_S."""
    from fleetrl.daemon.control import KEEP_ALIVE_S, MountTable, build_app, serve_control

    class Plane:
        def status(self):
            return {}

    assert KEEP_ALIVE_S > 60
    stop = trio.Event()
    app = build_app(Plane(), "token", MountTable())
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            _, port = await n.start(partial(serve_control, app, "127.0.0.1", 0, shutdown_trigger=stop.wait))
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await trio.sleep(6.5)  # past hypercorn's own 5 s
            await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := await stream.receive_some(4096):
                reply += chunk
            await stream.aclose()
            stop.set()
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]

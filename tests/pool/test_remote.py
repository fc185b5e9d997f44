"""Remote samplers over a real WebSocket on 127.0.0.1, mounted on the real control app."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import trio
from fakes import NullControlPlane

from fleetrl.actors.pool.local import LocalSampler
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.pool.remote_client import JoinRefused, RemoteClientConfig, serve_once
from fleetrl.actors.pool.remote_client import connect as open_websocket_url
from fleetrl.actors.pool.remote_server import CLOSE_POLICY, fleet_app
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.daemon import messages as m
from fleetrl.daemon.control import MountTable, build_app, serve_control

from .conftest import request

TOKEN = "fleet-secret"


_Plane = NullControlPlane  # the join endpoint is what is under test

async def _serve(nursery, pool, **kw):
    mounts = MountTable()
    mounts.add("/fleet", fleet_app(pool, token=TOKEN, run_id="run-1", **kw), auth=False, owner="pool")
    stop = trio.Event()
    host, port = await nursery.start(lambda task_status: serve_control(
        build_app(_Plane(), "control-token", mounts), "127.0.0.1", 0,
        shutdown_trigger=stop.wait, task_status=task_status))
    return f"ws://{host}:{port}/fleet/join", stop


def _local(pool, model_dir, sid="local"):
    b = TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))
    s = LocalSampler(sid, b)
    pool.add(s, s.identity, price_per_hour=1.0, capacity=1, remote=False,
             version=0, digest=b.weight_version.digest)


async def _wait_for(pred, step=0.02):
    while not pred():
        await trio.sleep(step)


def _remotes(pool):
    return [sid for sid in pool.handles if sid.startswith("remote-")]


async def test_remote_process_serves_and_sigkill_reroutes(model_dir):
    pool = SamplerPool(policy="least_loaded")
    _local(pool, model_dir)
    with trio.fail_after(180):
        async with trio.open_nursery() as n:
            url, stop = await _serve(n, pool, heartbeat_s=0.5, heartbeat_timeout_s=5.0)
            env = dict(os.environ, OMP_NUM_THREADS="1")
            proc = subprocess.Popen(
                [sys.executable, "-m", "fleetrl.actors.pool.cli", "--join", url, "--token", TOKEN,
                 "--backend", "torch", "--dtype", "bf16", "--model", str(model_dir),
                 "--price-per-hour", "2.5", "--capacity", "2", "--name", "box1"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                await _wait_for(lambda: _remotes(pool) or proc.poll() is not None, 0.05)
                assert proc.poll() is None, proc.stdout.read().decode()
                sid = _remotes(pool)[0]
                rec = pool.registry.get(sid)
                assert (rec.identity.backend, rec.identity.dtype, rec.price_per_hour, rec.capacity) == \
                    ("torch", "bfloat16", 2.5, 2)
                # it serves: a first round, answered by the remote among others
                out = {}

                async def ask(r):
                    out[r.request_id] = await pool.generate(r)

                async with trio.open_nursery() as reqs:
                    for i in range(6):
                        reqs.start_soon(ask, request(i))
                assert {g.sampler.sampler_id for g in out.values()} >= {sid}
                # now kill it while it holds requests
                out.clear()
                async with trio.open_nursery() as reqs:
                    for i in range(10, 16):
                        reqs.start_soon(ask, request(i, max_tokens=60))
                    await _wait_for(lambda: pool.registry.get(sid).running > 0, 0.005)
                    proc.send_signal(signal.SIGKILL)
                assert sorted(out) == [f"r{i}" for i in range(10, 16)]  # nothing lost
                assert all(isinstance(g, m.Generation) for g in out.values()), out
                assert not pool.registry.get(sid).alive and sid not in pool.handles
                assert pool.rerouted >= 1
                assert all(g.sampler.sampler_id == "local" for g in out.values()
                           if g.sampler.sampler_id != sid)
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                proc.stdout.close()
            stop.set()


async def test_wrong_token_is_refused(model_dir):
    pool = SamplerPool()
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url, stop = await _serve(n, pool)
            cfg = RemoteClientConfig(join_url=url, token="not-the-token", model_dir=str(model_dir))
            with pytest.raises(JoinRefused, match="wrong fleet token"):
                await serve_once(cfg, backend)
            # the raw view: Refused, then a close with the policy code
            async with open_websocket_url(url) as ws:
                ident = m.SamplerIdentity(sampler_id="x", backend="torch", device_kind="cpu", dtype="float32")
                await ws.send_message(m.FLEET.encode(m.Join(token="nope", identity=ident)))
                reply = m.FLEET.decode(await ws.get_message())
                assert isinstance(reply, m.Refused)
                with pytest.raises(Exception):
                    await ws.get_message()
                assert ws.closed.code == CLOSE_POLICY
            assert pool.handles == {}
            stop.set()


async def test_a_refused_sampler_that_hangs_up_gets_no_competing_close():
    """The daemon says Refused and then waits for the peer to hang up: a client that
    closes at once (code 4000) completes its own close handshake, the daemon's 1008
    never crosses it. (An immediate daemon-side close raced the client's close inside
    hypercorn, whose BusyResourceError took the whole control plane down with every
    other sampler's connection.) The control plane never restarts meanwhile."""
    pool = SamplerPool()
    ident = m.SamplerIdentity(sampler_id="x", backend="fake", device_kind="cpu", dtype="float32")
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            url, stop = await _serve(n, pool, refuse_linger_s=30.0)
            members = await n.start(_nursery)
            good = await members.start(_member, url)
            await _wait_for(lambda: good in pool.handles)

            async def refused_then_hang_up(codes):
                async with open_websocket_url(url) as ws:
                    await ws.send_message(m.FLEET.encode(m.Join(token="nope", identity=ident)))
                    assert isinstance(m.FLEET.decode(await ws.get_message()), m.Refused)
                    await ws.aclose(code=4000)
                    codes.append(ws.closed.code)
            codes: list[int] = []
            async with trio.open_nursery() as storm:
                for _ in range(40):
                    storm.start_soon(refused_then_hang_up, codes)
            assert codes == [4000] * 40
            assert good in pool.handles  # the good member's connection outlived the storm
            members.cancel_scope.cancel()
            stop.set()


async def _nursery(*, task_status=trio.TASK_STATUS_IGNORED):
    async with trio.open_nursery() as n:
        task_status.started(n)
        await trio.sleep_forever()


async def _member(url, *, task_status=trio.TASK_STATUS_IGNORED):
    """A joined member that keeps heartbeating until cancelled; started() gives its id."""
    async with open_websocket_url(url) as ws:
        sid = await _join(ws)
        task_status.started(sid)
        while True:
            await trio.sleep(0.2)
            await ws.send_message(m.FLEET.encode(m.Heartbeat(sampler_id=sid, sent_at=0.0)))


async def _join(ws) -> str:
    """Join as a fake sampler on an open WebSocket and report version 0; its sampler id."""
    ident = m.SamplerIdentity(sampler_id="x", backend="fake", device_kind="cpu", dtype="float32")
    await ws.send_message(m.FLEET.encode(m.Join(token=TOKEN, identity=ident)))
    welcome = m.FLEET.decode(await ws.get_message())
    assert isinstance(welcome, m.Welcome) and welcome.run_id == "run-1", welcome
    await ws.send_message(m.FLEET.encode(m.SamplerStatus(
        sampler_id=welcome.sampler_id, version=0, digest="d", queue_depth=0, tokens_per_s=0.0)))
    return welcome.sampler_id


async def test_first_message_must_be_join_and_bad_frames_are_rejected(model_dir):
    pool = SamplerPool()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url, stop = await _serve(n, pool, heartbeat_s=0.2, heartbeat_timeout_s=1.0)
            async with open_websocket_url(url) as ws:
                await ws.send_message(m.FLEET.encode(m.Heartbeat(sampler_id="x", sent_at=0.0)))
                reply = m.FLEET.decode(await ws.get_message())
                assert isinstance(reply, m.Refused) and "must be Join, got Heartbeat" in reply.reason
            async with open_websocket_url(url + "?price_per_hour=-1") as ws:
                reply = m.FLEET.decode(await ws.get_message())
                assert isinstance(reply, m.Refused) and "price_per_hour" in reply.reason
            # a joined member that sends garbage gets Rejected and stays; silence takes it out
            async with open_websocket_url(url) as ws:
                ident = m.SamplerIdentity(sampler_id="x", backend="fake", device_kind="cpu", dtype="float32")
                await ws.send_message(m.FLEET.encode(m.Join(token=TOKEN, identity=ident)))
                welcome = m.FLEET.decode(await ws.get_message())
                assert isinstance(welcome, m.Welcome) and welcome.run_id == "run-1"
                await ws.send_message(m.FLEET.encode(m.SamplerStatus(
                    sampler_id=welcome.sampler_id, version=0, digest="d", queue_depth=0, tokens_per_s=0.0)))
                await ws.send_message(b"\xc1 not msgpack")
                while True:
                    msg = m.FLEET.decode(await ws.get_message())
                    if not isinstance(msg, m.Heartbeat):
                        break
                assert type(msg).__name__ == "Rejected" and msg.kind == "malformed"
                assert welcome.sampler_id in pool.handles
                await pool.wait_dead(welcome.sampler_id)  # we stop heartbeating: silence
                assert welcome.sampler_id not in pool.handles
            stop.set()


async def test_leave_removes_member(model_dir):
    pool = SamplerPool()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url, stop = await _serve(n, pool)
            async with open_websocket_url(url) as ws:
                sid = await _join(ws)
                await _wait_for(lambda: sid in pool.handles)
                await ws.send_message(m.FLEET.encode(m.Leave(sampler_id=sid, reason="bye")))
                await pool.wait_dead(sid)
            stop.set()


async def test_price_comes_in_the_join_and_the_legacy_query_still_counts(model_dir):
    pool = SamplerPool()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            url, stop = await _serve(n, pool, heartbeat_s=0.2, heartbeat_timeout_s=5.0)
            prices = {}
            for join_price, query in ((1.75, ""), (0.0, "?price_per_hour=0.25"), (3.0, "?price_per_hour=0.25")):
                async with open_websocket_url(url + query) as ws:
                    ident = m.SamplerIdentity(sampler_id="x", backend="fake", device_kind="cpu", dtype="float32")
                    await ws.send_message(m.FLEET.encode(m.Join(token=TOKEN, identity=ident,
                                                                price_per_hour=join_price)))
                    welcome = m.FLEET.decode(await ws.get_message())
                    await ws.send_message(m.FLEET.encode(m.SamplerStatus(
                        sampler_id=welcome.sampler_id, version=0, digest="d", queue_depth=0, tokens_per_s=0.0)))
                    await _wait_for(lambda: welcome.sampler_id in pool.handles)
                    prices[(join_price, query)] = pool.registry.get(welcome.sampler_id).price_per_hour
            # the Join's price wins; a sampler of an earlier release (no price in its Join) is
            # priced by its query parameter
            assert list(prices.values()) == [1.75, 0.25, 3.0]
            stop.set()

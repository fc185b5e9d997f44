"""The dashboard's environment workers table (the snapshot's ``workers``): one row per
environment worker, from the ``worker_rows`` of /status.

On a real daemon (Docker sandboxes): a fake trainer, a sampler pool of one torch sampler,
an environment worker actor that runs one group through the pool in sandboxes it keeps
one of warm, and the remote workers actor with a worker joined by hand. Logged into the
dashboard, /ui/snapshot lists the worker of the daemon with its group done and its
sandboxes (warm, leased, limit) and the remote worker (its id and name, the task it
holds, ``up``) as /status has them. Without /status rows: the rules of `workers_of`."""

from __future__ import annotations

import random
from functools import partial

import httpx
import msgspec
import pytest
import trio

from fleetrl.actors.dashboard.snapshot import Series, snapshot, workers_of
from fleetrl.actors.envworker import WorkerRow
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.credentials import CredentialStore
from fleetrl.daemon.state import StateDir, read_control
from fleetrl.daemon.supervisor import Supervisor


def _row(**kw) -> dict:
    return msgspec.to_builtins(WorkerRow(**kw))


def test_workers_of_lists_every_worker_row_with_its_actor():
    local = _row(worker="env", host="h", remote=False, attempts_running=2, groups_running=1, sandboxes_warm=1,
                 sandboxes_leased=2, sandboxes_limit=8)
    remote = [_row(worker="worker-2", host="gpu-7", remote=True, groups_running=1, sandboxes_limit=4),
              _row(worker="worker-1", host="gpu-3", remote=True, health="lost", ended="silent")]
    status = {"actors": {
        "pool": {"state": "running", "factory": "fleetrl.actors.pool:run", "statistics": {"samplers": []}},
        "env": {"state": "running", "factory": "fleetrl.actors.envworker:run", "statistics": {"worker_rows": [local]}},
        "remote": {"state": "running", "factory": "fleetrl.actors.workers:run",
                   "statistics": {"workers": 1, "worker_rows": remote}},
        "stale": {"state": "backoff", "factory": "my.own:worker", "statistics": {"worker_rows": [local]}},
        "down": {"state": "backoff", "factory": "fleetrl.actors.envworker:run", "statistics": None},
        "ui": {"state": "running", "factory": "fleetrl.actors.dashboard:run", "statistics": {"pages": 1}},
    }}
    rows = workers_of(status)
    assert [(r["actor"], r["worker"], r["health"]) for r in rows] == [
        ("env", "env", "up"), ("remote", "worker-2", "up"), ("remote", "worker-1", "lost"),
        ("stale", "env", "backoff"),  # a worker of the daemon whose actor is not running: its state
        ("down", "down", "backoff")]  # an environment worker actor with no row: its name and state
    assert rows[0] == {"actor": "env", **local} and rows[1] == {"actor": "remote", **remote[0]}
    assert set(rows[4]) == set(rows[0]) and rows[4]["sandboxes_limit"] is None
    assert workers_of({"actors": {}}) == [] and workers_of({}) == []
    snap = snapshot(status, Series(10), {}, [], [], seq=1)
    assert snap["workers"] == rows
    assert msgspec.json.decode(msgspec.json.encode(snap))["workers"] == rows  # what the page receives


def _config(tmp_path, model_dir) -> str:
    weights = tmp_path / "weights"
    tok = f'tokenizer_dir = "{model_dir}", pacing = false'
    return f"""
[daemon]
grace_s = 30.0
checkpoint_interval_s = 1000.0
[http]
enabled = true
host = "127.0.0.1"
port = 0
[actors.ui]
factory = "fleetrl.actors.dashboard:run"
config = {{refresh_s = 0.2}}
[actors.trainer]
factory = "dashboard_test_actors:trainer"
inbox = 64
config = {{model_dir = "{model_dir}", weights_dir = "{weights}", versions = 1, every_s = 0.5}}
[actors.pool]
factory = "fleetrl.actors.pool:run"
after = ["trainer"]
[actors.pool.config]
weights_dir = "{weights}"
join = false
max_staleness = 100
[[actors.pool.config.samplers]]
id = "torch-fp32"
model_dir = "{model_dir}"
capacity = 4

[actors.env]
factory = "fleetrl.actors.envworker:run"
after = ["pool"]
[actors.env.config]
target = "trainer"
model = {{kind = "pool", {tok}}}
harness = "fleetrl.harness.builtin:CompletionHarness"
harness_config = {{max_tokens = 4}}
tasks = {{kind = "synthetic", seed = 3}}
group_size = 2
max_tasks = 1
sandbox = {{memory_mb = 256, min_warm = 1, max_warm = 2, max_containers = 3}}

[actors.remote]
factory = "fleetrl.actors.workers:run"
after = ["pool"]
[actors.remote.config]
target = "trainer"
model = {{kind = "pool", {tok}}}
harness = "fleetrl.harness.builtin:CompletionHarness"
harness_config = {{max_tokens = 4}}
tasks = {{kind = "synthetic", seed = 4}}
group_size = 2
heartbeat_s = 0.5
heartbeat_timeout_s = 5.0
sandbox = {{max_warm = 2, max_containers = 4}}
"""


@pytest.mark.docker
async def test_the_snapshot_lists_the_daemon_s_and_the_remote_workers(tmp_path, tiny_model_dir, actors_module):
    test_actors = actors_module("dashboard_test_actors")
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(load_config_text(_config(tmp_path, tiny_model_dir), source="test.toml"), state,
                     rng=random.Random(0))
    _, worker_token = CredentialStore(state.path).create("worker")
    with state, trio.fail_after(180):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await sup.wait_handle("remote")
            _, port = read_control(state.path)
            base = f"http://127.0.0.1:{port}/ui"
            async with trio.open_nursery() as peer, httpx.AsyncClient() as c:
                wid = await peer.start(partial(test_actors.by_hand_worker, f"ws://127.0.0.1:{port}/workers/join",
                                               worker_token))
                assert (await c.post(base + "/login", data={"token": state.token})).status_code == 303
                while True:  # the group of the daemon's worker done, a sandbox warm, the remote one holding its task
                    snap = (await c.get(base + "/snapshot")).json()
                    rows = {r["worker"]: r for r in snap.get("workers", ())}
                    env, remote = rows.get("env", {}), rows.get(wid, {})
                    if (env.get("groups") == {"emitted": 1} and (env.get("sandboxes_warm") or 0) >= 1
                            and remote.get("groups_running") == 1):
                        break
                    await trio.sleep(0.2)
                status = sup.status()["actors"]
                peer.cancel_scope.cancel()  # it hangs up: its task is requeued and the drain is quick
            sup.request_shutdown("test")
    assert [(r["actor"], r["worker"]) for r in snap["workers"]] == [("env", "env"), ("remote", wid)]
    assert env["remote"] is False and env["host"] and env["health"] == "up"
    assert env["attempts_running"] == 0 and env["groups_running"] == 0 and env["failures"] == {}
    assert env["sandboxes_leased"] == 0 and env["sandboxes_limit"] == 3
    assert remote["remote"] is True and remote["host"] == "by-hand" and remote["health"] == "up"
    assert remote["address"].startswith("127.0.0.1:") and remote["sandboxes_limit"] == 4
    assert remote["attempts_running"] is None and remote["sandboxes_warm"] is None  # on its own host
    # the table says what /status says (a later reading: only the fields that stay put)
    stay = ("worker", "host", "remote", "address", "sandboxes_limit", "groups")
    for actor, row in (("env", env), ("remote", remote)):
        (held,) = status[actor]["statistics"]["worker_rows"]
        assert {k: held[k] for k in stay} == {k: row[k] for k in stay}

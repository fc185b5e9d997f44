"""Remote environment workers for real: a daemon (in this process) serving TLS, with a
sampler pool (a torch sampler over the tiny model), a fake trainer that publishes new
versions, and the remote workers actor; two `fleetrl worker` processes join over wss://
with an issued worker token, receive a harness of the user's own code pickled by value
(its module exists only in the daemon's process), and run groups in Docker sandboxes.

SIGKILL of one worker process while it holds tasks: its tasks go to the other worker,
every task's group reaches the trainer exactly once (ids ``<task>#<number>@remote``), and
the killed worker's containers are removed by its reaper. A plain ws:// worker refuses the
pickled harness, and a harness by import path that its host lacks, before any task; a sampler token is refused; revoking the worker token ends the live worker."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import trio
from tls import make_ca

from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.credentials import CredentialStore
from fleetrl.daemon.state import StateDir, read_control
from fleetrl.daemon.supervisor import Supervisor
from fleetrl.sandboxes import state_hash

from .userharness_src import SOURCE

pytestmark = [pytest.mark.docker, pytest.mark.slow]

GROUP_SIZE = 4
TASKS = 16


def _config(tmp_path: Path, model_dir: Path, certs, *, tls: bool = True) -> str:
    tasks = tmp_path / "tasks.jsonl"
    # reward 1 when the solution file's CRC is even: sampled completions differ, so most groups vary
    tasks.write_text("".join(json.dumps({"id": f"parity-{i}", "prompt": "x = ", "evaluator": {
        "command": "test $(( $(cksum < solution.py | cut -d ' ' -f 1) % 2 )) -eq 0"}}) + "\n" for i in range(TASKS)))
    weights = tmp_path / "weights"
    http = f'tls_cert = "{certs.cert}"\ntls_key = "{certs.key}"' if tls else ""  # certs: None without TLS
    return f"""
[daemon]
grace_s = 60.0
checkpoint_interval_s = 1000.0
[http]
enabled = true
host = "127.0.0.1"
port = 0
{http}

[actors.trainer]
factory = "workers_test_actors:trainer"
inbox = 64
config = {{tag = "trained", model_dir = "{model_dir}", weights_dir = "{weights}", groups_per_step = 2}}

[actors.pool]
factory = "fleetrl.actors.pool:run"
after = ["trainer"]
inbox = 64
[actors.pool.config]
max_staleness = 2
attempts_per_step = {2 * GROUP_SIZE}
weights_dir = "{weights}"
join = false
[[actors.pool.config.samplers]]
id = "torch-fp32"
model_dir = "{model_dir}"
capacity = 8

[actors.remote]
factory = "fleetrl.actors.workers:run"
after = ["pool", "trainer"]
[actors.remote.config]
target = "trainer"
tasks = {{kind = "jsonl", path = "{tasks}", repeat = false}}
model = {{kind = "pool", pool = "pool", tokenizer_dir = "{model_dir}"}}
harness = "acme_harness:EchoingHarness"
harness_config = {{max_tokens = 6, temperature = 1.0, delay_s = 2.0}}
group_size = {GROUP_SIZE}
heartbeat_s = 0.5
heartbeat_timeout_s = 5.0
sandbox = {{memory_mb = 256, min_warm = 0, max_warm = 2, max_containers = 4}}
"""


def containers_of(state_dir: Path) -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state_dir)}"],
                         check=True, capture_output=True, text=True).stdout
    return out.split()


class Workers:
    """`fleetrl worker` processes, each the leader of its own process group."""

    def __init__(self, fleetrl_bin: str, tmp_path: Path) -> None:
        self.bin = fleetrl_bin
        self.tmp = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, url: str, token: str, *extra: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")
        argv = [self.bin, "worker", "--join", url, "--token", token, "--state-dir", str(self.state(name)),
                "--name", name, *extra]
        p = subprocess.Popen(argv, cwd="/", env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = p
        return p

    def state(self, name: str) -> Path:
        return self.tmp / f"state-{name}"

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.fixture
def workers(fleetrl_bin, tmp_path):
    ws = Workers(fleetrl_bin, tmp_path)
    yield ws
    ws.close()


@pytest.fixture
def user_harness(tmp_path, monkeypatch):
    d = tmp_path / "user-code"
    d.mkdir()
    (d / "acme_harness.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(d))
    yield
    sys.modules.pop("acme_harness", None)


async def _until(pred, what: str, timeout_s: float, workers: Workers | None = None) -> None:
    with trio.move_on_after(timeout_s):
        while not pred():
            await trio.sleep(0.1)
        return
    logs = "" if workers is None else "\n".join(f"--- {n}\n{workers.log(n)[-3000:]}" for n in workers.procs)
    raise AssertionError(f"timed out waiting for {what}\n{logs}")


async def test_a_killed_worker_s_tasks_finish_on_another_exactly_once_and_leave_no_container(
        tmp_path, tiny_model_dir, actors_module, workers, user_harness):
    test_actors = actors_module("workers_test_actors", "RECEIVED")
    certs = make_ca(tmp_path / "ca")
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(load_config_text(_config(tmp_path, tiny_model_dir, certs), source="test.toml"), state,
                     rng=random.Random(0))
    store = CredentialStore(state.path)
    worker_cred, worker_token = store.create("worker", "test-workers")
    _, sampler_token = store.create("sampler", "not-a-worker")
    got = test_actors.RECEIVED["trained"]
    with state, trio.fail_after(600):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            hub = await sup.wait_handle("remote")
            host, port = read_control(state.path)
            url = f"wss://127.0.0.1:{port}/workers/join"
            ca = ("--ca-file", str(certs.ca_cert))

            wrong = workers.start("sampler-token", url, sampler_token, *ca)
            a = workers.start("a", url, worker_token, *ca, "--groups", "2")
            workers.start("b", url, worker_token, *ca, "--groups", "2")
            await _until(lambda: hub.statistics().workers == 2, "both workers joined", 240, workers)
            assert await trio.to_thread.run_sync(wrong.wait) == 3
            assert "wrong worker token" in workers.log("sampler-token")
            await _until(lambda: any(h.worker == "worker-1" for h in hub.book.held.values()) and len(got) >= 1,
                         "worker a holds a task after the first group arrived", 120, workers)
            # each worker reports what it runs on its host: attempts, its sandboxes (the workers table)
            await _until(lambda: all(r.sandboxes_warm is not None for r in hub.statistics().worker_rows),
                         "both workers' loads", 60, workers)
            rows = {r.worker: r for r in hub.statistics().worker_rows}
            assert set(rows) == {"worker-1", "worker-2"} and all(r.health == "up" for r in rows.values())
            assert all(r.attempts_running is not None and r.sandboxes_leased is not None for r in rows.values())
            os.killpg(a.pid, signal.SIGKILL)  # the worker host's process dies mid-run
            await trio.to_thread.run_sync(a.wait)
            await _until(lambda: len(got) >= TASKS, f"all {TASKS} groups", 300, workers)
            await trio.sleep(1.0)  # a duplicate would arrive now
            ids = [g.group_id for _, g in got]
            assert sorted(ids) == sorted(f"parity-{i}#{i}@remote" for i in range(TASKS)), ids
            stats = hub.statistics()
            assert stats.reruns >= 1 and stats.lost >= 1 and stats.cursor_floor == TASKS, stats
            assert all(len(g.rewards) == GROUP_SIZE for _, g in got)
            # the killed worker's reaper removed its containers; the live one keeps its own only
            await _until(lambda: not containers_of(workers.state("a")), "the reaper's sweep", 120, workers)
            assert "pickle" in workers.log("b")
            # revoking the token ends the live worker within a heartbeat (exit 3), and its sandboxes with it
            store.revoke(worker_cred.id)
            b = workers.procs["b"]
            assert await trio.to_thread.run_sync(b.wait) == 3
            assert "token revoked" in workers.log("b")
            await _until(lambda: not containers_of(workers.state("b")), "worker b's containers gone", 60)
            sup.request_shutdown("test")


@pytest.mark.parametrize(("ship", "refusal"), [
    ("auto", "this connection is not TLS"),  # pickled by value: never over plain ws://
    ("import", "cannot be loaded: No module named 'acme_harness'"),  # by import path: the host lacks it
])
async def test_a_worker_refuses_a_harness_it_may_not_or_cannot_load(
        tmp_path, tiny_model_dir, actors_module, workers, user_harness, ship, refusal):
    actors_module("workers_test_actors", "RECEIVED")
    text = _config(tmp_path, tiny_model_dir, None, tls=False).replace(
        "group_size = ", f'ship_harness = "{ship}"\ngroup_size = ')
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(load_config_text(text, source="test.toml"), state, rng=random.Random(0))
    _, token = CredentialStore(state.path).create("worker")
    with state, trio.fail_after(300):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            hub = await sup.wait_handle("remote")
            _, port = read_control(state.path)
            plain = workers.start("plain", f"ws://127.0.0.1:{port}/workers/join", token)
            assert await trio.to_thread.run_sync(plain.wait) == 3
            assert refusal in workers.log("plain")
            assert hub.statistics().tasks_assigned == 0  # it left before any task went out
            assert hub.statistics().workers == 0
            sup.request_shutdown("test")


SCRIPT = Path(__file__).resolve().parents[1] / "endpoint" / "scripts" / "two_calls_count.py"


async def test_an_external_command_runs_on_the_worker_host_against_an_endpoint_of_its_own(
        tmp_path, tiny_model_dir, actors_module, workers, image):
    """``harness = "external"``: the command (the official openai client making two calls)
    runs on the worker host against the worker's own endpoint, which answers through the
    connection; its calls are recorded token for token and the task's evaluator scores the
    file it wrote into the worker's sandbox."""
    test_actors = actors_module("workers_test_actors", "RECEIVED")
    text = _config(tmp_path, tiny_model_dir, None, tls=False)
    tasks = tmp_path / "count-tasks.jsonl"
    # reward 1 when the first answer had an odd number of tokens (the command writes both counts)
    tasks.write_text("".join(json.dumps({
        "id": f"count-{i}", "prompt": "Say something.", "image": image,
        "evaluator": {"command": 'set -- $(cat answer.txt); test $(($1 % 2)) = 1'},
        "limits": {"timeout_s": 60}}) + "\n" for i in range(2)))
    text = text.split("[actors.remote.config]")[0] + f"""[actors.remote.config]
target = "trainer"
tasks = {{kind = "jsonl", path = "{tasks}", repeat = false}}
model = {{kind = "pool", pool = "pool", tokenizer_dir = "{tiny_model_dir}", pacing = false}}
harness = "external"
harness_config = {{argv = ["{sys.executable}", "{SCRIPT}"], timeout_s = 60}}
endpoint_config = {{model_name = "tiny", context_length = 1024}}
group_size = 2
heartbeat_s = 0.5
heartbeat_timeout_s = 5.0
sandbox = {{memory_mb = 256, min_warm = 0, max_warm = 2, max_containers = 4}}
"""
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(load_config_text(text, source="test.toml"), state, rng=random.Random(0))
    _, token = CredentialStore(state.path).create("worker")
    got = test_actors.RECEIVED["trained"]
    with state, trio.fail_after(300):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            await sup.wait_handle("remote")
            _, port = read_control(state.path)
            workers.start("ext", f"ws://127.0.0.1:{port}/workers/join", token)
            await _until(lambda: len(got) >= 2, "both groups", 240, workers)
            sup.request_shutdown("test")
    assert not test_actors.RECEIVED["trained/failed"], test_actors.RECEIVED["trained/failed"]
    assert sorted(g.group_id for _, g in got) == ["count-0#0@remote", "count-1#1@remote"]
    for _, group in got:
        assert len(group.trajectories) == 2
        for t in group.trajectories:
            s0, s1 = t.segments  # the command's two calls, recorded by the worker's endpoint
            p0, g0 = s0.prompt_ids.to_numpy().tolist(), s0.token_ids.to_numpy().tolist()
            p1 = s1.prompt_ids.to_numpy().tolist()
            assert p1[: len(p0) + len(g0)] == p0 + g0  # extended exactly, not re-tokenised
            assert t.reward == (1.0 if len(g0) % 2 == 1 else 0.0), (len(g0), t.reward)
    assert "external harness" in workers.log("ext")

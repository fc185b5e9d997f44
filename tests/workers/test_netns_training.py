"""Issue 23's acceptance fleet: a `fleetrl serve` daemon (trainer with the tiny model, a
sampler pool with no sampler of its own, the remote workers actor) and four hosts, each
in its own network namespace and reaching the daemon only through its own userspace
fault proxy with latency and a bandwidth cap (40 Mbit/s): two sampler hosts (`fleetrl sampler`, an issued sampler token:
join, follow the weights over /weights) and two worker hosts (`fleetrl worker`, an issued
worker token, sandboxes on the machine's Docker engine). Mid-run one worker host's
connection blips (reset), then one worker host and one sampler host are SIGKILLed.

The run reaches its step budget and the daemon exits 0; no group is trained twice and
every trained group is the group of a distinct task number; the killed worker's tasks
were run again by the other; no container of either worker host is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import trio
from faultproxy import FaultProxy
from helpers import read_jsonl
from netns import netns

from fleetrl.actors.trainer import checkpoint as ck
from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.daemon.credentials import CredentialStore
from fleetrl.daemon.state import read_control
from fleetrl.sandboxes import state_hash

pytestmark = [pytest.mark.docker, pytest.mark.slow]

GROUP_SIZE = 4
GROUPS_PER_STEP = 2
STEPS = 30


def _config(tmp_path: Path, state: Path, model_dir: Path) -> str:
    tasks = tmp_path / "tasks.jsonl"
    # reward 1 when the solution file's CRC is even: sampled completions differ, so groups vary
    tasks.write_text("".join(json.dumps({"id": f"parity-{i}", "prompt": f"x{i} = ", "evaluator": {
        "command": "test $(( $(cksum < solution.py | cut -d ' ' -f 1) % 2 )) -eq 0"}}) + "\n" for i in range(64)))
    weights = state / "actors" / "trainer" / "weights"
    return f"""
[daemon]
grace_s = 120.0
checkpoint_interval_s = 1000.0
compute_threads = 1
[http]
enabled = true
host = "127.0.0.1"
port = 0
[logging]
console = "warnings"

[actors.trainer]
factory = "fleetrl.actors.trainer:run"
inbox = 64
[actors.trainer.config]
model_dir = "{model_dir}"
lr = 1e-3
groups_per_step = {GROUPS_PER_STEP}
max_staleness = 2
max_steps = {STEPS}
checkpoint_every = 100
stale_reports_to = "pool"
announce_to = ["pool"]
shutdown_when_done = true

[actors.pool]
factory = "fleetrl.actors.pool:run"
after = ["trainer"]
inbox = 64
[actors.pool.config]
max_staleness = 2
attempts_per_step = {GROUPS_PER_STEP * GROUP_SIZE}
weights_dir = "{weights}"
join = true
heartbeat_s = 0.5
heartbeat_timeout_s = 5.0

[actors.remote]
factory = "fleetrl.actors.workers:run"
after = ["pool", "trainer"]
[actors.remote.config]
target = "trainer"
tasks = {{kind = "jsonl", path = "{tasks}"}}
model = {{kind = "pool", pool = "pool", tokenizer_dir = "{model_dir}"}}
harness_config = {{max_tokens = 8, temperature = 1.0}}
group_size = {GROUP_SIZE}
heartbeat_s = 0.5
heartbeat_timeout_s = 5.0
drain_grace_s = 10.0
sandbox = {{memory_mb = 256, min_warm = 0, max_warm = 2, max_containers = 4}}
"""


def _containers(state_dir: Path) -> list[str]:
    return subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state_dir)}"],
                          check=True, capture_output=True, text=True).stdout.split()


class _Procs:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")
        p = subprocess.Popen(argv, cwd=self.tmp, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = p
        return p

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{(self.tmp / f'{n}.log').read_text(errors='replace')[-2500:]}"
                         for n in self.procs)

    def kill(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def close(self) -> None:
        for name in self.procs:
            self.kill(name)


async def _until(pred, what: str, timeout_s: float, procs: _Procs) -> None:
    with trio.move_on_after(timeout_s):
        while not pred():
            await trio.sleep(0.2)
        return
    raise AssertionError(f"timed out waiting for {what}\n{procs.tails()}")


async def test_two_sampler_and_two_worker_hosts_behind_fault_proxies_train_through_kills(
        tmp_path, tiny_model_dir, fleetrl_bin):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    cfg = tmp_path / "fleet.toml"
    cfg.write_text(_config(tmp_path, state, tiny_model_dir))
    store = CredentialStore(state)
    _, sampler_token = store.create("sampler", "sampler-hosts")
    _, worker_token = store.create("worker", "worker-hosts")
    procs = _Procs(tmp_path)
    metrics = state / "actors" / "trainer" / "metrics.jsonl"
    steps = lambda: [x for x in read_jsonl(metrics) if not x.get("skipped")]  # noqa: E731
    worker_states = {name: tmp_path / f"state-{name}" for name in ("wa", "wb")}
    try:
        with netns(1) as sa, netns(2) as sb, netns(3) as wa, netns(4) as wb, trio.fail_after(900):
            daemon = procs.start("daemon", [fleetrl_bin, "serve", "--config", str(cfg), "--state-dir", str(state)])
            await _until(lambda: (state / "control.json").exists(), "the control plane", 180, procs)
            _, port = read_control(state)
            async with trio.open_nursery() as n:
                proxies: dict[str, FaultProxy] = {}
                for name, ns in (("sa", sa), ("sb", sb), ("wa", wa), ("wb", wb)):
                    proxy = FaultProxy("127.0.0.1", port, latency_s=0.005, bandwidth_bps=40e6,
                                       listen_host=ns.host_ip)
                    _, pport = await n.start(proxy.serve)
                    proxies[name] = proxy
                    base = f"{ns.host_ip}:{pport}"
                    if name.startswith("s"):
                        argv = ns.argv(fleetrl_bin, "sampler", "--join", f"ws://{base}/fleet/join",
                                       "--token", sampler_token, "--backend", "torch", "--dtype", "bf16",
                                       "--model", str(tiny_model_dir), "--weights", f"http://{base}/weights",
                                       "--capacity", "8", "--name", name)
                    else:
                        argv = ns.argv(fleetrl_bin, "worker", "--join", f"ws://{base}/workers/join",
                                       "--token", worker_token, "--state-dir", str(worker_states[name]),
                                       "--groups", "2", "--name", name)
                    procs.start(name, argv)

                def log_has(name: str, text: str) -> bool:
                    return text in (tmp_path / f"{name}.log").read_text(errors="replace")

                await _until(lambda: len(steps()) >= 2, "two train steps", 420, procs)
                # a blip on worker host wa's path: its connection resets, it rejoins, its tasks are requeued
                assert proxies["wa"].reset_all() >= 1
                await _until(lambda: log_has("wa", "connection lost; reconnecting"), "wa noticed the blip", 60, procs)
                await _until(lambda: len(steps()) >= 4, "four train steps", 300, procs)
                procs.kill("wa")  # SIGKILL: the worker host's process and its whole group
                procs.kill("sa")
                at_kill = len(steps())
                await _until(lambda: daemon.poll() is not None, "the run's end (max_steps)", 600, procs)
                n.cancel_scope.cancel()
        assert daemon.returncode == 0, procs.tails()
    finally:
        procs.close()
    done = steps()
    assert [x["step"] for x in done][-1] == STEPS, done
    assert STEPS - at_kill >= 4, f"only {STEPS - at_kill} steps after the kills"  # the survivors carried the run
    final, _ = CheckpointStore(state / "checkpoints").load_latest()
    trainer = ck.decode(final.actors["trainer"])
    trained = list(trainer.buffer.trained_ids)
    assert len(trained) == len(set(trained)) == trainer.buffer.counters.trained  # none trained twice
    numbers = [int(g.split("#")[1].split("@")[0]) for g in trained]
    assert len(numbers) == len(set(numbers)) and all(g.endswith("@remote") for g in trained)
    events = read_jsonl(state / "logs" / "daemon.jsonl")
    requeued = [e for e in events if e.get("event") == "task requeued"]
    assert requeued, "no task was run again after its worker was lost"
    # the killed host's reaper removed its containers; the survivor removed its own at exit
    with trio.fail_after(120):
        while any(_containers(d) for d in worker_states.values()):
            await trio.sleep(0.5)

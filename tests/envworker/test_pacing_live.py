"""Pacing in the live loop (issue 6): a real environment worker whose model is a real
sampler pool actor (a torch sampler with the tiny model, following published weight
versions), a deliberately slow fake trainer, real Docker sandboxes.

With ``max_staleness = 2``: no group the trainer takes carries a token older than two
versions behind the trainer, and every group the worker finished reaches the trainer
(none dropped). The same setup without pacing exceeds the bound, so the check can fail.
"""

from __future__ import annotations

import json
import random
import subprocess
from functools import partial
from pathlib import Path

import pytest
import trio

from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor
from fleetrl.sandboxes import state_hash

pytestmark = pytest.mark.docker

MAX_STALENESS = 2
GROUP_SIZE = 4
TASKS = 14


def config(tmp_path: Path, model_dir: Path, *, pacing: bool) -> str:
    tasks = tmp_path / "tasks.jsonl"
    # reward 1 when the solution file's CRC is even: sampled completions differ, so most
    # groups have reward variance, as the trainer needs
    tasks.write_text(json.dumps({"id": "parity", "prompt": "x = ", "evaluator": {
        "command": "test $(( $(cksum < solution.py | cut -d ' ' -f 1) % 2 )) -eq 0"}}) + "\n")
    weights = tmp_path / "weights"
    return f"""
[daemon]
grace_s = 60.0
checkpoint_interval_s = 1000.0
[http]
enabled = false

[actors.trainer]
factory = "envworker_test_actors:slow_trainer"
inbox = 64
config = {{tag = "trained", model_dir = "{model_dir}", weights_dir = "{weights}", groups_per_step = 1, train_s = 1.5}}

[actors.pool]
factory = "fleetrl.actors.pool:run"
after = ["trainer"]
inbox = 64
[actors.pool.config]
max_staleness = {MAX_STALENESS}
attempts_per_step = {GROUP_SIZE}
weights_dir = "{weights}"
join = false
[[actors.pool.config.samplers]]
id = "torch-fp32"
model_dir = "{model_dir}"
capacity = 4

[actors.env]
factory = "fleetrl.actors.envworker:run"
after = ["pool", "trainer"]
[actors.env.config]
target = "trainer"
tasks = {{kind = "jsonl", path = "{tasks}"}}
model = {{kind = "pool", pool = "pool", tokenizer_dir = "{model_dir}", pacing = {str(pacing).lower()}}}
harness_config = {{max_tokens = 6, temperature = 1.0}}
group_size = {GROUP_SIZE}
max_concurrent_attempts = 32
max_groups_in_flight = 8
max_tasks = {TASKS}
sandbox = {{memory_mb = 256, min_warm = 0, max_warm = 4, max_containers = 8}}
"""


def containers_of(state_dir: Path) -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state_dir)}"],
                         check=True, capture_output=True, text=True).stdout
    return out.split()


async def run_loop(tmp_path: Path, model_dir: Path, test_actors, *, pacing: bool) -> tuple[list, str]:
    sup = Supervisor(load_config_text(config(tmp_path, model_dir, pacing=pacing), source="test.toml"),
                     state := StateDir(tmp_path / "state").open(), rng=random.Random(0))
    got = test_actors.RECEIVED["trained"]

    def ended() -> int:
        text = sup.metrics_text().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("fleetrl_envworker_groups_total{"))
    with state:
        with trio.fail_after(400):
            async with trio.open_nursery() as n:
                await n.start(partial(sup.run, handle_signals=False))
                while ended() < TASKS:
                    await trio.sleep(0.2)
                await trio.sleep(0.5)  # the last sends reach the trainer's inbox
                metrics = sup.metrics_text().decode()
                sup.request_shutdown("test")
    assert not containers_of(state.path)
    return list(got), metrics


async def test_paced_worker_keeps_the_bound_and_drops_nothing(tmp_path, tiny_model_dir, test_actors):
    got, metrics = await run_loop(tmp_path, tiny_model_dir, test_actors, pacing=True)
    assert not test_actors.RECEIVED["trained/failed"]
    # every group the worker finished reached the trainer, in admission (task) order
    assert 'fleetrl_envworker_groups_total{actor="env",outcome="emitted"} 14.0' in metrics
    assert len(got) == TASKS
    assert [g.group_id for _, g in got] == [f"parity#{i}@env" for i in range(TASKS)]
    staleness = []
    for version, group in got:
        oldest = min(int(s.versions.to_numpy().min()) for t in group.trajectories for s in t.segments)
        staleness.append(version - oldest)
    assert max(staleness) <= MAX_STALENESS, staleness
    assert max(version for version, _ in got) >= 3, got  # the trainer did advance while sampling


async def test_without_pacing_the_same_loop_exceeds_the_bound(tmp_path, tiny_model_dir, test_actors):
    got, _ = await run_loop(tmp_path, tiny_model_dir, test_actors, pacing=False)
    staleness = [version - min(int(s.versions.to_numpy().min()) for t in g.trajectories for s in t.segments)
                 for version, g in got]
    assert max(staleness) > MAX_STALENESS, staleness

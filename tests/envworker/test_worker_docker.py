"""The environment worker under a real in-process Supervisor, with a real Docker
sandbox pool and the tiny model on the torch backend.

Checked: a group of G attempts reaches a sink actor with rewards computed in the
sandboxes and token-exact trajectories (prompt ids and the sampler's log-probs
recomputed by the model); a crashing and a hanging harness produce typed
`RolloutFailed` messages with the right reason, counted in Prometheus; shutdown
abandons what is still running and keeps its task due; no container is left behind.
"""

from __future__ import annotations

import json
import subprocess
from functools import partial
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import trio
from helpers import supervisor_for

from fleetrl.actors.envworker import CursorState, group_id_of
from fleetrl.actors.model import BOS_ID, load_tiny_llama
from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.daemon.messages import ROLLOUTS, RolloutFailed, RolloutGroup
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor
from fleetrl.harness.synthetic import make_task
from fleetrl.sandboxes import state_hash

pytestmark = pytest.mark.docker

BASE = """
[daemon]
grace_s = 30.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
"""


def make(tmp_path: Path, actors: str) -> tuple[Supervisor, StateDir]:
    return supervisor_for(tmp_path, BASE + actors)


def containers_of(state_dir: Path) -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state_dir)}"],
                         check=True, capture_output=True, text=True).stdout
    return out.split()


async def run_until(sup: Supervisor, done, timeout: float) -> None:
    """Run the daemon until `done()` holds, then shut it down (all within `timeout`)."""
    with trio.fail_after(timeout):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            while not done():
                await trio.sleep(0.2)
            sup.request_shutdown("test")


def worker_toml(name: str, model_dir: Path, *, target: str, extra: str) -> str:
    return f"""
[actors.{name}]
factory = "fleetrl.actors.envworker:run"
after = ["{target}"]
[actors.{name}.config]
target = "{target}"
model = {{kind = "local", model_dir = "{model_dir}"}}
sandbox = {{memory_mb = 256, min_warm = 0}}
{extra}
"""


async def test_group_arrives_scored_in_sandboxes_and_token_exact(tmp_path, tiny_model_dir, test_actors):
    sup, state = make(tmp_path, """
[actors.sink]
factory = "envworker_test_actors:sink"
config = {tag = "g"}
""" + worker_toml("env", tiny_model_dir, target="sink", extra="""
harness = "envworker_test_actors:OracleHarness"
harness_config = {max_tokens = 12}
tasks = {kind = "synthetic", seed = 11}
group_size = 3
max_concurrent_attempts = 3
max_tasks = 1
"""))
    got = test_actors.RECEIVED["g"]
    with state:
        await run_until(sup, lambda: any(isinstance(m, RolloutGroup) for m in got), 150)
    assert not containers_of(state.path)
    assert [type(m) for m in got] == [RolloutGroup], got
    (group,) = got
    task = make_task(11, "train", 0)
    assert group.task_id == task.id and len(group.trajectories) == 3
    assert ROLLOUTS.decode(ROLLOUTS.encode(group)) == group  # crosses process boundaries intact
    model = load_tiny_llama(tiny_model_dir)
    tok_prompt = [BOS_ID, *task.prompt.encode()]  # the byte tokenizer: id == byte
    for t in group.trajectories:
        (seg,) = t.segments
        assert t.attempt_id.startswith(group.group_id + "/")
        prompt = seg.prompt_ids.to_numpy().tolist()
        gen = seg.token_ids.to_numpy().tolist()
        assert prompt == tok_prompt
        assert 1 <= len(gen) <= 12
        # reward from the evaluator in the sandbox: the oracle wrote the reference
        # solution exactly when the first generated token is even
        assert t.reward == (1.0 if gen[0] % 2 == 0 else 0.0), (gen, t.reward)
        assert t.metrics["n_calls"] == 1.0 and t.metrics["try"] == 1.0
        # token-exact: the model's own log-probs of the recorded tokens after the recorded prompt
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1].gather(1, torch.tensor(gen)[:, None])[:, 0]
        np.testing.assert_allclose(seg.logprobs.to_numpy(), lp.numpy(), atol=2e-4)
        assert set(seg.versions.to_numpy().tolist()) == {0}
    ckpt, _ = CheckpointStore(state.checkpoints).load_latest()
    assert msgspec.convert(ckpt.actors["env"], CursorState) == CursorState(floor=1, done=())
    text = sup.metrics_text().decode()
    assert 'fleetrl_envworker_groups_total{actor="env",outcome="emitted"} 1.0' in text
    assert 'fleetrl_envworker_attempts_total{actor="env",outcome="scored"} 3.0' in text


def task_file(path: Path, **task) -> Path:
    path.write_text(json.dumps(task) + "\n" + "{not json\n")  # the invalid line is logged and skipped
    return path


async def test_failures_of_every_kind_are_typed_retried_and_counted(tmp_path, tiny_model_dir, test_actors):
    """A crashing harness, a hanging one, a failing setup command, unreadable evaluator output."""
    tasks = task_file(tmp_path / "tasks.jsonl", id="echo", prompt="say hi", limits={"timeout_s": 1.0},
                      evaluator={"command": "true"})
    setup = task_file(tmp_path / "setup.jsonl", id="badsetup", prompt="x", setup={"commands": ["exit 3"]},
                      evaluator={"command": "true"})
    evaluator = task_file(tmp_path / "eval.jsonl", id="badeval", prompt="x",
                          evaluator={"command": "echo not-json", "reward": "json"})
    common = f'tasks = {{kind = "jsonl", path = "{tasks}"}}\ngroup_size = 2\nmax_tasks = 1\n'
    sup, state = make(tmp_path, """
[actors.sink]
factory = "envworker_test_actors:sink"
config = {tag = "f"}
""" + worker_toml("crash", tiny_model_dir, target="sink", extra=common + """
harness = "envworker_test_actors:CrashingHarness"
retry = {max_tries = {harness_crash = 2}}
""") + worker_toml("hang", tiny_model_dir, target="sink", extra=common + """
harness = "envworker_test_actors:HangingHarness"
attempt_slack_s = 0.5
""") + worker_toml("setup", tiny_model_dir, target="sink", extra=f"""
tasks = {{kind = "jsonl", path = "{setup}"}}
group_size = 1
max_tasks = 1
retry = {{max_tries = {{sandbox_error = 2}}}}
""") + worker_toml("evaluator", tiny_model_dir, target="sink", extra=f"""
tasks = {{kind = "jsonl", path = "{evaluator}"}}
harness_config = {{max_tokens = 4}}
group_size = 1
max_tasks = 1
"""))
    got = test_actors.RECEIVED["f"]

    def finals() -> list[RolloutFailed]:
        return [m for m in got if isinstance(m, RolloutFailed) and "giving up" in m.detail]
    with state:
        await run_until(sup, lambda: len(finals()) == 6, 150)
    assert not containers_of(state.path)
    assert all(isinstance(m, RolloutFailed) for m in got), got  # too many failures: no group
    crash = [m for m in got if m.reason == "harness_crash"]
    hang = [m for m in got if m.reason == "timeout"]
    setup_failed = [m for m in got if m.reason == "sandbox_error"]
    eval_failed = [m for m in got if m.reason == "evaluator_error"]
    assert len(crash) == 4 and len(hang) == 2 and len(setup_failed) == 2 and len(eval_failed) == 2
    assert len(got) == 10
    assert all(m.task_id == "badsetup" and "exited 3" in m.detail for m in setup_failed)
    assert all(m.task_id == "badeval" for m in eval_failed)
    assert all("RuntimeError: harness exploded" in m.detail for m in crash)
    assert sorted(m.attempt_id.rsplit("/", 1)[1] for m in crash) == ["0.1", "0.2", "1.1", "1.2"]
    assert all("did not return within 1.5 s" in m.detail and m.task_id == "echo" for m in hang)
    text = sup.metrics_text().decode()
    assert 'fleetrl_envworker_attempt_failures_total{actor="crash",final="false",reason="harness_crash"} 2.0' in text
    assert 'fleetrl_envworker_attempt_failures_total{actor="crash",final="true",reason="harness_crash"} 2.0' in text
    assert 'fleetrl_envworker_attempt_failures_total{actor="hang",final="true",reason="timeout"} 2.0' in text
    assert 'fleetrl_envworker_groups_total{actor="hang",outcome="incomplete"} 1.0' in text
    assert 'fleetrl_envworker_attempt_failures_total{actor="setup",final="false",reason="sandbox_error"} 1.0' in text
    assert 'fleetrl_envworker_attempts_total{actor="evaluator",outcome="failed"} 1.0' in text
    # the incomplete group's task is finished (reported), not run again
    ckpt, _ = CheckpointStore(state.checkpoints).load_latest()
    assert msgspec.convert(ckpt.actors["hang"], CursorState).floor == 1


async def test_shutdown_abandons_running_attempts_and_a_restart_runs_their_task_again(
        tmp_path, tiny_model_dir, test_actors):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "slow", "prompt": "wait", "evaluator": {"command": "true"}}) + "\n")
    sup, state = make(tmp_path, """
[actors.sink]
factory = "envworker_test_actors:sink"
config = {tag = "d"}
""" + worker_toml("env", tiny_model_dir, target="sink", extra=f"""
harness = "envworker_test_actors:HangingHarness"
tasks = {{kind = "jsonl", path = "{tasks}"}}
group_size = 2
max_groups_in_flight = 1
drain_grace_s = 0.5
"""))
    got = test_actors.RECEIVED["d"]
    with state:
        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                await n.start(partial(sup.run, handle_signals=False))
                while sup.status()["actors"]["env"]["state"] != "running" or not containers_of(state.path):
                    await trio.sleep(0.2)
                while len(containers_of(state.path)) < 2:  # both attempts hold a sandbox
                    await trio.sleep(0.2)

                def env_row() -> dict:  # the worker's row in /status (the dashboard's workers table)
                    rows = (sup.status()["actors"]["env"]["statistics"] or {}).get("worker_rows") or [{}]
                    return rows[0]
                while env_row().get("sandboxes_leased") != 2:
                    await trio.sleep(0.2)
                row = env_row()
                assert row["worker"] == "env" and row["remote"] is False and row["health"] == "up"
                assert row["attempts_running"] == 2 and row["groups_running"] == 1
                assert row["sandboxes_limit"] == 64 and row["groups"] == {} and row["failures"] == {}
                sup.request_shutdown("test")
    assert not containers_of(state.path)
    assert len(got) == 2 and all(isinstance(m, RolloutFailed) and m.reason == "timeout" for m in got)
    assert all(m.detail.startswith("abandoned at shutdown") for m in got)
    assert 'fleetrl_envworker_groups_total{actor="env",outcome="abandoned"} 1.0' in sup.metrics_text().decode()
    ckpt, _ = CheckpointStore(state.checkpoints).load_latest()
    assert msgspec.convert(ckpt.actors["env"], CursorState) == CursorState(floor=0, done=())
    # the next daemon on this state directory restores the cursor and runs task 0 again
    again, state2 = make(tmp_path, """
[actors.sink]
factory = "envworker_test_actors:sink"
config = {tag = "d2"}
""" + worker_toml("env", tiny_model_dir, target="sink", extra=f"""
harness_config = {{max_tokens = 4}}
tasks = {{kind = "jsonl", path = "{tasks}"}}
group_size = 2
max_tasks = 1
"""))
    got2 = test_actors.RECEIVED["d2"]
    with state2:
        await run_until(again, lambda: bool(got2), 120)
    assert [type(m) for m in got2] == [RolloutGroup]
    # the re-run's group has the id the first run would have given it (deterministic per
    # task number and worker), so a trainer that already holds it refuses the copy
    assert got2[0].group_id == group_id_of("slow", 0, "env") == "slow#0@env"
    assert got2[0].rewards == (1.0, 1.0)
    ckpt, _ = CheckpointStore(state2.checkpoints).load_latest()
    assert msgspec.convert(ckpt.actors["env"], CursorState) == CursorState(floor=1, done=())
    assert not containers_of(state2.path)

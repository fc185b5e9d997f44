"""An environment worker running an external command (the official openai client in a
script) against the endpoint actor of the same daemon, in real Docker sandboxes.

Checked: the group reaches a sink actor; each trajectory holds the token records of
the command's two calls (the second extending the first, log-probs the model's own),
and its reward is the task's evaluator's verdict on the file the command wrote into
the sandbox, which depends on those very calls; no container is left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import trio

from fleetrl.actors.model import load_tiny_llama
from fleetrl.daemon.messages import ROLLOUTS, RolloutGroup
from fleetrl.sandboxes import state_hash

from .conftest import HERE, endpoint_toml, make_daemon

pytestmark = pytest.mark.docker


def containers_of(state_dir: Path) -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state_dir)}"],
                         check=True, capture_output=True, text=True).stdout
    return out.split()


async def test_external_command_against_the_daemons_endpoint_gives_a_scored_group(
        tmp_path, tiny_model_dir, image, test_actors):
    tasks = tmp_path / "tasks.jsonl"
    # reward 1 when the first answer had an odd number of tokens (the command writes both counts)
    tasks.write_text(json.dumps({
        "id": "count", "prompt": "Say something.", "image": image,
        "evaluator": {"command": 'set -- $(cat answer.txt); test $(($1 % 2)) = 1'},
        "limits": {"timeout_s": 60}}) + "\n")
    script = HERE / "scripts" / "two_calls_count.py"
    sup, state = make_daemon(tmp_path, endpoint_toml(tiny_model_dir) + f"""
[actors.sink]
factory = "endpoint_test_actors:sink"
config = {{tag = "g"}}

[actors.env]
factory = "fleetrl.actors.envworker:run"
after = ["sink", "endpoint"]
[actors.env.config]
target = "sink"
harness = "external"
endpoint = "endpoint"
harness_config = {{argv = ["{sys.executable}", "{script}"], timeout_s = 60}}
tasks = {{kind = "jsonl", path = "{tasks}", repeat = false}}
group_size = 2
max_concurrent_attempts = 2
max_tasks = 1
drain_grace_s = 5.0
sandbox = {{memory_mb = 256, min_warm = 0}}
""")
    got = test_actors.RECEIVED["g"]
    with state, trio.fail_after(100):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            handle = await sup.wait_handle("endpoint")
            while not got:
                await trio.sleep(0.2)
            open_after = len(handle.registry)
            sup.request_shutdown("test")
    assert not containers_of(state.path)
    assert open_after == 0  # every attempt's key was closed by the harness
    assert [type(m) for m in got] == [RolloutGroup], got
    (group,) = got
    assert group.task_id == "count" and len(group.trajectories) == 2
    assert ROLLOUTS.decode(ROLLOUTS.encode(group)) == group
    model = load_tiny_llama(tiny_model_dir)
    for t in group.trajectories:
        assert t.attempt_id.startswith(group.group_id + "/")
        s0, s1 = t.segments  # the command's two calls, as recorded by the endpoint
        p0, g0 = s0.prompt_ids.to_numpy().tolist(), s0.token_ids.to_numpy().tolist()
        p1, g1 = s1.prompt_ids.to_numpy().tolist(), s1.token_ids.to_numpy().tolist()
        assert 1 <= len(g0) <= 9 and 1 <= len(g1) <= 6
        assert p1[: len(p0) + len(g0)] == p0 + g0  # extended exactly, not re-tokenised
        assert t.metrics["n_calls"] == 2.0
        # the evaluator judged the file the command wrote from the recorded answer
        assert t.reward == (1.0 if len(g0) % 2 == 1 else 0.0), (len(g0), t.reward)
        for prompt, gen, seg in ((p0, g0, s0), (p1, g1, s1)):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + gen])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:-1].gather(1, torch.tensor(gen)[:, None])[:, 0]
            np.testing.assert_allclose(seg.logprobs.to_numpy(), lp.numpy(), atol=2e-4)
    text = sup.metrics_text().decode()
    assert 'fleetrl_envworker_attempts_total{actor="env",outcome="scored"} 2.0' in text


async def test_mini_swe_agent_through_the_daemons_endpoint(tmp_path, long_model_dir, image, test_actors):
    """mini-swe-agent (PyPI, unchanged) as the worker's external command: its calls reach
    the tiny model through the daemon's endpoint and its attempt arrives as a trajectory."""
    import minisweagent  # noqa: F401  (a test dependency: a missing one fails)

    from fleetrl.harness.mswea_env import mini_swe_agent_command, mini_swe_agent_env

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({
        "id": "done", "prompt": "Create the file done.txt holding the word done.", "image": image,
        "evaluator": {"command": 'test "$(cat done.txt 2>/dev/null)" = done'},
        "limits": {"timeout_s": 120, "max_turns": 2}}) + "\n")
    argv = mini_swe_agent_command(step_limit=2, max_tokens=8, action_timeout_s=20)
    env = mini_swe_agent_env(str(tmp_path / "mswea"))
    env_toml = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items()) + "}"
    sup, state = make_daemon(tmp_path, endpoint_toml(long_model_dir, context_length=4096) + f"""
[actors.sink]
factory = "endpoint_test_actors:sink"
config = {{tag = "m"}}

[actors.env]
factory = "fleetrl.actors.envworker:run"
after = ["sink", "endpoint"]
[actors.env.config]
target = "sink"
harness = "external"
endpoint = "endpoint"
harness_config = {{argv = {json.dumps(list(argv))}, timeout_s = 100, env = {env_toml}}}
tasks = {{kind = "jsonl", path = "{tasks}", repeat = false}}
group_size = 1
max_concurrent_attempts = 1
max_tasks = 1
drain_grace_s = 5.0
retry = {{max_failed_per_group = 0}}
sandbox = {{memory_mb = 256, min_warm = 0}}
""")
    got = test_actors.RECEIVED["m"]
    with state, trio.fail_after(150):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            while not got:
                await trio.sleep(0.2)
            sup.request_shutdown("test")
    assert not containers_of(state.path)
    assert [type(m) for m in got] == [RolloutGroup], got
    (t,) = got[0].trajectories
    # mini-swe-agent ended by its own step limit (a random model sends no valid action):
    # two calls, each a ~3,000-token prompt of its own templates, scored 0 by the evaluator
    assert t.metrics["n_calls"] == 2.0 and t.reward == 0.0 and t.metrics["evaluator_exit_code"] == 1.0
    for seg in t.segments:
        assert len(seg.prompt_ids.to_numpy()) > 2500 and 1 <= len(seg.token_ids.to_numpy()) <= 8
        assert seg.sampler.backend == "torch"

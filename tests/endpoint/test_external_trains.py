"""The live loop through an external harness (issue 18, item 1): an environment worker
running an unchanged external program (the official `openai` client) against the
daemon's endpoint, whose every call goes through the sampler pool, and whose groups go
to the real trainer. The pool's sampler follows the trainer's published deltas; the
worker's groups are admitted through the pool's staleness pacer.

Checked: the trainer trains steps from the program's groups; the tokens of the last
step were sampled at a version after the first (the sampler followed the deltas); no
trained token is staler than ``max_staleness`` (pacing held); no container is left
behind."""

from __future__ import annotations

import json
import sys
from functools import partial

import pytest
import trio
from helpers import read_jsonl, supervisor_for

from .conftest import BASE, HERE
from .test_external_worker import containers_of

pytestmark = pytest.mark.docker

MAX_STALENESS = 1
GROUP_SIZE = 2
STEPS = 3


def config(tmp_path, model_dir, image) -> str:
    tasks = tmp_path / "tasks.jsonl"
    # reward 1 when the CRC of the answer file (the answers' token counts and text) is
    # even: sampled answers differ, so about half the groups have reward variance
    tasks.write_text(json.dumps({
        "id": "crc", "prompt": "Say something.", "image": image,
        "evaluator": {"command": "test $(( $(cksum < answer.txt | cut -d ' ' -f 1) % 2 )) -eq 0"},
        "limits": {"timeout_s": 60}}) + "\n")
    weights = tmp_path / "state" / "actors" / "trainer" / "weights"
    script = HERE / "scripts" / "two_calls_count.py"
    return BASE + f"""
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
inbox = 64
[actors.trainer.config]
model_dir = "{model_dir}"
lr = 1e-3
groups_per_step = 1
max_staleness = {MAX_STALENESS}
publish_window = 2
announce_to = ["pool"]
stale_reports_to = "pool"
checkpoint_every = 1000

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

[actors.endpoint]
factory = "fleetrl.actors.endpoint:run"
after = ["pool"]
[actors.endpoint.config]
model = {{kind = "pool", pool = "pool", tokenizer_dir = "{model_dir}"}}
model_name = "tiny"
context_length = 1024
default_max_tokens = 16

[actors.env]
factory = "fleetrl.actors.envworker:run"
after = ["trainer", "endpoint"]
[actors.env.config]
harness = "external"
endpoint = "endpoint"
harness_config = {{argv = ["{sys.executable}", "{script}"], timeout_s = 60}}
tasks = {{kind = "jsonl", path = "{tasks}", repeat = true}}
group_size = {GROUP_SIZE}
max_concurrent_attempts = 4
drain_grace_s = 5.0
sandbox = {{memory_mb = 256, min_warm = 0}}
"""


async def test_an_external_program_trains_the_model_through_the_pool(tmp_path, tiny_model_dir, image):
    sup, state = supervisor_for(tmp_path, config(tmp_path, tiny_model_dir, image))
    with state, trio.fail_after(900):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            trainer = await sup.wait_handle("trainer")
            pool = await sup.wait_handle("pool")
            while trainer.statistics().step < STEPS:
                await trio.sleep(0.2)
            pool_stats = pool.statistics()
            env_stats = (await sup.wait_handle("env")).statistics()
            sup.request_shutdown("test")
    assert not containers_of(state.path)
    steps = [s for s in read_jsonl(state.path / "actors" / "trainer" / "metrics.jsonl") if not s.get("skipped")]
    assert len(steps) >= STEPS, steps
    for s in steps:  # the groups trained are the program's: two attempts, each with its calls' tokens
        assert s["groups"] == 1 and s["trajectories"] == GROUP_SIZE and s["tokens"] > 0
        staleness = [int(k) for k in s["staleness_hist"]]
        assert max(staleness) <= MAX_STALENESS, s  # the pacer's bound held on this path
    last = steps[-1]
    # the last step's tokens were sampled at a version after 0: the sampler followed the deltas
    assert last["version"] - max(int(k) for k in last["staleness_hist"]) >= 1, last
    assert pool_stats.trainer_version >= 1 and pool_stats.answered >= 2 * GROUP_SIZE * STEPS
    assert env_stats.attempts.get("scored", 0) >= GROUP_SIZE * STEPS

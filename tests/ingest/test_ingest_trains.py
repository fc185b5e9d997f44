"""A running `fleetrl serve` trains on traces posted to it while it runs (no restart):
the environment worker's ``ingested`` source waits with nothing to do, a trace is
posted to ``/v1/traces``, and the trainer trains a group of each posted trace's task
(its checkpointed ``trained_ids`` hold the group ids ``TASK#N@env``), at least one with
a non-zero advantage (the evaluator's reward is the sampled answer's CRC modulo 8, over 7:
four different answers all score alike with probability 1/512, so the three groups all
lack variance with probability about 1e-8).

A small real pipeline: trainer (the tiny test model), sampler pool (one torch sampler),
environment worker (completion harness, Docker sandboxes), ingest actor."""

from __future__ import annotations

import signal
import subprocess

import pytest
from helpers import read_jsonl, wait_until
from ingest_daemon import IngestDaemon
from ingest_traces import body, session

from fleetrl.actors.trainer import checkpoint as ck
from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.sandboxes import state_hash

pytestmark = [pytest.mark.docker, pytest.mark.slow]

PIPELINE = """
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
inbox = 64
[actors.trainer.config]
model_dir = "{model}"
lr = 1e-3
groups_per_step = 1
max_staleness = 4
skip_zero_variance = false
announce_to = ["pool"]
stale_reports_to = "pool"
checkpoint_every = 1000
daemon_checkpoint_every = 1

[actors.pool]
factory = "fleetrl.actors.pool:run"
after = ["trainer"]
inbox = 64
[actors.pool.config]
max_staleness = 4
attempts_per_step = 4
weights_dir = "{state}/actors/trainer/weights"
join = false
[[actors.pool.config.samplers]]
id = "torch-fp32"
model_dir = "{model}"
capacity = 4

[actors.env]
factory = "fleetrl.actors.envworker:run"
after = ["trainer", "pool", "ingest"]
[actors.env.config]
tasks = {{kind = "ingested", poll_s = 0.2}}
model = {{kind = "pool", pool = "pool", tokenizer_dir = "{model}", trainer_skips_zero_variance = false}}
harness_config = {{max_tokens = 8}}
group_size = 4
max_concurrent_attempts = 4
drain_grace_s = 5.0
sandbox = {{memory_mb = 256, min_warm = 0, max_warm = 2, max_containers = 2}}
"""


def test_a_trace_posted_while_the_daemon_runs_is_trained(tmp_path, fleetrl_bin, tiny_model_dir, image):
    state = tmp_path / "state"
    daemon = IngestDaemon(tmp_path, fleetrl_bin)
    daemon.config.write_text(daemon.config.read_text() + PIPELINE.format(model=tiny_model_dir, state=state))
    try:
        daemon.start()
        wait_until(lambda: any(e.get("event") == "environment worker ready"
                               for e in read_jsonl(state / "logs" / "daemon.jsonl")),
                   "the worker to start", 300, proc=daemon.proc, stderr=daemon.err)
        crc8 = "echo $(( $(cksum < solution.py | cut -d ' ' -f 1) % 8 ))/7"
        r = daemon.post(body(*(session(i, command=crc8, reward="fraction") for i in (1, 2, 3))), format="fleetrl")
        assert r.status_code == 200 and r.json()["accepted"] == ["trace:s01", "trace:s02", "trace:s03"], r.text
        metrics = state / "actors" / "trainer" / "metrics.jsonl"
        wait_until(lambda: sum(m["groups"] for m in read_jsonl(metrics)) >= 3, "three groups trained", 600,
                   proc=daemon.proc, stderr=daemon.err)
        steps = read_jsonl(metrics)
    finally:
        daemon.kill(signal.SIGTERM, timeout=300)
    assert daemon.proc.returncode == 0, daemon.err.read_text()[-3000:]
    ckpt, _ = CheckpointStore(state / "checkpoints").load_latest()
    trained = ck.decode(ckpt.actors["trainer"]).buffer.trained_ids
    assert {"trace:s01#0@env", "trace:s02#1@env", "trace:s03#2@env"} <= set(trained), trained
    assert any(not m["skipped"] for m in steps), steps  # learned from an ingested group
    emitted = [e for e in read_jsonl(state / "logs" / "daemon.jsonl") if e.get("event") == "group emitted"]
    assert sorted(e["task"] for e in emitted) == ["trace:s01", "trace:s02", "trace:s03"]
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state)}"],
                          check=True, capture_output=True, text=True).stdout.split()
    assert left == []  # the worker's sandboxes were removed at shutdown

"""SIGKILL `fleetrl serve` while the trainer trains, start it again: it resumes from the
last checkpoint, versions continue, and every group is trained exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
from helpers import read_jsonl, wait_until

from fleetrl.actors.model import BOS_ID
from fleetrl.actors.trainer import checkpoint as ck
from fleetrl.actors.weights import Follower, LocalDirStore, StoreSource
from fleetrl.daemon.checkpoint import CheckpointStore

HERE = Path(__file__).resolve().parent

CONFIG = """
[daemon]
grace_s = 60.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
inbox = 2
[actors.trainer.config]
model_dir = "{model_dir}"
groups_per_step = 1
checkpoint_every = 1
max_staleness = 1000
lr = 1e-2
[actors.feeder]
factory = "trainer_test_actors:file_feeder"
after = ["trainer"]
config = {{path = "{feed}", interval_s = 0.3}}
"""


def test_sigkill_then_restart_trains_every_group_exactly_once(model_dir, groups, tmp_path):
    n = 4
    gs = [groups.sampled(model_dir, f"k{i}", [BOS_ID, *b"y="], [0.0, 1.0], seed=60 + i) for i in range(n)]
    feed = tmp_path / "feed.msgpack"
    feed.write_bytes(msgspec.msgpack.encode(gs))
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG.format(model_dir=model_dir, feed=feed))
    state = tmp_path / "state"
    metrics = state / "actors" / "trainer" / "metrics.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    argv = [str(Path(sys.executable).parent / "fleetrl"), "serve", "--config", str(cfg), "--state-dir", str(state)]

    first = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(read_jsonl(metrics)) >= 2, "two train steps", 90.0, proc=first, interval=0.05)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    killed_at = len(read_jsonl(metrics))
    assert killed_at < n  # the kill really interrupted training

    second = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: any(x["step"] == n for x in read_jsonl(metrics)), f"step {n}", 90.0,
                   proc=second, interval=0.05)
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait(30)

    ckpt, _ = CheckpointStore(state / "checkpoints").load_latest()
    tc = ck.decode(ckpt.actors["trainer"])
    # exactly once: n distinct groups trained, n steps in the surviving history, none queued
    assert sorted(tc.buffer.trained_ids) == sorted(g.group_id for g in gs)
    assert tc.buffer.counters.trained == n and tc.step == n and tc.buffer.queued == ()
    assert tc.buffer.counters.duplicate >= 1  # the feeder re-sent what was already trained
    # versions never repeat or go back across the kill
    versions = [x["version"] for x in read_jsonl(metrics)]
    assert versions == sorted(set(versions))
    # and the published stream is followable to its digest
    source = StoreSource(LocalDirStore(state / "actors" / "trainer" / "weights"))
    manifest = source.manifest()
    follower = Follower.from_manifest(manifest)
    follower.sync(source)
    assert follower.digest.hex() == manifest.digest and manifest.version == tc.version

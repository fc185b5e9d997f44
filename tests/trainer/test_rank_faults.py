"""The trainer as 2 FSDP2 rank processes inside a real `fleetrl serve`: SIGKILL rank 1 in
the middle of the run; the trainer restarts its rank group from the last sharded
checkpoint, replays the steps since, and goes on; `fleetrl status` shows the restart;
no other actor stopped; every group is trained exactly once; the published stream
continues without a repeated version and follows to its digest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
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
grace_s = 120.0
checkpoint_interval_s = 1000.0
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
inbox = 2
[actors.trainer.config]
model_dir = "{model_dir}"
groups_per_step = 1
checkpoint_every = 3
max_staleness = 1000
lr = 1e-2
[actors.trainer.config.ranks]
world_size = 2
threads = 1
restart = {{backoff_base_s = 0.2, backoff_max_s = 1.0}}
[actors.feeder]
factory = "trainer_test_actors:file_feeder"
after = ["trainer"]
config = {{path = "{feed}", interval_s = 0.6}}
"""


def _status(fleetrl: str, state: Path, env: dict) -> dict:
    out = subprocess.run([fleetrl, "status", "--json", "--state-dir", str(state)], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_sigkill_of_rank_1_restarts_the_ranks_and_trains_every_group_once(model_dir, groups, tmp_path,
                                                                            fleetrl_bin):
    n = 8
    gs = [groups.sampled(model_dir, f"r{i}", [BOS_ID, *b"y="], [0.0, 1.0], seed=80 + i) for i in range(n)]
    feed = tmp_path / "feed.msgpack"
    feed.write_bytes(msgspec.msgpack.encode(gs))
    cfg = tmp_path / "run.toml"
    cfg.write_text(CONFIG.format(model_dir=model_dir, feed=feed))
    state = tmp_path / "state"
    trainer_dir = state / "actors" / "trainer"
    metrics = trainer_dir / "metrics.jsonl"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    stderr = tmp_path / "serve.err"
    argv = [fleetrl_bin, "serve", "--config", str(cfg), "--state-dir", str(state)]
    with stderr.open("wb") as err:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_until(lambda: len(read_jsonl(metrics)) >= 4, "four train steps", 240.0, proc=proc, stderr=stderr,
                   interval=0.05)
        before = _status(fleetrl_bin, state, env)["actors"]
        ranks = before["trainer"]["statistics"]["ranks"]
        assert ranks["world_size"] == 2 and ranks["restarts"] == 0 and len(ranks["pids"]) == 2
        killed_at = time.monotonic()
        os.kill(ranks["pids"][1], signal.SIGKILL)
        st = wait_until(lambda: (s := _status(fleetrl_bin, state, env)["actors"])["trainer"]["statistics"]["ranks"]
                        ["restarts"] >= 1 and s, "the rank group's restart", 60.0, proc=proc, stderr=stderr,
                        interval=0.2)
        assert time.monotonic() - killed_at < 30  # noticed within seconds, restarted
        after = st["trainer"]["statistics"]["ranks"]
        assert "rank 1" in after["last_failure"] and "SIGKILL" in after["last_failure"], after
        wait_until(lambda: any(x["step"] == n for x in read_jsonl(metrics)), f"step {n}", 240.0, proc=proc,
                   stderr=stderr, interval=0.1)
        final = _status(fleetrl_bin, state, env)["actors"]
        new_pids = final["trainer"]["statistics"]["ranks"]["pids"]
        assert not set(new_pids) & set(ranks["pids"])  # a new group
        # the other actors never stopped: no restart, same incarnation; the trainer actor itself neither
        for name in ("trainer", "feeder"):
            assert final[name]["restarts"] == 0 and final[name]["incarnation"] == before[name]["incarnation"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, stderr.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    for pid in new_pids + ranks["pids"]:  # no rank process outlives the daemon
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()

    ckpt, _ = CheckpointStore(trainer_dir / "checkpoints").load_latest()
    tc = ck.decode(ckpt.actors["trainer"])
    assert tc.sharded is not None and (trainer_dir / "sharded" / tc.sharded).is_dir()
    # exactly once: n distinct groups, n steps logged once each, none queued
    assert sorted(tc.buffer.trained_ids) == sorted(g.group_id for g in gs)
    assert tc.buffer.counters.trained == n and tc.step == n and tc.buffer.queued == ()
    steps = [x["step"] for x in read_jsonl(metrics) if not x["skipped"]]
    assert steps == list(range(1, n + 1))
    versions = [x["version"] for x in read_jsonl(metrics)]
    assert versions == sorted(set(versions))
    source = StoreSource(LocalDirStore(trainer_dir / "weights"))
    manifest = source.manifest()
    follower = Follower.from_manifest(manifest)
    follower.sync(source)
    assert follower.digest.hex() == manifest.digest and manifest.version == tc.version
    logs = (trainer_dir / "ranks" / "rank-1.log").read_text()
    assert logs.count("rank 1/2 pid") == 2  # joined twice: before and after the kill

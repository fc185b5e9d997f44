"""SIGKILL the embedded default's daemon while it trains, start it again: it resumes
from the last checkpoint, the version sequence continues, no rollout group that a
checkpoint holds (or that a worker's checkpointed cursor counts as delivered) is lost
or trained twice, and no sandbox container is left behind.

The whole tiny.toml pipeline runs as a real `fleetrl serve` subprocess (warm-start
actor, trainer, sampler pool with fp32/bf16/fp8 torch samplers, environment worker with
Docker sandboxes, evaluator, janitor), shortened: 4 tasks x 4 attempts per step."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from helpers import read_jsonl

from fleetrl.actors.envworker import CursorState, group_id_of
from fleetrl.actors.trainer import checkpoint as ck
from fleetrl.actors.weights import LocalDirStore, StoreSource
from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.harness.synthetic import make_task

from .conftest import containers_of
from .tiny_config import derive

pytestmark = [pytest.mark.docker, pytest.mark.slow]


def _config(state: Path, cache: Path) -> str:
    return derive(state, {
        "daemon": {"grace_s": "300.0", "checkpoint_interval_s": "1000.0"},
        "logging": {"console": '"none"'},
        "actors.warm_start.config": {"cache_dir": f'"{cache}"'},
        "actors.trainer.config": {"groups_per_step": "4", "max_steps": "1000", "checkpoint_every": "1",
                                  "daemon_checkpoint_every": "1", "max_staleness": "1000", "progress": "false",
                                  "lr": "1e-3", "time_budget_s": None},
        "actors.pool.config": {"attempts_per_step": "16"},
        "actors.env.config": {"group_size": "4", "max_concurrent_attempts": "8", "drain_grace_s": "20.0"},
        "actors.evaluator.config": {"n": "8", "every_versions": "100000", "progress": "false", "splits": '["fresh"]'},
    })


def _emitted(log_path: Path) -> dict[str, list[float]]:
    """group id -> rewards, from the environment worker's `group emitted` log lines."""
    return {e["group"]: e["rewards"] for e in read_jsonl(log_path) if e.get("event") == "group emitted"}


def test_sigkill_during_training_resumes_exactly_once_without_leaks(tmp_path, warm_cache, fleetrl_bin, daemons):
    state = tmp_path / "state"
    cfg = tmp_path / "tiny-test.toml"
    cfg.write_text(_config(state, warm_cache))
    argv = [fleetrl_bin, "serve", "--config", str(cfg), "--state-dir", str(state)]
    metrics = state / "actors" / "trainer" / "metrics.jsonl"
    steps = lambda: [x for x in read_jsonl(metrics) if not x["skipped"]]  # noqa: E731

    first = daemons(argv, tmp_path, "first")
    first.wait_for(lambda: len(steps()) >= 2, "two train steps", timeout=1800)
    first.kill(signal.SIGKILL)
    killed_versions = [x["version"] for x in steps()]
    published = StoreSource(LocalDirStore(state / "actors" / "trainer" / "weights")).manifest().version
    ckpt, _ = CheckpointStore(state / "checkpoints").load_latest()
    assert ckpt is not None, "no daemon checkpoint before the kill"
    before = ck.decode(ckpt.actors["trainer"])
    cursor = CursorState(**ckpt.actors["env"]) if isinstance(ckpt.actors["env"], dict) else ckpt.actors["env"]
    held_before = set(before.buffer.trained_ids) | {g.group_id for g in before.buffer.queued}
    assert before.step >= 1

    second = daemons(argv, tmp_path, "second")
    target = before.step + 2
    second.wait_for(lambda: any(x["step"] >= target for x in steps()), f"step {target}", timeout=1800)
    second.kill(signal.SIGTERM, timeout=1200)
    assert second.proc.returncode == 0, second.err_path.read_text(errors="replace")[-3000:]

    # no sandbox left: the first daemon's were swept by the janitor, the second's removed at exit
    assert containers_of(state) == []

    final, _ = CheckpointStore(state / "checkpoints").load_latest()
    after = ck.decode(final.actors["trainer"])
    trained = list(after.buffer.trained_ids)
    held_after = set(trained) | {g.group_id for g in after.buffer.queued}
    # trained at most once, and the counters agree
    assert len(trained) == len(set(trained)) == after.buffer.counters.trained
    # nothing the restored checkpoint held is lost
    assert held_before <= held_after
    # every task the worker's restored cursor counted as delivered reached the trainer:
    # its group is held, or was refused for zero variance (all rewards equal)
    emitted = _emitted(state / "logs" / "daemon.jsonl")
    delivered = [i for i in range(cursor.floor)] + list(cursor.done)
    assert delivered, "the checkpoint holds no delivered task"
    for i in delivered:
        gid = group_id_of(make_task(0, "train", i).id, i, "env")
        if gid in emitted and len(set(emitted[gid])) > 1:
            assert gid in held_after, f"group {gid} was delivered before the checkpoint but is lost"
    # versions never repeat or go back; the restart continued after the last published one
    versions = [x["version"] for x in steps()]
    assert versions == sorted(set(versions))
    resumed = [v for v in versions if v > max(killed_versions)]
    assert resumed and min(resumed) > published
    assert after.step >= target and after.version > published
    print(f"killed at versions {killed_versions} (published {published}); resumed from step {before.step}; "
          f"final step {after.step} version {after.version}; {len(trained)} groups trained once",
          file=sys.stderr)

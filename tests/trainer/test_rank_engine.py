"""`RankEngine` with real rank processes (2 gloo ranks on 127.0.0.1): a rank killed before a
step, or one that hangs, is found, the group restarts from its sharded checkpoint and
replays the steps since, and the weights come out bit-identical to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fleetrl.actors.model import BOS_ID
from fleetrl.actors.trainer import RanksConfig, TrainerConfig
from fleetrl.actors.trainer.errors import RanksFailed
from fleetrl.actors.trainer.rank_engine import RankEngine
from fleetrl.actors.weights import LocalDirStore, StoreSource
from fleetrl.daemon.config import RestartPolicy

FAST_RESTART = RestartPolicy(backoff_base_s=0.1, backoff_max_s=0.5, intensity=3, period_s=600.0)


def _config(model_dir: str, **ranks) -> TrainerConfig:
    return TrainerConfig(model_dir=model_dir, lr=1e-2, groups_per_step=1,
                         ranks=RanksConfig(world_size=2, threads=1, restart=FAST_RESTART, **ranks))


def _wait_gone(engine: RankEngine, rank: int) -> None:
    proc = engine.group.procs[rank]
    proc.wait(30)


def _digest(state_dir) -> str:
    return StoreSource(LocalDirStore(state_dir / "weights")).manifest().digest


@pytest.fixture
def four_groups(model_dir, groups):
    return [groups.sampled(model_dir, f"e{i}", [BOS_ID, *b"y="], [0.0, 1.0], seed=90 + i) for i in range(4)]


def _run(cfg: TrainerConfig, state_dir, gs, *, kill_before_last: bool):
    engine = RankEngine(cfg, state_dir, "test", sleep=time.sleep)
    restarts: list[str] = []
    engine.on_restart = restarts.append
    try:
        engine.start(None)
        metrics = []
        for step, g in enumerate(gs):
            if step == 1:
                assert engine.capture(1).sharded == "step-00000001"  # replay starts after it
            if kill_before_last and step == len(gs) - 1:
                os.kill(engine.pids[1], signal.SIGKILL)
                _wait_gone(engine, 1)
            metrics.append(engine.train([g], lr=1e-2, step=step, trainer_version=engine.version))
        return metrics, engine.status(), restarts, _digest(state_dir), engine.version
    finally:
        engine.close()


def test_a_rank_killed_before_a_step_restarts_replays_and_matches_an_uninterrupted_run(model_dir, four_groups,
                                                                                        tmp_path):
    cfg = _config(model_dir)
    ref, ref_status, ref_restarts, ref_digest, ref_version = _run(cfg, tmp_path / "ref", four_groups,
                                                                  kill_before_last=False)
    got, status, restarts, digest, version = _run(cfg, tmp_path / "killed", four_groups, kill_before_last=True)
    assert ref_restarts == [] and ref_status.restarts == 0
    assert status.restarts == 1 and len(restarts) == 1
    assert "rank 1" in restarts[0] and "SIGKILL" in restarts[0], restarts
    assert status.checkpoint_step == 1 and status.replay_steps == 3  # steps 2, 3 replayed, then step 4
    assert not set(status.pids) & set(ref_status.pids)
    assert [m.step for m in got] == [1, 2, 3, 4] and all(not m.skipped for m in got)
    for a, b in zip(ref, got):
        assert a.loss == b.loss and a.grad_norm == b.grad_norm
    # the same published versions, and the last one bit-identical (its digest) to the uninterrupted run's
    assert version == ref_version == 4 and digest == ref_digest


def test_a_hung_rank_times_out_and_a_rank_dead_while_idle_is_restarted_by_check(model_dir, four_groups, tmp_path):
    cfg = _config(model_dir, step_timeout_s=5.0)
    engine = RankEngine(cfg, tmp_path / "state", "test")
    try:
        engine.start(None)
        detail: list = []  # the rollout log's per-token detail comes back from rank 0, every rank's rows
        engine.train([four_groups[0]], lr=1e-2, step=0, trainer_version=engine.version, detail=detail)
        assert sorted(d.origin for d in detail) == [(0, 0, 0), (0, 1, 0)]
        assert [len(d.trainer_logprobs) for d in detail] == [int(four_groups[0].trajectories[o[1]].n_generated)
                                                            for o in (d.origin for d in detail)]
        os.kill(engine.pids[1], signal.SIGSTOP)  # alive, but never answers
        m = engine.train([four_groups[1]], lr=1e-2, step=1, trainer_version=engine.version)
        assert m.step == 2 and engine.restarts == 1
        assert "no answer to step 2 within 5 s" in engine.last_failure
        assert engine.check() is False  # all alive: nothing to do
        os.kill(engine.pids[0], signal.SIGKILL)
        _wait_gone(engine, 0)
        assert engine.check() is True and engine.restarts == 2
        assert "rank 0" in engine.last_failure and "while idle" in engine.last_failure
        m = engine.train([four_groups[2]], lr=1e-2, step=2, trainer_version=engine.version)
        assert m.step == 3
        procs = list(engine.group.procs)
    finally:
        engine.close()
    assert all(p.poll() is not None for p in procs)  # close() left no rank running


def test_a_group_that_cannot_start_names_the_rank_and_its_log(tmp_path, model_dir):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    engine = RankEngine(_config(str(bad), start_timeout_s=120.0), tmp_path / "state", "test")
    with pytest.raises(RanksFailed, match="rank 0") as err:
        engine.start(None)
    assert f"logs: {tmp_path / 'state' / 'ranks'}" in str(err.value)
    log = (tmp_path / "state" / "ranks" / "rank-0.log").read_text()
    assert "config.json" in log

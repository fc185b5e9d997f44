"""The trainer wired into a run with a budget: it announces every version to the
``announce_to`` actors, asks the daemon for a checkpoint every
``daemon_checkpoint_every`` steps, ends the run by itself at ``max_steps``
(``shutdown_when_done``: the daemon exits 0 with no outside signal), and accounts the
samplers' cost per step (``cost_usd``, ``usd_per_rollout``)."""

from __future__ import annotations

import json
import random

import msgspec
import pytest
import trio

from fleetrl.actors.model import BOS_ID
from fleetrl.actors.trainer import TrainerConfig
from fleetrl.actors.trainer import checkpoint as ck
from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.faults import ExitCode
from fleetrl.daemon.messages import WeightVersionAvailable
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor, run_inline



def _budget_run(model_dir: str, trainer: str, *, pool: bool = False, feeder: str = "") -> str:
    """A daemon config: the trainer (2 groups per step, ending the run when its budget is
    spent, plus the ``trainer`` TOML lines), a feeder, and with ``pool`` a sink for it."""
    sink = '[actors.pool]\nfactory = "trainer_test_actors:sink"\n' if pool else ""
    return f"""
[daemon]
grace_s = 60.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
{sink}[actors.trainer]
factory = "fleetrl.actors.trainer:run"
inbox = 8
[actors.trainer.config]
model_dir = "{model_dir}"
groups_per_step = 2
max_staleness = 100
shutdown_when_done = true
{trainer}
[actors.feeder]
factory = "trainer_test_actors:feeder"
after = ["trainer"]
{feeder}
"""


def _priced(group, usd_per_call: float):
    """The group with every model call costing ``usd_per_call``."""
    trajs = tuple(msgspec.structs.replace(t, segments=tuple(
        msgspec.structs.replace(s, cost_usd=usd_per_call) for s in t.segments)) for t in group.trajectories)
    return msgspec.structs.replace(group, trajectories=trajs)


async def test_budget_ends_the_run_announcing_versions_and_costing_rollouts(model_dir, groups, feed, tmp_path):
    prompt = [BOS_ID, *b"def f(x):"]
    feed.FEED.extend(_priced(groups.sampled(model_dir, f"g{i}", prompt, [1.0, 0.0, 0.5], seed=40 + i), 0.01 * (i + 1))
                     for i in range(5))
    text = _budget_run(model_dir, """lr = 1e-2
max_steps = 2
daemon_checkpoint_every = 1
announce_to = ["pool"]""", pool=True)
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(load_config_text(text, source="test.toml"), state, rng=random.Random(0))
    with state, trio.fail_after(180):
        code = await sup.run(handle_signals=False)  # nobody asks it to stop: the budget does
    assert code == ExitCode.OK
    assert sup._shutdown_reason == "requested by actor 'trainer': trainer: max_steps=2 reached"
    # every published version was announced, in order, with its digest
    announced = [m for m in feed.GOT if isinstance(m, WeightVersionAvailable)]
    assert [m.version for m in announced] == [0, 1, 2]
    assert all(m.base is None and len(m.digest) > 0 for m in announced)
    # checkpoints: requested at step 1, at the budget (step 2), then the final one
    ckpt, _ = CheckpointStore(state.checkpoints).load_latest()
    assert ckpt.seq == 3
    tc = ck.decode(ckpt.actors["trainer"])
    assert tc.step == 2 and len(tc.buffer.trained_ids) == 4
    # $ per rollout: the sum of the batch's per-call costs over its trajectories
    lines = [json.loads(x) for x in (tmp_path / "state" / "actors" / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    for line, pair in zip(lines, [(0, 1), (2, 3)], strict=True):
        expect = sum(3 * 0.01 * (i + 1) for i in pair)  # 3 trajectories x 1 call each
        assert line["cost_usd"] == pytest.approx(expect)
        assert line["usd_per_rollout"] == pytest.approx(expect / 6)
    assert b'fleetrl_trainer_cost_usd_total{actor="trainer"}' in sup.metrics_text()


async def test_a_spent_time_budget_ends_the_run_even_while_no_group_arrives(model_dir, groups, feed, tmp_path,
                                                                           autojump_clock):
    """On virtual time: the kernel's clock is Trio's (autojump), and the trainer's blocking
    work runs inline, so the budget is spent exactly when the virtual clock says so."""
    prompt = [BOS_ID, *b"def f(x):"]
    feed.FEED.extend(groups.sampled(model_dir, f"g{i}", prompt, [1.0, 0.0], seed=60 + i) for i in range(3))
    text = _budget_run(model_dir, """lr_schedule = "cosine"
time_budget_s = 4.0""", feeder="config = {hold = true, interval_s = 0.5}")
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(load_config_text(text, source="test.toml"), state, rng=random.Random(0),
                     run_blocking=run_inline, clock=trio.current_time)
    with state, trio.fail_after(180):
        code = await sup.run(handle_signals=False)  # one step, then the third group waits for a partner
    assert code == ExitCode.OK
    assert sup._shutdown_reason == "requested by actor 'trainer': trainer: time_budget_s=4 spent at step 1"
    tc = ck.decode(CheckpointStore(state.checkpoints).load_latest()[0].actors["trainer"])
    assert tc.step == 1 and tc.elapsed_s >= 4.0 and len(tc.buffer.queued) == 1  # the third group kept
    (line,) = [json.loads(x) for x in (tmp_path / "state" / "actors" / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert 0 < line["elapsed_s"] < 4.0 and line["lr"] < 2e-4  # the cosine already moved by the time spent


def test_budget_config_is_checked(model_dir):
    with pytest.raises(ValueError, match="shutdown_when_done needs max_steps or time_budget_s"):
        TrainerConfig(model_dir=model_dir, shutdown_when_done=True)
    with pytest.raises(ValueError, match=r"announce_to\[0\] must be an actor name"):
        TrainerConfig(model_dir=model_dir, announce_to=("",))
    with pytest.raises(ValueError, match="daemon_checkpoint_every must be in"):
        TrainerConfig(model_dir=model_dir, daemon_checkpoint_every=0)


async def test_unknown_announce_target_is_a_clear_error(model_dir, tmp_path):
    text = f"""
[daemon]
grace_s = 5.0
[http]
enabled = false
[supervisor.restart]
intensity = 1
backoff_base_s = 0.1
jitter = 0.0
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
config = {{model_dir = "{model_dir}", announce_to = ["nobody"]}}
"""
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(load_config_text(text, source="test.toml"), state, rng=random.Random(0))
    with state, trio.fail_after(120):
        code = await sup.run(handle_signals=False)
    assert code == ExitCode.ESCALATED
    assert "TrainerConfig.announce_to = 'nobody' names no configured actor" in str(sup.escalation)


async def test_a_failed_daemon_checkpoint_falls_back_to_the_trainers_own_file(model_dir, groups, feed, tmp_path,
                                                                            monkeypatch):
    """Both checkpoints due at step 1 (checkpoint_every = daemon_checkpoint_every = 1): the
    trainer leaves it to the daemon's; when that write fails (disk full), the trainer's
    own file is written instead, and training goes on."""
    prompt = [BOS_ID, *b"def f(x):"]
    feed.FEED.extend(groups.sampled(model_dir, f"g{i}", prompt, [1.0, 0.0], seed=80 + i) for i in range(4))
    state = StateDir(tmp_path / "state").open()
    write = CheckpointStore.write
    own: list[int] = []
    daemon: list[int] = []

    def failing_daemon_write(self, run_id, actors):  # the daemon's first write fails
        if self.dir != state.checkpoints:
            own.append(ck.decode(actors["trainer"]).step)
        elif not daemon:
            daemon.append(-1)
            raise OSError(28, "No space left on device")
        else:
            daemon.append(ck.decode(actors["trainer"]).step)
        return write(self, run_id, actors)

    monkeypatch.setattr(CheckpointStore, "write", failing_daemon_write)
    text = _budget_run(model_dir, """max_steps = 2
checkpoint_every = 1
daemon_checkpoint_every = 1""")
    sup = Supervisor(load_config_text(text, source="test.toml"), state, rng=random.Random(0))
    with state, trio.fail_after(180):
        code = await sup.run(handle_signals=False)
    assert code == ExitCode.OK  # the failed daemon checkpoint did not stop the run
    # step 1: the daemon's failed, so the trainer's own file; step 2 ends the budget (no
    # daemon checkpoint is due at it: the own file in the step, again at the budget before
    # the daemon's, and when the actor ends, before the daemon's final one)
    assert own == [1, 2, 2, 2] and daemon == [-1, 2, 2]

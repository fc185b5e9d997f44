"""The learning-rate schedule: its shape (Hypothesis), its config checks, and the trainer
stepping with it (the rate each step used is the schedule's, across a restart)."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.actors.model import BOS_ID
from fleetrl.actors.trainer import Trainer, TrainerConfig
from fleetrl.actors.trainer.schedule import lr_at


def test_endpoints_of_each_schedule():
    assert [lr_at(s, lr=1.0) for s in (0, 5, 10**6)] == [1.0, 1.0, 1.0]
    for kind in ("cosine", "linear"):
        assert lr_at(0, lr=2.0, schedule=kind, max_steps=11, min_ratio=0.25) == 2.0
        assert lr_at(10, lr=2.0, schedule=kind, max_steps=11, min_ratio=0.25) == pytest.approx(0.5)
        assert lr_at(50, lr=2.0, schedule=kind, max_steps=11, min_ratio=0.25) == pytest.approx(0.5)  # past the budget
    assert lr_at(5, lr=1.0, schedule="cosine", max_steps=11, min_ratio=0.0) == pytest.approx(0.5)  # half way
    assert lr_at(5, lr=1.0, schedule="linear", max_steps=11, min_ratio=0.0) == pytest.approx(0.5)
    assert lr_at(2, lr=1.0, schedule="cosine", max_steps=11, min_ratio=0.0) > \
        lr_at(2, lr=1.0, schedule="linear", max_steps=11, min_ratio=0.0)  # cosine starts flat
    assert [lr_at(s, lr=1.0, warmup_steps=4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_at(0, lr=1.0, schedule="cosine", max_steps=1) == 1.0  # a one-step budget


def test_a_decaying_schedule_without_a_budget_or_a_negative_step_is_refused():
    with pytest.raises(ValueError, match="'cosine' learning-rate schedule needs max_steps or a time budget"):
        lr_at(3, lr=1.0, schedule="cosine")
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="time_fraction must be a finite number >= 0"):
            lr_at(3, lr=1.0, schedule="cosine", max_steps=10, time_fraction=bad)
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_at(-1, lr=1.0)


def test_a_time_budget_decays_the_rate_by_whichever_budget_is_further_along():
    def at(step, frac, max_steps=101):
        return lr_at(step, lr=1.0, schedule="linear", max_steps=max_steps, min_ratio=0.0, time_fraction=frac)

    assert at(10, 0.0) == at(10, None) == pytest.approx(0.9)  # time not yet further along
    assert at(10, 0.5) == pytest.approx(0.5)  # half the time spent at a tenth of the steps
    assert at(60, 0.5) == pytest.approx(0.4)  # the steps further along
    assert at(10, 1.0) == at(10, 7.0) == pytest.approx(0.0)  # the time budget spent: the floor
    assert lr_at(0, lr=1.0, schedule="cosine", time_fraction=0.5, min_ratio=0.0) == pytest.approx(0.5)  # time alone
    assert lr_at(3, lr=1.0, schedule="constant", max_steps=10, time_fraction=0.9) == 1.0
    assert lr_at(1, lr=1.0, schedule="cosine", max_steps=10, warmup_steps=4, time_fraction=0.9) == 0.5  # ramp by steps


@given(lr=st.floats(1e-6, 1.0), kind=st.sampled_from(["cosine", "linear"]), max_steps=st.integers(1, 400) | st.none(),
       warmup=st.integers(0, 20), ratio=st.floats(0.0, 1.0),
       fracs=st.lists(st.floats(0.0, 2.0), min_size=1, max_size=60))
def test_with_a_time_budget_the_rate_stays_in_its_band_and_never_rises(lr, kind, max_steps, warmup, ratio, fracs):
    fracs = sorted(fracs)  # time only moves forward, one step at a time
    rates = [lr_at(warmup + i, lr=lr, schedule=kind, max_steps=max_steps, warmup_steps=warmup, min_ratio=ratio,
                   time_fraction=f) for i, f in enumerate(fracs)]
    assert all(lr * ratio * (1 - 1e-12) <= r <= lr * (1 + 1e-12) for r in rates)
    assert all(b <= a * (1 + 1e-12) for a, b in zip(rates, rates[1:]))
    if fracs[-1] >= 1.0:
        assert rates[-1] == pytest.approx(lr * ratio)


@given(lr=st.floats(1e-6, 1.0), kind=st.sampled_from(["constant", "cosine", "linear"]),
       max_steps=st.integers(1, 400), warmup=st.integers(0, 50), ratio=st.floats(0.0, 1.0))
def test_the_rate_stays_in_its_band_and_never_rises_after_the_warmup(lr, kind, max_steps, warmup, ratio):
    rates = [lr_at(s, lr=lr, schedule=kind, max_steps=max_steps, warmup_steps=warmup, min_ratio=ratio)
             for s in range(max_steps + 5)]
    floor = min(lr * ratio, lr / warmup) if warmup else lr * ratio
    assert all(floor * (1 - 1e-12) <= r <= lr * (1 + 1e-12) for r in rates)
    after = rates[warmup:]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(after, after[1:]))
    assert all(a < b for a, b in zip(rates[:warmup], rates[1:warmup + 1]) if a < lr)


def test_config_checks_name_the_field():
    base = dict(model_dir="m", max_steps=10)
    with pytest.raises(ValueError, match=r"TrainerConfig.lr_schedule = 'cosine' needs max_steps or time_budget_s"):
        TrainerConfig(model_dir="m", lr_schedule="cosine")
    with pytest.raises(ValueError, match=r"TrainerConfig.lr_schedule must be one of 'constant', 'cosine', 'linear', got 'exponential'"):
        TrainerConfig(**base, lr_schedule="exponential")
    with pytest.raises(ValueError, match=r"TrainerConfig.lr_min_ratio must be in \[0.0, 1.0\]"):
        TrainerConfig(**base, lr_min_ratio=1.5)
    with pytest.raises(ValueError, match=r"TrainerConfig.lr_warmup_steps must be an int"):
        TrainerConfig(**base, lr_warmup_steps=2.5)
    with pytest.raises(msgspec.ValidationError, match=r"Invalid enum value 'step' - at `\$.lr_schedule`"):
        msgspec.convert({**base, "lr_schedule": "step"}, TrainerConfig)
    assert TrainerConfig(**base).lr_schedule == "constant"
    for bad in (0.0, -5.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="TrainerConfig.time_budget_s must be"):
            TrainerConfig(model_dir="m", time_budget_s=bad)
    assert TrainerConfig(model_dir="m", lr_schedule="cosine", time_budget_s=60.0).time_budget_s == 60.0


def test_the_trainer_steps_at_the_scheduled_rate_across_a_restart(model_dir, groups, tmp_path):
    cfg = TrainerConfig(model_dir=model_dir, groups_per_step=1, lr=1e-2, lr_schedule="cosine", max_steps=4,
                        lr_min_ratio=0.1, checkpoint_every=1)
    want = [lr_at(s, lr=1e-2, schedule="cosine", max_steps=4, min_ratio=0.1) for s in range(4)]
    assert want[0] == 1e-2 and want[-1] == pytest.approx(1e-3) and len(set(want)) == 4
    seen = []

    def run(trainer, n):
        for i in range(n):
            g = groups.sampled(model_dir, f"g{len(seen)}", [BOS_ID, *b"hi"], [1.0, 0.0], seed=len(seen),
                                 version=trainer.version)
            trainer.buffer.offer(g, trainer.version)
            m, _ = trainer.take_and_train()
            assert not m.skipped
            assert all(pg["lr"] == m.lr for pg in trainer.optimizer.param_groups)
            seen.append(m.lr)

    t = Trainer(cfg, tmp_path, "run-1")
    t.start(None)
    run(t, 2)
    t2 = Trainer(cfg, tmp_path, "run-1")  # restarts from the checkpoint after step 2
    t2.start(None)
    assert t2.step == 2 and math.isclose(t2.lr_now(), want[2])
    run(t2, 2)
    assert seen == pytest.approx(want, rel=0, abs=0)


def test_a_time_budget_steers_the_rate_ends_training_and_survives_a_restart(model_dir, groups, tmp_path):
    now = [1000.0]

    def clock() -> float:
        return now[0]
    cfg = TrainerConfig(model_dir=model_dir, groups_per_step=1, lr=1e-2, lr_schedule="linear", lr_min_ratio=0.0,
                        max_steps=1000, time_budget_s=100.0, checkpoint_every=1)

    def step(trainer):
        g = groups.sampled(model_dir, f"g{trainer.step}", [BOS_ID, *b"hi"], [1.0, 0.0], seed=trainer.step,
                           version=trainer.version)
        trainer.buffer.offer(g, trainer.version)
        m, _ = trainer.take_and_train()
        assert not m.skipped
        return m

    t = Trainer(cfg, tmp_path, "run-1", clock=clock)
    t.start(None)
    now[0] += 40.0
    m = step(t)  # 40% of the time at step 0 of 1000: the time fraction steers the rate
    assert m.lr == pytest.approx(6e-3) and m.elapsed_s == pytest.approx(40.0)
    assert t.time_left_s() == pytest.approx(60.0) and not t.done
    now[0] += 500.0  # the daemon was killed long after the checkpoint: that time is not counted
    t2 = Trainer(cfg, tmp_path, "run-1", clock=clock)
    t2.start(None)
    assert t2.step == 1 and t2.elapsed_s == pytest.approx(40.0)
    now[0] += 30.0
    assert t2.lr_now() == pytest.approx(3e-3)
    assert step(t2).elapsed_s == pytest.approx(70.0)
    now[0] += 30.0
    assert t2.done and t2.time_left_s() == 0.0 and not t2.ready()
    assert t2.stop_reason() == "time_budget_s=100 spent at step 2"
    t3 = Trainer(msgspec.structs.replace(cfg, time_budget_s=None), tmp_path, "run-1", clock=clock)
    t3.start(None)  # without a time budget the same state trains on: steps alone count
    assert not t3.done and t3.lr_now() == pytest.approx(1e-2 * (1 - 2 / 999))

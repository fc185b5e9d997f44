"""One run's numbers in the ablation: reward-curve area, grad-norm std and max, skipped
steps, mismatch KL, staleness, collapse, first and last held-out pass rate."""

from __future__ import annotations

import math
import statistics

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.actors.report.records import EvalRow
from fleetrl.actors.runs.collapse import Collapse
from fleetrl.actors.runs.compare import (PassAt1, RunStats, grad_norm_max, grad_norm_std, mean_kl,
                                         mean_kl_by_sampler, reward_auc, run_collapse, run_stats,
                                         skipped_fraction, staleness, tokens_by_sampler)
from fleetrl.actors.trainer.step import StepMetrics


def sm(step: int, reward: float = 0.5, grad: float = 1.0, skipped: bool = False) -> StepMetrics:
    return StepMetrics(step=step, reward_mean=reward, grad_norm=grad, skipped=skipped)



def ev(version: int, split: str, passed: int, n: int = 100) -> EvalRow:
    p = passed / n
    return EvalRow(version=version, step=version, split=split, n=n, passed=passed, pass_at_1=p,
                   ci_low=max(0.0, p - 0.1), ci_high=min(1.0, p + 0.1), mean_reward=p, time=0.0)


def test_reward_auc_trapezoid():
    # rewards 0, 1, 0.5: trapezoids (0+1)/2 + (1+0.5)/2 = 1.25 over 2 intervals
    assert reward_auc([sm(1, 0.0), sm(2, 1.0), sm(3, 0.5)]) == 0.625
    assert reward_auc([sm(1, 0.3)]) == 0.3
    assert reward_auc([]) is None
    assert reward_auc([sm(1, float("nan"))]) is None
    assert reward_auc([sm(1, 0.2), sm(2, float("nan")), sm(3, 0.4)]) == 0.30000000000000004


@given(st.lists(st.floats(min_value=0, max_value=1), min_size=1, max_size=50))
def test_reward_auc_is_between_min_and_max(rs):
    auc = reward_auc([sm(i + 1, r) for i, r in enumerate(rs)])
    assert min(rs) - 1e-12 <= auc <= max(rs) + 1e-12


@given(st.floats(min_value=0, max_value=1), st.integers(min_value=1, max_value=30))
def test_reward_auc_of_a_flat_curve_is_its_height(r, n):
    assert math.isclose(reward_auc([sm(i, r) for i in range(n)]), r, abs_tol=1e-12)


def test_grad_norm_std_ignores_skipped_and_non_finite():
    steps = [sm(1, grad=1.0), sm(2, grad=3.0), sm(2, grad=100.0, skipped=True), sm(3, grad=math.inf),
             sm(4, grad=2.0)]
    assert grad_norm_std(steps) == statistics.pstdev([1.0, 3.0, 2.0])
    assert grad_norm_std([sm(1)]) is None


def test_grad_norm_max_and_skipped_fraction():
    steps = [sm(1, grad=1.0), sm(2, grad=3.0), sm(2, grad=100.0, skipped=True), sm(3, grad=math.inf)]
    assert grad_norm_max(steps) == 3.0
    assert skipped_fraction(steps) == 0.25
    assert grad_norm_max([]) is None and skipped_fraction([]) is None


def test_kl_staleness_and_masked_means():
    steps = [
        StepMetrics(step=1, mismatch_kl_k3=1e-3, mismatch_kl_by_sampler={"torch/fp8": 3e-3, "torch/bf16": 1e-4},
                    tokens_by_sampler={"torch/fp8": 10, "torch/bf16": 0}, staleness_hist={0: 2, 2: 2}),
        StepMetrics(step=2, mismatch_kl_k3=3e-3, mismatch_kl_by_sampler={"torch/fp8": 5e-3},
                    tokens_by_sampler={"torch/fp8": 10}, staleness_hist={1: 4, 8: 0}),
        StepMetrics(step=2, mismatch_kl_k3=1.0, skipped=True, staleness_hist={9: 1}),  # not trained
    ]
    assert mean_kl(steps) == statistics.fmean([1e-3, 3e-3])
    assert mean_kl_by_sampler(steps) == {"torch/fp8": statistics.fmean([3e-3, 5e-3])}  # bf16 made no tokens
    assert staleness(steps) == ((0 * 2 + 2 * 2 + 1 * 4) / 8, 2)
    assert tokens_by_sampler(steps) == {"torch/bf16": 0, "torch/fp8": 20}
    assert staleness([]) == (None, None)


def test_run_collapse():
    rising = [sm(i, reward=0.1 * i) for i in range(1, 11)]
    assert not run_collapse(rising).collapsed
    falling = rising[:5] + [sm(i, reward=0.0) for i in range(6, 14)]
    c = run_collapse(falling)
    assert c.collapsed and c.step is not None and c.step > 5 and "reward fell" in c.reason
    nan = rising[:3] + [StepMetrics(step=3, grad_norm=math.nan, skipped=True, skipped_reason="non-finite gradient")]
    assert run_collapse(nan) == Collapse(collapsed=True, step=3, reason="non-finite loss, gradient or reward at step 3")
    assert run_collapse([sm(1), StepMetrics(step=2, loss=math.inf)]).step == 2
    stalled = run_collapse(rising[:4], timed_out=True, budget=30)
    assert stalled.collapsed and stalled.step == 5 and stalled.reason.startswith("stalled: timed out after 4 of 30")
    assert not run_collapse(rising[:4], timed_out=True, budget=4).collapsed  # it had finished its budget


def test_run_stats_takes_first_and_last_evaluations():
    evals = [ev(0, "fresh", 30), ev(0, "general", 20), ev(10, "fresh", 55), ev(10, "general", 22),
             ev(5, "fresh", 40)]
    r = run_stats(regime="hard", seed=1, key="b", name="async_full", label="(b) x", exit_code=0, wall_s=123.4,
                  steps=[sm(1, 0.2, 1.0), sm(2, 0.4, 2.0)], evals=evals, budget=2)
    assert (r.fresh_start.passed, r.fresh.passed, r.general.passed) == (30, 55, 22)
    assert r.fresh == PassAt1(step=10, n=100, passed=55, pass_at_1=0.55, ci_low=0.55 - 0.1, ci_high=0.65)
    assert r.steps == 2 and math.isclose(r.reward_auc, 0.3) and r.grad_norm_std == 0.5 and r.grad_norm_max == 2.0
    assert (r.regime, r.seed, r.frac_skipped, r.collapse.collapsed) == ("hard", 1, 0.0, False)
    # the struct round-trips through JSON (run.json, ablation.json)
    assert msgspec.json.decode(msgspec.json.encode(r), type=RunStats) == r
    empty = run_stats(regime="mild", seed=0, key="c", name="async_none", label="(c)", exit_code=1, wall_s=7.0,
                      steps=[], evals=[], budget=30, error="fleetrl serve exited 1")
    assert (empty.fresh, empty.reward_auc, empty.kl_mean, empty.steps) == (None, None, None, 0)

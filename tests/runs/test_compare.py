"""The ablation table's numbers: reward-curve area, grad-norm std, final held-out pass rate."""

from __future__ import annotations

import math
import statistics

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.actors.report.records import EvalRow
from fleetrl.actors.runs.compare import (arm_result, grad_norm_std, markdown_table, reward_auc,
                                         text_table)
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


def test_arm_result_takes_the_last_evaluation_of_each_split():
    evals = [ev(0, "fresh", 30), ev(0, "general", 20), ev(10, "fresh", 55), ev(10, "general", 22),
             ev(5, "fresh", 40)]
    r = arm_result(key="b", name="async_full", label="(b) x", exit_code=0, wall_s=123.4,
                   steps=[sm(1, 0.2, 1.0), sm(2, 0.4, 2.0)], evals=evals)
    assert r.fresh.passed == 55 and r.general.passed == 22
    assert r.steps == 2 and math.isclose(r.reward_auc, 0.3) and r.grad_norm_std == 0.5


def test_tables():
    a = arm_result(key="a", name="sync_fp32", label="(a) sync", exit_code=0, wall_s=100.0,
                   steps=[sm(1, 0.2, 1.0), sm(2, 0.4, 2.0)], evals=[ev(2, "fresh", 50), ev(2, "general", 25)])
    c = arm_result(key="c", name="async_none", label="(c) none", exit_code=1, wall_s=7.0, steps=[], evals=[],
                   error="fleetrl serve exited 1")
    md = markdown_table([a, c]).splitlines()
    assert md[0] == ("| variant | fresh pass@1 [CI] | general pass@1 [CI] | reward AUC | grad-norm std "
                     "| steps | wall-clock | exit |")
    assert md[2] == "| (a) sync | 50.0% [40.0, 60.0] | 25.0% [15.0, 35.0] | 0.300 | 0.500 | 2 | 100 s | 0 |"
    assert md[3] == "| (c) none | n/a | n/a | n/a | n/a | 0 | 7 s | 1 |"
    txt = text_table([a, c]).splitlines()
    assert txt[0].startswith("variant ") and set(txt[1]) <= {"-", " "}
    assert "50.0% [40.0, 60.0]" in txt[2]
    # the struct round-trips through JSON (ablation.json)
    back = msgspec.json.decode(msgspec.json.encode(a), type=type(a))
    assert back == a

"""The paired comparison against the reference arm: per-task paired pass@1 differences
with bootstrap intervals, per-seed differences with Student-t intervals."""

from __future__ import annotations

import math
import statistics

import pytest

from fleetrl.actors.report.records import EvalRow
from fleetrl.actors.runs.compare import run_stats
from fleetrl.actors.runs.paired import compare_arms, paired_interval, paired_pass_diff, scalar_diff, t_interval
from fleetrl.actors.runs.tables import arms_table, diff_table, runs_table
from fleetrl.actors.trainer.step import StepMetrics


def row(rewards: list[float], split: str = "fresh", step: int = 10) -> EvalRow:
    n, passed = len(rewards), sum(r == 1.0 for r in rewards)
    return EvalRow(version=step, step=step, split=split, n=n, passed=passed, pass_at_1=passed / n, ci_low=0.0,
                   ci_high=1.0, mean_reward=sum(rewards) / n, time=0.0, rewards=tuple(rewards))


def test_t_interval():
    m, lo, hi = t_interval([1.0, 3.0])
    assert m == 2.0 and math.isclose(hi - m, 12.706 * statistics.stdev([1.0, 3.0]) / math.sqrt(2))
    assert t_interval([5.0]) == (5.0, None, None)
    m, lo, hi = t_interval([1.0] * 40)
    assert lo == hi == 1.0
    with pytest.raises(ValueError):
        t_interval([])


def test_pass_diff_is_paired_per_task():
    # the arm solves tasks 0-29, the reference tasks 10-39 of 100: 20 gained, 20 lost
    x = row([1.0] * 30 + [0.0] * 70)
    ref = row([0.0] * 10 + [1.0] * 30 + [0.0] * 60)
    d = paired_pass_diff({0: (x, ref)})
    assert d.mean == 0.0 and d.seeds[0].diff == 0.0
    assert d.low < 0 < d.high
    # partial rewards are failures (a task passes at reward 1.0 only)
    assert paired_pass_diff({0: (row([0.9, 1.0]), row([0.0, 1.0]))}).mean == 0.0


def test_pass_diff_interval_shrinks_with_consistent_gains():
    gain = paired_pass_diff({0: (row([1.0] * 20 + [0.0] * 80), row([0.0] * 100))})
    assert gain.mean == pytest.approx(0.2) and 0.1 < gain.low < 0.2 < gain.high < 0.3
    # two seeds on the same tasks: the mean of the seeds, resampled together
    two = paired_pass_diff({0: (row([1.0] * 20 + [0.0] * 80), row([0.0] * 100)),
                            1: (row([1.0] * 10 + [0.0] * 90), row([0.0] * 100))})
    assert two.mean == pytest.approx(0.15) and [s.diff for s in two.seeds] == [pytest.approx(0.2), pytest.approx(0.1)]
    assert two.low < 0.15 < two.high
    # the same logs give the same interval
    assert paired_pass_diff({0: (row([1.0] * 20 + [0.0] * 80), row([0.0] * 100))}) == gain


def test_pass_diff_leaves_out_seeds_it_cannot_pair():
    old = EvalRow(version=1, step=1, split="fresh", n=2, passed=1, pass_at_1=0.5, ci_low=0.0, ci_high=1.0,
                  mean_reward=0.5, time=0.0)  # written before per-task rewards existed
    d = paired_pass_diff({0: (row([1.0, 0.0]), row([0.0, 0.0])), 1: (None, row([1.0])), 2: (old, row([1.0, 1.0])),
                          3: (row([1.0]), row([1.0, 0.0]))})
    assert d.missing == (1, 2, 3) and d.mean == 0.5
    none = paired_pass_diff({0: (None, None)})
    assert none.mean is None and none.missing == (0,)


def test_scalar_diff():
    d = scalar_diff({0: (0.5, 0.25), 1: (0.75, 0.25), 2: (None, 0.1), 3: (math.nan, 0.2)})
    assert d.mean == 0.375 and d.low < 0.375 < d.high and d.missing == (2, 3)
    one = scalar_diff({0: (1.0, 0.5)})
    assert (one.mean, one.low, one.high) == (0.5, None, None)


def _run(seed: int, key: str, reward: float, grad: float, **kw):
    steps = [StepMetrics(step=i, reward_mean=reward, grad_norm=grad * (1 + i % 2), mismatch_kl_k3=kw.get("kl", 0.0))
             for i in range(1, 9)]
    if kw.get("collapse"):
        steps += [StepMetrics(step=9, reward_mean=reward, grad_norm=math.nan, skipped=True,
                              skipped_reason="non-finite gradient")]
    return run_stats(regime="mild", seed=seed, key=key, name=f"arm_{key}", label=f"({key}) arm", exit_code=0,
                     wall_s=10.0, steps=steps, evals=[], budget=8)


def test_compare_arms_and_tables():
    runs = [_run(0, "a", 0.3, 1.0), _run(0, "b", 0.4, 2.0, kl=1e-3), _run(1, "a", 0.2, 1.0),
            _run(1, "b", 0.35, 2.0, kl=3e-3, collapse=True), _run(0, "c", 0.1, 1.0)]
    evals = {(0, "a"): [row([0.0] * 10)], (0, "b"): [row([1.0] * 5 + [0.0] * 5)], (1, "a"): [row([1.0] * 10)],
             (1, "b"): [row([1.0] * 10)]}
    b, c = compare_arms(runs, evals, reference="a")
    assert (b.key, b.reference, c.key) == ("b", "a", "c")
    assert b.reward_auc.mean == pytest.approx(0.125) and [s.seed for s in b.reward_auc.seeds] == [0, 1]
    assert b.grad_norm_max.mean == pytest.approx(2.0)
    assert b.kl_mean.mean == pytest.approx(2e-3)
    assert b.frac_skipped.seeds[1].diff == pytest.approx(1 / 9)
    assert b.fresh.mean == pytest.approx(0.25) and b.general.mean is None
    assert b.collapsed_seeds == (1,) and b.reference_collapsed_seeds == ()
    assert [s.seed for s in c.reward_auc.seeds] == [0]  # c ran in seed 0 only
    with pytest.raises(ValueError, match="no run of the reference arm 'z'"):
        compare_arms(runs, evals, reference="z")
    table = diff_table([b, c])
    assert "| (b) arm | +25.0 [" in table and "| 0: +50.0, 1: +0.0 |" in table
    assert "| (c) arm | n/a | n/a | -0.200 |" in table
    arms = arms_table(runs)
    assert "| (b) arm | n/a | n/a | 0.375 [0.350, 0.400] |" in arms and "seed 1 (step 9)" in arms
    assert "| 1 | (b) arm | 0 | 9/8 | 10 s | n/a | n/a | non-finite loss, gradient or reward at step 9 |" in runs_table(runs)


def test_paired_interval_of_two_sequences():
    a = [1.0] * 30 + [0.0] * 70
    b = [0.0] * 10 + [1.0] * 20 + [0.0] * 70  # a passes 10 tasks more, the same 20 both pass
    m, lo, hi = paired_interval(a, b)
    assert math.isclose(m, 0.10) and 0.0 < lo < m < hi < 0.2
    assert paired_interval(b, b) == (0.0, 0.0, 0.0)
    assert paired_interval(a, b) == (m, lo, hi)  # fixed generator seed: reproducible
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_interval([1.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="equal, non-empty"):
        paired_interval([], [])

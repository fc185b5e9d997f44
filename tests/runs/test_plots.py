"""The ablation's band plots: mean and min-max over seeds at each step, one PNG per metric."""

from __future__ import annotations

from PIL import Image

from fleetrl.actors.report.records import EvalRow
from fleetrl.actors.runs.plots import COMPARISONS, band, write_comparisons
from fleetrl.actors.trainer.step import StepMetrics


def test_band_over_seeds():
    xs, mean, lo, hi = band([[(1, 0.2), (2, 0.4)], [(1, 0.4), (2, 0.6), (3, 0.9)]])
    assert xs == [1, 2, 3]
    assert [round(m, 9) for m in mean] == [0.3, 0.5, 0.9]  # step 3: only the seed that reached it
    assert lo == [0.2, 0.4, 0.9] and hi == [0.4, 0.6, 0.9]
    assert band([]) == ([], [], [], [])


def _ev(step: int, split: str, p: float) -> EvalRow:
    return EvalRow(version=step, step=step, split=split, n=10, passed=int(10 * p), pass_at_1=p, ci_low=0.0,
                   ci_high=1.0, mean_reward=p, time=0.0)


def test_write_comparisons(tmp_path):
    def run(r: float) -> list[StepMetrics]:
        return [StepMetrics(step=i, reward_mean=r + 0.01 * i, grad_norm=1.0, mismatch_kl_k3=1e-3 * i,
                            frac_masked_tokens=0.01) for i in range(1, 6)]

    steps = {"(a) ref": [run(0.1), run(0.2)], "(b) arm": [run(0.3)], "(c) empty": [[]]}
    evals = {"(a) ref": [[_ev(0, "fresh", 0.1), _ev(5, "fresh", 0.3)], [_ev(0, "fresh", 0.2)]],
             "(b) arm": [[]], "(c) empty": [[]]}
    paths = write_comparisons(steps, evals, tmp_path)
    assert sorted(p.name for p in paths) == sorted(COMPARISONS)
    for p in paths:
        with Image.open(p) as im:
            im.verify()

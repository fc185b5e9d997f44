"""The report's numbers: summary table values, series, and the entropy-bound band."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.actors.report.html import fmt_eval, summary_rows
from fleetrl.actors.report.records import EvalRow
from fleetrl.actors.report.summary import (bound_ratio_band, eval_series, kl_series,
                                           staleness_total, summarize, window_mean)
from fleetrl.actors.weights.metrics import binary_entropy, entropy_bound_bytes


def evals(h) -> list[EvalRow]:
    return [msgspec.convert(r, type=EvalRow) for r in h.default_evals()]


def test_summary_numbers(h):
    steps = [h.step_metrics(i, cost_usd=0.064 * i, trajectories=32, elapsed_s=3.0 * i) for i in range(1, 11)]
    s = summarize(steps, evals(h))
    assert s.training_s == 30.0 and dict(summary_rows(s))["training wall-clock (what time_budget_s counts)"] == "30 s"
    assert s.steps == 10 and s.groups == 40 and s.trajectories == 320 and s.skipped_steps == 0
    assert math.isclose(s.reward_start, sum(0.2 + 0.05 * i for i in range(1, 6)) / 5)
    assert math.isclose(s.reward_end, sum(0.2 + 0.05 * i for i in range(6, 11)) / 5)
    assert s.heldout_start["fresh"].passed == 70 and s.heldout_end["fresh"].passed == 120
    assert s.heldout_start["general"].passed == 40 and s.heldout_end["general"].passed == 46
    assert s.wall_clock_s == 612.5
    assert math.isclose(s.trainer_busy_s, 10 * 2.5)
    assert math.isclose(s.usd_per_rollout, 0.064 * 55 / 320)


def test_unpriced_run_and_single_eval(h):
    s = summarize([h.step_metrics(1)], evals(h)[:1])
    assert s.usd_per_rollout is None
    assert s.wall_clock_s is None
    assert "general" not in s.heldout_end
    rows = dict(summary_rows(s))
    assert rows["$ per rollout"] == "not priced"
    assert rows["held-out pass@1, general, end"] == "n/a"
    assert rows["wall-clock, first to last held-out evaluation"] == "n/a"
    assert s.training_s is None and rows["training wall-clock (what time_budget_s counts)"] == "n/a"


def test_empty_run():
    s = summarize([], [])
    assert s.steps == 0 and s.reward_start is None and s.heldout_start == {}


def test_re_evaluated_version_keeps_the_last_row(h):
    rows = evals(h) + [msgspec.structs.replace(evals(h)[4], passed=100, pass_at_1=0.5)]
    xs, p, lo, hi = eval_series(rows, "fresh")
    assert xs == [0, 5, 10] and p[-1] == 0.5
    assert summarize([], rows).heldout_end["fresh"].passed == 100


def test_skipped_steps_and_nan_rewards(h):
    steps = [h.step_metrics(1), h.step_metrics(1, skipped=True, reward_mean=float("nan")),
             h.step_metrics(2)]
    s = summarize(steps, [])
    assert s.steps == 2 and s.skipped_steps == 1
    assert math.isclose(s.reward_start, (0.25 + 0.3) / 2)


def test_fmt_eval(h):
    assert fmt_eval(evals(h)[0]) == "35.0% [30.0, 40.0] (n=200, step 0)"
    assert fmt_eval(None) == "n/a"


def test_kl_series_skips_kinds_without_tokens(h):
    steps = [h.step_metrics(1),
             h.step_metrics(2, tokens_by_sampler={"torch/float32": 0, "torch/bfloat16": 5, "torch/fp8": 5})]
    series = kl_series(steps)
    assert series["torch/float32"] == ([1], [1e-7])
    assert series["torch/fp8"] == ([1, 2], [1e-2, 1e-2])


def test_staleness_total(h):
    steps = [h.step_metrics(1, staleness_hist={0: 3}), h.step_metrics(2, staleness_hist={2: 1, 0: 1})]
    assert staleness_total(steps) == {0: 4, 2: 1}


def test_window_mean():
    assert window_mean([1, 2, 3, float("nan"), 4, 5, 6, 7], head=True, k=3) == 2
    assert window_mean([1, 2, 3, float("nan"), 4, 5, 6, 7], head=False, k=3) == 6
    assert window_mean([float("nan")], head=True) is None


@given(st.floats(min_value=1e-6, max_value=0.999999))
def test_bound_band_contains_the_exact_bound(density):
    """For any XOR patterns, the exact bound of actors/weights/metrics lies in the band."""
    total = 10_000
    k = max(1, min(total - 1, round(density * total)))
    low, high = bound_ratio_band(k / total)
    assert low <= high
    rng = np.random.default_rng(k)
    for patterns in (np.full(k, 7, np.uint16), rng.integers(1, 1 << 16, k, dtype=np.uint16)):
        ratio = 2 * total / entropy_bound_bytes(total, patterns)
        assert low * (1 - 1e-9) <= ratio <= high * (1 + 1e-9)


def test_bound_band_edges():
    assert bound_ratio_band(0.0) is None and bound_ratio_band(1.0) is None
    assert bound_ratio_band(float("nan")) is None
    low, high = bound_ratio_band(0.5)
    assert high == 16 / binary_entropy(0.5) == 16.0 and low == 16 / 9


# --------------------------------------------------------------------------- sampler mismatch


def _fig(tokens, kl, out, mean, std, mx):
    from fleetrl.actors.trainer.step import MismatchFigures

    return MismatchFigures(tokens=tokens, kl_k3=kl, frac_out_of_band=out, log_ratio_mean=mean, log_ratio_std=std,
                           log_ratio_max_abs=mx)


def test_mismatch_table_combines_the_steps_by_hand(h):
    from fleetrl.actors.report.html import mismatch_rows
    from fleetrl.actors.report.summary import mismatch_table
    from fleetrl.daemon.messages import SamplerIdentity

    ident = SamplerIdentity(sampler_id="s1", backend="torch", device_kind="H100", dtype="bfloat16")
    steps = [h.step_metrics(1, mismatch_by_kind={"torch/bfloat16": _fig(100, 0.01, 0.1, 0.0, 0.1, 0.5)},
                            mismatch_by_sampler_id={"s1": _fig(100, 0.01, 0.1, 0.0, 0.1, 0.5)},
                            sampler_identities=(ident,)),
             h.step_metrics(2),  # an older line, without per-sampler figures
             h.step_metrics(3, mismatch_by_kind={"torch/bfloat16": _fig(300, 0.03, 0.2, 0.2, 0.1, 0.9)},
                            mismatch_by_sampler_id={"s1": _fig(300, 0.03, 0.2, 0.2, 0.1, 0.9)},
                            sampler_identities=(ident,))]
    [kind] = mismatch_table(steps)
    f = kind.figures
    assert (kind.key, kind.steps, f.tokens) == ("torch/bfloat16", 2, 400)
    assert f.kl_k3 == (100 * 0.01 + 300 * 0.03) / 400
    assert math.isclose(f.frac_out_of_band, (10 + 60) / 400)
    assert math.isclose(f.log_ratio_mean, 0.15)
    # pooled: (100 * 0.1^2 + 300 * 0.1^2 + 0.2^2 * 100 * 300 / 400) / 400 = 7 / 400
    assert math.isclose(f.log_ratio_std, math.sqrt(7 / 400))
    assert f.log_ratio_max_abs == 0.9
    [one] = mismatch_table(steps, by="sampler")
    assert (one.key, one.label) == ("s1", "torch/H100/bfloat16") and one.figures == f
    assert mismatch_rows((one,)) == [("s1 (torch/H100/bfloat16)", "400", "2", "0.025", "17.50%", "0.132", "0.9")]
    with pytest.raises(ValueError, match="by must be"):
        mismatch_table(steps, by="dtype")


def test_fleet_multiple_of_the_fp32_samplers_in_the_same_steps(h):
    from fleetrl.actors.report.summary import fleet_kl, fleet_mismatch_multiple

    # conftest: each step has 300 tokens of fp32 (k3 1e-7 * step), bf16 (1e-3) and fp8 (1e-2)
    steps = [h.step_metrics(i) for i in range(1, 11)]
    steps.append(h.step_metrics(11, tokens_by_sampler={"torch/float32": 0, "torch/bfloat16": 300,
                                                       "torch/fp8": 300}))  # no fp32 tokens: not compared
    steps.append(h.step_metrics(12, skipped=True, mismatch_kl_by_sampler={}, tokens_by_sampler={}))
    kl, tokens = fleet_kl(steps)
    assert tokens == 10 * 900 + 600
    assert math.isclose(kl, (300 * 1e-7 * 55 + 11 * 300 * 1.1e-2) / tokens)
    mm = fleet_mismatch_multiple(steps)
    fleet = (300 * 1e-7 * 55 + 10 * 300 * 1.1e-2) / 9000
    assert mm.steps == 10 and (mm.fleet_tokens, mm.reference_tokens) == (9000, 3000)
    assert math.isclose(mm.fleet_kl, fleet) and math.isclose(mm.reference_kl, 1e-7 * 5.5)
    assert math.isclose(mm.multiple, fleet / 5.5e-7)
    assert fleet_mismatch_multiple(steps[10:]) is None  # no fp32 sampler: no reference
    zero = [h.step_metrics(1, mismatch_kl_by_sampler={"torch/float32": 0.0, "torch/bfloat16": 1e-3})]
    assert fleet_mismatch_multiple(zero).multiple is None  # a reference of exactly 0 gives no multiple


def test_run_multiple_against_a_homogeneous_fp32_run(h):
    from fleetrl.actors.report.html import fmt_multiple
    from fleetrl.actors.report.summary import run_mismatch_multiple

    run = [h.step_metrics(i) for i in range(1, 6)]
    fp32 = [h.step_metrics(i, mismatch_kl_by_sampler={"torch/float32": 2e-6}, tokens_by_sampler={"torch/float32": 900})
            for i in range(3, 9)]
    mm = run_mismatch_multiple(run, fp32, reference="sync_fp32")
    assert mm.steps == 3  # steps 3, 4, 5: measured by both
    fleet = (300 * 1e-7 * 12 + 3 * 300 * 1.1e-2) / 2700
    assert math.isclose(mm.fleet_kl, fleet) and mm.reference_kl == 2e-6
    assert math.isclose(mm.multiple, fleet / 2e-6)
    assert fmt_multiple(mm).startswith(f"{fleet / 2e-6:.3g}x (fleet ") and "sync_fp32, 3 steps" in fmt_multiple(mm)
    assert run_mismatch_multiple(run, fp32[3:]) is None  # no step in common
    assert fmt_multiple(None) == "n/a (no torch/float32 sampler in the fleet)"


def test_summary_carries_the_mismatch(h):
    steps = [h.step_metrics(i, mismatch_by_kind={"torch/fp8": _fig(300, 1e-2, 0.01, 0.0, 0.2, 1.0)})
             for i in range(1, 4)]
    s = summarize(steps, [])
    assert [r.key for r in s.mismatch_by_kind] == ["torch/fp8"] and s.mismatch_by_sampler == ()
    assert s.mismatch_multiple is not None and s.mismatch_multiple.steps == 3
    rows = dict(summary_rows(s))
    assert rows["fleet mismatch as a multiple of a homogeneous fp32 fleet's"].endswith(
        "its torch/float32 samplers in the same steps, 3 steps)")
    assert rows["sampler-trainer mismatch, all samplers (k3 KL per token)"] == f"{s.fleet_mismatch_kl:.3g}"
    assert summarize([], []).fleet_mismatch_kl is None
    assert dict(summary_rows(summarize([], [])))["sampler-trainer mismatch, all samplers (k3 KL per token)"] == "n/a"

"""Collapse detection (actors/runs/collapse.py): a lasting fall below half the peak, or
a non-finite number; dips that recover, slow learners and flat curves are not collapse."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.actors.runs.collapse import NO_COLLAPSE, detect_collapse, smooth


def curve(rewards: list[float]):
    return list(range(1, len(rewards) + 1)), rewards


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([2.0], 5) == [2.0]
    with pytest.raises(ValueError):
        smooth([1.0], 0)


def test_a_lasting_fall_is_a_collapse_at_the_start_of_the_final_stretch():
    steps, rewards = curve([0.4] * 10 + [0.0] * 10)
    c = detect_collapse(steps, rewards)
    # smoothed over 5: 0.4 until step 10, then 0.32, 0.24 and 0.16 < 0.2 from step 13 on
    assert c.collapsed and c.step == 13 and "below 0.5 x its peak (0.400 at step" in c.reason


def test_a_dip_that_recovers_is_not_a_collapse():
    steps, rewards = curve([0.4] * 10 + [0.0] * 8 + [0.4] * 10)
    assert detect_collapse(steps, rewards) == NO_COLLAPSE


def test_a_short_final_stretch_is_not_enough():
    steps, rewards = curve([0.4] * 10 + [0.0] * 4)  # below 0.2 only at the last 2 smoothed points
    assert not detect_collapse(steps, rewards).collapsed
    assert detect_collapse(steps, rewards, min_points=2).collapsed


def test_never_learning_and_learning_slowly_are_not_collapse():
    assert detect_collapse(*curve([0.0] * 20)) == NO_COLLAPSE
    assert detect_collapse(*curve([0.01 * i for i in range(30)])) == NO_COLLAPSE
    assert detect_collapse([], []) == NO_COLLAPSE


def test_non_finite_values_collapse_at_the_first():
    steps, rewards = curve([0.3, 0.4, math.nan, 0.5])
    c = detect_collapse(steps, rewards, nonfinite_steps=[4])
    assert c.collapsed and c.step == 3 and "non-finite" in c.reason
    assert detect_collapse(*curve([0.3, 0.4]), nonfinite_steps=[2]).step == 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="2 steps but 1 rewards"):
        detect_collapse([1, 2], [0.1])
    with pytest.raises(ValueError, match="fraction"):
        detect_collapse([1], [0.1], fraction=1.0)
    with pytest.raises(ValueError, match="min_points"):
        detect_collapse([1], [0.1], min_points=0)


@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=60))
def test_a_curve_that_never_goes_down_never_collapses(xs):
    rising = sorted(xs)
    assert not detect_collapse(*curve(rising)).collapsed


@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=60),
       st.integers(min_value=1, max_value=20))
def test_a_collapse_step_ends_below_the_floor(xs, window):
    c = detect_collapse(*curve(xs), window=window)
    if c.collapsed:
        s = smooth(xs, window)
        assert all(v < 0.5 * max(s) for v in s[c.step - 1:])
        assert len(xs) - (c.step - 1) >= 3

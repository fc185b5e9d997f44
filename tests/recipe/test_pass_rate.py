"""Wilson intervals of `pass_rate_with_ci`: known values and invariants."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.actors.recipe.evaluate import pass_rate_with_ci


@pytest.mark.parametrize(
    ("successes", "n", "low", "high"),
    [
        # Wilson (1927) score interval, z = 1.959964, worked out by hand to 5 digits.
        (0, 10, 0.0, 0.27753),
        (5, 10, 0.23659, 0.76341),
        (10, 10, 0.72247, 1.0),
        (60, 200, 0.24075, 0.36679),
        (1, 1, 0.20654, 1.0),
    ],
)
def test_known_wilson_intervals(successes: int, n: int, low: float, high: float) -> None:
    r = pass_rate_with_ci(successes, n)
    assert r.rate == successes / n
    assert r.low == pytest.approx(low, abs=1e-4)
    assert r.high == pytest.approx(high, abs=1e-4)
    assert r.confidence == pytest.approx(0.95, abs=1e-6)


@given(st.integers(1, 5000).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_interval_contains_rate_and_stays_in_unit_range(case: tuple[int, int]) -> None:
    successes, n = case
    r = pass_rate_with_ci(successes, n)
    assert 0.0 <= r.low <= r.rate <= r.high <= 1.0
    assert r.low < r.high


@given(st.integers(0, 100), st.integers(1, 100))
def test_more_data_narrows_the_interval(successes: int, n: int) -> None:
    successes = min(successes, n)
    small = pass_rate_with_ci(successes, n)
    large = pass_rate_with_ci(successes * 4, n * 4)
    assert large.high - large.low < small.high - small.low


def test_wider_z_gives_wider_interval() -> None:
    a = pass_rate_with_ci(30, 100)
    b = pass_rate_with_ci(30, 100, z=2.576)
    assert b.low < a.low and b.high > a.high
    assert b.confidence == pytest.approx(0.99, abs=1e-3)


@pytest.mark.parametrize(
    ("successes", "n", "z", "match"),
    [(0, 0, 1.96, "n must be"), (3, 2, 1.96, "successes must be"), (-1, 5, 1.96, "successes must be"),
     (1, 5, 0.0, "z must be"), (1, 5, math.nan, "z must be"), (True, 5, 1.96, "successes must be")],
)
def test_bad_arguments_are_named(successes: int, n: int, z: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pass_rate_with_ci(successes, n, z=z)


def test_str_shows_rate_interval_and_counts() -> None:
    assert str(pass_rate_with_ci(60, 200)) == "30.0% [24.1, 36.7] (60/200)"

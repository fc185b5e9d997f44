"""Pure restart arithmetic (backoff and intensity)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.daemon.config import RestartPolicy
from fleetrl.daemon.restart import RestartTracker, backoff_delay


def test_backoff_doubles_up_to_the_cap():
    p = RestartPolicy(backoff_base_s=0.5, backoff_factor=2, backoff_max_s=3, jitter=0)
    assert [backoff_delay(p, n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    with pytest.raises(ValueError):
        backoff_delay(p, 0)


policies = st.builds(
    RestartPolicy,
    backoff_base_s=st.floats(0.001, 100), backoff_factor=st.floats(1, 100),
    backoff_max_s=st.floats(0.001, 1000), jitter=st.floats(0, 1),
    intensity=st.integers(1, 50), period_s=st.floats(0.1, 1000))


@given(policies, st.integers(1, 5000), st.integers(0, 2**32))
def test_delay_is_bounded_and_jitter_stays_in_band(p, attempt, seed):
    d = backoff_delay(p, attempt, random.Random(seed))
    plain = backoff_delay(p, attempt)
    assert 0 <= d <= p.backoff_max_s
    assert plain * (1 - p.jitter) - 1e-9 <= d <= min(p.backoff_max_s, plain * (1 + p.jitter)) + 1e-9
    if attempt > 1:
        assert backoff_delay(p, attempt - 1) <= plain


@given(policies, st.lists(st.floats(0, 10), min_size=1, max_size=100))
def test_escalates_exactly_when_more_than_intensity_crashes_fall_in_a_window(p, gaps):
    t = RestartTracker(p, random.Random(0))
    now, times = 0.0, []
    for gap in gaps:
        now += gap
        times.append(now)
        in_window = [x for x in times if x > now - p.period_s]
        result = t.crash(now)
        assert (result is None) == (len(in_window) > p.intensity)
        if result is None:
            break


def test_a_quiet_period_resets_the_backoff():
    p = RestartPolicy(backoff_base_s=1, backoff_factor=2, backoff_max_s=100, jitter=0,
                      intensity=10, period_s=10)
    t = RestartTracker(p)
    assert [t.crash(x) for x in (0, 1, 2)] == [1, 2, 4]
    assert t.crash(100) == 1
    assert t.total == 4

"""Collapse of a training run, as a pure function of its reward curve (and whether its
numbers stayed finite). `fleetrl ablate` applies it to each arm's ``metrics.jsonl``;
``bench/corrections.py --long`` to the toy policy's evaluated reward.

A run has *collapsed* when either

* a number went non-finite: a step's loss or gradient norm is NaN/inf (the trainer
  skips such a step as "non-finite gradient"), or a reward is NaN; the collapse step is
  the first such step; or
* its reward fell and stayed down: with ``s`` the reward smoothed over a trailing
  window of ``window`` points and ``peak`` the largest ``s`` (> 0), ``s`` drops below
  ``fraction * peak`` after the peak and stays below to the end of the run, for at
  least ``min_points`` points. The collapse step is the first point of that final
  stretch.

The defaults (half the peak, a 5-point window, 3 points) ask for a drop well outside
the step-to-step noise of a GRPO batch's mean reward and for it to last; a run that
dips and recovers has not collapsed. A run that never had a positive reward (``peak``
0) never learned, which is not collapse. A run that stopped before its budget (the
ablation's timeout of a stalled arm) is judged by the caller, who knows why it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

__all__ = ["Collapse", "NO_COLLAPSE", "detect_collapse", "smooth"]


class Collapse(msgspec.Struct, frozen=True, kw_only=True):
    collapsed: bool
    step: int | None = None
    """The step where it began (None: no collapse)."""
    reason: str = ""


NO_COLLAPSE = Collapse(collapsed=False)


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def detect_collapse(steps: Sequence[int], rewards: Sequence[float], *,
                    nonfinite_steps: Sequence[int] = (), fraction: float = 0.5, window: int = 5,
                    min_points: int = 3) -> Collapse:
    """Did this reward curve collapse (module docstring)? ``steps[i]`` is the step of
    ``rewards[i]`` (in log order); ``nonfinite_steps`` the steps whose loss or gradient
    norm was not finite."""
    if len(steps) != len(rewards):
        raise ValueError(f"{len(steps)} steps but {len(rewards)} rewards")
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction}")
    if min_points < 1:
        raise ValueError(f"min_points must be >= 1, got {min_points}")
    bad = sorted(set(nonfinite_steps) | {s for s, r in zip(steps, rewards) if not math.isfinite(r)})
    if bad:
        return Collapse(collapsed=True, step=bad[0], reason=f"non-finite loss, gradient or reward at step {bad[0]}")
    if not rewards:
        return NO_COLLAPSE
    s = smooth(list(rewards), window)
    peak_i = max(range(len(s)), key=lambda i: s[i])
    peak = s[peak_i]
    if peak <= 0:
        return NO_COLLAPSE
    floor = fraction * peak
    start = len(s)
    while start > peak_i + 1 and s[start - 1] < floor:
        start -= 1
    if len(s) - start < min_points:
        return NO_COLLAPSE
    return Collapse(collapsed=True, step=steps[start],
                    reason=(f"reward fell below {fraction:g} x its peak ({peak:.3f} at step {steps[peak_i]}, "
                            f"smoothed over {window}) from step {steps[start]} to the end"))

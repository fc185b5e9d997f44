"""The trainer's learning-rate schedule (pure).

``lr_at(step)`` is the rate of the optimizer step that follows ``step`` steps already
taken. It depends on the step count only, so a resumed trainer (its step restored from
the checkpoint) continues the schedule exactly where it stopped; the rate stored in the
optimizer's checkpointed state is overwritten before every step.

* ``constant``: ``lr`` at every step (after the warm-up).
* ``cosine``: from ``lr`` down to ``lr * lr_min_ratio`` along half a cosine over the
  steps after the warm-up, reaching the floor at the last step of ``max_steps``.
* ``linear``: the same endpoints along a straight line.

``warmup_steps``: the first steps ramp linearly from ``lr / warmup_steps`` up to ``lr``.
Past ``max_steps`` (a budget raised on resume) the rate stays at the floor.

With a wall-clock budget (the trainer's ``time_budget_s``) the caller also passes
``time_fraction``, the share of that budget spent: the decay then follows whichever of
the step fraction and the time fraction is further along, so the rate reaches its floor
when the first of the two budgets runs out. The time fraction is checkpointed with the
trainer (its elapsed seconds), so a resume continues from the same point; unlike the
step fraction it depends on the machine's speed.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

__all__ = ["SCHEDULES", "Schedule", "lr_at"]

Schedule = Literal["constant", "cosine", "linear"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
"""The schedule names, in order."""


def lr_at(step: int, *, lr: float, schedule: Schedule = "constant", max_steps: int | None = None,
          warmup_steps: int = 0, min_ratio: float = 0.1, time_fraction: float | None = None) -> float:
    """The learning rate of the step taken after ``step`` steps (see the module docstring)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if time_fraction is not None and not (math.isfinite(time_fraction) and time_fraction >= 0):
        raise ValueError(f"time_fraction must be a finite number >= 0, got {time_fraction!r}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if max_steps is None and time_fraction is None:
        raise ValueError(f"the {schedule!r} learning-rate schedule needs max_steps or a time budget")
    frac = 0.0 if time_fraction is None else min(time_fraction, 1.0)
    if max_steps is not None:
        span = max_steps - warmup_steps - 1
        if span <= 0:
            frac = 1.0 if step > warmup_steps else frac
        else:
            frac = max(frac, min((step - warmup_steps) / span, 1.0))
    shape = 0.5 * (1.0 + math.cos(math.pi * frac)) if schedule == "cosine" else 1.0 - frac
    return lr * (min_ratio + (1.0 - min_ratio) * shape)

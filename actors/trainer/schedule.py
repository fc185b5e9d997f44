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
"""

from __future__ import annotations

import math
from typing import Literal, get_args

__all__ = ["SCHEDULES", "Schedule", "lr_at"]

Schedule = Literal["constant", "cosine", "linear"]
SCHEDULES: tuple[str, ...] = get_args(Schedule)
"""The schedule names, in order."""


def lr_at(step: int, *, lr: float, schedule: Schedule = "constant", max_steps: int | None = None,
          warmup_steps: int = 0, min_ratio: float = 0.1) -> float:
    """The learning rate of the step taken after ``step`` steps (see the module docstring)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if max_steps is None:
        raise ValueError(f"the {schedule!r} learning-rate schedule needs max_steps")
    span = max_steps - warmup_steps - 1
    if span <= 0:
        return lr * min_ratio if step > warmup_steps else lr
    frac = min((step - warmup_steps) / span, 1.0)
    shape = 0.5 * (1.0 + math.cos(math.pi * frac)) if schedule == "cosine" else 1.0 - frac
    return lr * (min_ratio + (1.0 - min_ratio) * shape)

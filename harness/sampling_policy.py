"""What the endpoint does with the sampling settings a harness sends (``[sampling]``).

An external harness chooses its own ``temperature``, ``top_p``, ``top_k`` and ``seed``
call by call. Whatever a call is sampled with travels with its tokens to the trainer
(`fleetrl.daemon.messages.SamplingRecord`), so the trainer scores each row with the
settings it was drawn with; the policy only decides what a call is sampled with:

* ``honour``: exactly what the harness asked for (the default: a production harness
  runs unchanged and the run trains what it does; a greedy call, ``temperature = 0``,
  is recorded and the trainer excludes it from the loss with its reason, counted);
* ``override``: the run's own ``temperature``, ``top_p`` and ``top_k`` whatever the
  harness sends (its ``seed`` is kept); the response says so in the
  ``x-fleetrl-sampling-overridden`` header and the endpoint counts it;
* ``refuse``: a call outside the allowed ranges gets a 400 naming the parameter.

docs/reference/openai-endpoint.md ("Sampling policy") says why ``honour`` is the default.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

__all__ = ["POLICIES", "SamplingPolicy"]

POLICIES = ("honour", "override", "refuse")


class SamplingPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[...config.sampling]`` of an endpoint (the endpoint actor's, or a remote worker's
    ``endpoint_config``): the policy and the run's own sampling settings."""

    policy: Literal["honour", "override", "refuse"] = "honour"
    """``honour``, ``override`` or ``refuse`` (module docstring)."""
    temperature: Annotated[float, msgspec.Meta(gt=0.0, le=2.0)] = 1.0
    """The run's temperature: what ``override`` samples with (> 0: a greedy run trains nothing)."""
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    """The run's nucleus mass (``override``)."""
    top_k: Annotated[int, msgspec.Meta(ge=2)] | None = None
    """The run's support cap (``override``; None: the samplers' ``max_support``)."""
    temperature_range: tuple[float, float] = (0.1, 2.0)
    """``refuse``: the temperatures a call may ask for, inclusive."""
    top_p_range: tuple[float, float] = (0.5, 1.0)
    """``refuse``: the ``top_p`` a call may ask for, inclusive."""
    min_top_k: Annotated[int, msgspec.Meta(ge=1)] = 2
    """``refuse``: the smallest ``top_k`` a call may ask for (1 is greedy)."""

    def __post_init__(self) -> None:
        o = "SamplingPolicy"
        if self.policy not in POLICIES:
            raise ValueError(f"{o}.policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not (_num(self.temperature) and 0.0 < self.temperature <= 2.0):
            raise ValueError(f"{o}.temperature must be in (0, 2], got {self.temperature!r}")
        if not (_num(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"{o}.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or self.top_k < 2):
            raise ValueError(f"{o}.top_k must be an int >= 2 or absent, got {self.top_k!r}")
        for name, (lo, hi), low, high in (("temperature_range", self.temperature_range, 0.0, 2.0),
                                          ("top_p_range", self.top_p_range, 0.0, 1.0)):
            if not (_num(lo) and _num(hi) and low <= lo <= hi <= high):
                raise ValueError(f"{o}.{name} must be [low, high] with {low} <= low <= high <= {high}, "
                                 f"got {[lo, hi]!r}")
        if isinstance(self.min_top_k, bool) or not isinstance(self.min_top_k, int) or self.min_top_k < 1:
            raise ValueError(f"{o}.min_top_k must be an int >= 1, got {self.min_top_k!r}")


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

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

`apply_policy` (pure) decides one call: the settings to sample with and what it
overrode (`Override`), or an `ApiError` 400 ``sampling_refused``. A parameter is
*overridden* when the value sampled with differs from the value the call would have
been sampled with under ``honour`` (what it sent, or the endpoint's default where it
sent nothing: ``temperature`` 1, ``top_p`` 1, no ``top_k`` cap): asking for exactly the
run's settings, or omitting one whose default is the run's, overrides nothing.
`describe` writes the overrides as the header's value, ``temperature=0.7->1.0,
top_p=0.9->1.0``.

docs/reference/openai-endpoint.md ("Sampling policy") says why ``honour`` is the default.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Annotated, Literal

import msgspec

from .errors import ApiError

__all__ = [
    "PARAMS",
    "POLICIES",
    "REFUSED_CODE",
    "Applied",
    "Override",
    "SamplingPolicy",
    "SamplingSettings",
    "apply_policy",
    "describe",
]

POLICIES = ("honour", "override", "refuse")

PARAMS = ("temperature", "top_p", "top_k")
"""The parameters a policy overrides or refuses, in the order they are checked."""

REFUSED_CODE = "sampling_refused"
"""The ``code`` of a call refused by the ``refuse`` policy (400, ``param`` naming the parameter)."""


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


class SamplingSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What one call is sampled with: ``temperature`` (0: greedy), ``top_p``, ``top_k``
    (None: no cap of the call's own, the samplers' ``max_support``) and ``seed`` (None:
    the sampler draws one). As a request's settings, the endpoint's defaults stand in for
    what it did not send."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None


class Override(msgspec.Struct, frozen=True):
    """One parameter the policy changed: what the call would have been sampled with
    under ``honour`` (``requested``) and what it is sampled with (``applied``)."""

    param: str
    requested: float | int | None
    applied: float | int | None


class Applied(msgspec.Struct, frozen=True, kw_only=True):
    """`apply_policy`'s answer: the settings to sample with and what they override (in
    the order of `PARAMS`; empty unless the policy is ``override``)."""

    settings: SamplingSettings
    overridden: tuple[Override, ...] = ()


def apply_policy(policy: SamplingPolicy, requested: SamplingSettings, *,
                 defaulted: Collection[str] = ()) -> Applied:
    """What a call asking for ``requested`` is sampled with under ``policy`` (module
    docstring). ``defaulted``: the parameters the call did not send (``requested``
    holds the endpoint's default for them); a refusal says so. ``refuse`` raises
    `ApiError` 400 `REFUSED_CODE` naming the first parameter out of its range, in the
    order of `PARAMS`; the seed is always the call's."""
    if policy.policy == "override":
        applied = SamplingSettings(temperature=float(policy.temperature), top_p=float(policy.top_p),
                                   top_k=policy.top_k, seed=requested.seed)
        overridden = tuple(Override(p, getattr(requested, p), getattr(applied, p)) for p in PARAMS
                           if getattr(requested, p) != getattr(applied, p))
        return Applied(settings=applied, overridden=overridden)
    if policy.policy == "refuse":
        _refuse_outside(policy, requested, defaulted)
    return Applied(settings=requested)


def _refuse_outside(policy: SamplingPolicy, requested: SamplingSettings,
                    defaulted: Collection[str]) -> None:
    def refused(param: str, why: str) -> ApiError:
        value = _show(getattr(requested, param))
        if param in defaulted:
            value += " (the default: the request sent none)"
        return ApiError(400, f"{param} {value} {why} (sampling policy \"refuse\")", param=param,
                        code="sampling_refused")  # REFUSED_CODE, spelt out for the error-table test

    for param, (lo, hi) in (("temperature", policy.temperature_range), ("top_p", policy.top_p_range)):
        v = getattr(requested, param)
        if not lo <= v <= hi:
            raise refused(param, f"is outside this endpoint's allowed range [{_show(float(lo))}, "
                                 f"{_show(float(hi))}]")
    if requested.top_k is not None and requested.top_k < policy.min_top_k:
        raise refused("top_k", f"is below this endpoint's allowed minimum {policy.min_top_k}")


def describe(overridden: tuple[Override, ...] | list[Override]) -> str:
    """The overrides as ``param=requested->applied``, joined by ``", "`` (the value of
    the ``X-Fleetrl-Sampling-Overridden`` header); ``none`` is no ``top_k`` cap."""
    return ", ".join(f"{o.param}={_show(o.requested)}->{_show(o.applied)}" for o in overridden)


def _show(v: float | int | None) -> str:
    return "none" if v is None else repr(v)

"""The scalars of one metrics.jsonl row, and of one eval.jsonl line, as an experiment
tracker takes them (pure).

Every number keeps its name: a top-level field is logged under its own name (``loss``,
``reward_mean``), a nested one under its path joined by ``/``
(``mismatch_kl_by_sampler/torch/bfloat16``, ``staleness_hist/0``). Booleans, strings,
lists and nulls are not scalars and are left out; ``step`` is the tracker's step, not a
scalar.

An evaluation (a line of the evaluator's eval.jsonl: `EvalRecord`) is logged under
``eval/<split>/<field>`` for each number of the line but its ``version``, ``step`` and
``time`` (``eval/fresh/pass_at_1``, ``eval/fresh/ci_low``, ``eval/fresh/ci_high``,
``eval/fresh/mean_reward``, ``eval/fresh/n``, ``eval/fresh/passed``), plus
``eval/<split>/tool_use`` (share of tasks with a tool call) when the line counts tool
calls; its x-axis is ``eval/step`` (the trainer step that produced the evaluated
version) and ``eval/version`` is logged beside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

__all__ = ["EVAL_STEP", "EVAL_VERSION", "STEP", "Evaluation", "eval_scalars_of", "scalars_of"]

STEP = "step"
EVAL_STEP = "eval/step"
EVAL_VERSION = "eval/version"
_NOT_EVAL_SCALARS = ("version", "step", "time")


def scalars_of(row: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric leaves of `row` by name (see the module docstring)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if not prefix and key == STEP:
            continue
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, Mapping):
            out.update(scalars_of(value, f"{name}/"))
    return out


class Evaluation(NamedTuple):
    """One eval.jsonl line as the tracker logs it."""

    version: int
    step: int
    """The trainer step that produced `version` (the trainer's step axis)."""
    split: str
    scalars: dict[str, float]
    """``eval/<split>/<field>`` and the axis (``eval/step``, ``eval/version``)."""


def eval_scalars_of(line: Mapping[str, Any]) -> Evaluation | str:
    """The evaluation of one eval.jsonl line (see the module docstring), or why it is
    not one (no string ``split``, no integer ``version`` or ``step``)."""
    version, step, split = line.get("version"), line.get("step"), line.get("split")
    if not isinstance(split, str) or not split or "/" in split:
        return f"split {split!r} is not a name"
    for name, value in (("version", version), ("step", step)):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} {value!r} is not an integer"
    assert isinstance(version, int) and isinstance(step, int)
    scalars: dict[str, float] = {EVAL_STEP: step, EVAL_VERSION: version}
    for key, value in line.items():
        if key not in _NOT_EVAL_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
            scalars[f"eval/{split}/{key}"] = value
    calls = line.get("tool_calls")
    if isinstance(calls, list) and calls and all(isinstance(c, int) for c in calls):
        scalars[f"eval/{split}/tool_use"] = sum(1 for c in calls if c > 0) / len(calls)
    return Evaluation(version, step, split, scalars)

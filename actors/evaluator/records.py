"""Pure parts of the evaluator: the ``eval.jsonl`` record, when to evaluate, and which
step a version belongs to."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from fleetrl.actors.recipe import pass_rate_with_ci

__all__ = ["EvalRecord", "EvalState", "is_due", "make_record", "step_of", "tool_use"]


class EvalRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One line of ``eval.jsonl``: pass@1 of one version on one evaluation set."""

    version: int
    step: int
    split: Literal["fresh", "general"]
    n: int
    passed: int
    pass_at_1: float
    ci_low: float
    """Wilson 95% interval of ``pass_at_1``."""
    ci_high: float
    mean_reward: float
    """Mean fraction of hidden tests passed."""
    time: float
    """Unix time the evaluation finished."""
    rewards: tuple[float, ...] = ()
    """Each task's reward, in the evaluation set's order (the same tasks and sampling
    seed at every version, so two evaluations compare task by task: a paired test).
    Empty in lines written before it existed."""
    tool_calls: tuple[int, ...] = ()
    """Each task's number of tool calls (parsed and run), in the same order: an agent
    evaluation's record of the habit its reward selects (tool-use rate: the share of
    nonzero entries; paired across versions like ``rewards``). Empty for evaluations
    without tools and in lines written before it existed."""


class EvalState(msgspec.Struct, frozen=True):
    """The evaluator's checkpointed state: the versions it has evaluated."""

    evaluated: tuple[int, ...] = ()


def make_record(*, version: int, step: int, split: str, rewards: Sequence[float], time: float,
                tool_calls: Sequence[int] = ()) -> EvalRecord:
    """The record of one evaluation (a task passes when its reward is 1.0); ``tool_calls``
    (optional) holds each task's tool calls."""
    n = len(rewards)
    if n < 1:
        raise ValueError("an evaluation needs at least one task")
    if tool_calls and len(tool_calls) != n:
        raise ValueError(f"tool_calls holds {len(tool_calls)} counts for {n} tasks")
    passed = sum(1 for r in rewards if r == 1.0)
    ci = pass_rate_with_ci(passed, n)
    return EvalRecord(version=version, step=step, split=split, n=n, passed=passed, pass_at_1=ci.rate,
                      ci_low=ci.low, ci_high=ci.high, mean_reward=float(sum(rewards)) / n, time=time,
                      rewards=tuple(float(r) for r in rewards), tool_calls=tuple(int(c) for c in tool_calls))


def tool_use(record: EvalRecord) -> float:
    """Share of the record's tasks with at least one tool call (0.0 without counts)."""
    calls = record.tool_calls
    return sum(1 for c in calls if c > 0) / len(calls) if calls else 0.0


def is_due(version: int, evaluated: Iterable[int], every: int) -> bool:
    """Evaluate ``version`` now? When nothing was evaluated yet, or it is at least
    ``every`` versions past the newest evaluated one."""
    done = list(evaluated)
    if version in done:
        return False
    return not done or version >= max(done) + every


def step_of(version: int, metrics_lines: Iterable[str]) -> int:
    """The trainer step that produced ``version``, from its ``metrics.jsonl`` lines: the
    step of the line with this version, else of the newest line below it (a version a
    restarted trainer published without a step: the same weights), else 0."""
    best_v, best_step = -1, 0
    for line in metrics_lines:
        try:
            row = json.loads(line)
            v, step, skipped = int(row["version"]), int(row["step"]), bool(row.get("skipped", False))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a crash
        if skipped:
            continue
        if v == version:
            return step
        if best_v < v < version:
            best_v, best_step = v, step
    return best_step

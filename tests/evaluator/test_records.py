"""The evaluator's pure parts: the eval.jsonl record, when an evaluation is due, the
step of a version, and reading the sandboxed scoring run's report."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleetrl.actors.evaluator import (
    EvalRecord,
    ScoringError,
    is_due,
    make_record,
    rewards_from_report,
    step_of,
    tool_use,
)
from fleetrl.actors.recipe import pass_rate_with_ci
from fleetrl.harness.synthetic import generate_tasks

FIELDS = ["version", "step", "split", "n", "passed", "pass_at_1", "ci_low", "ci_high", "mean_reward", "time", "rewards",
          "tool_calls"]


def test_record_has_exactly_the_report_fields():
    rec = make_record(version=3, step=2, split="fresh", rewards=[1.0, 0.5, 1.0, 0.0], time=12.5)
    obj = json.loads(msgspec.json.encode(rec))
    assert list(obj) == FIELDS
    ci = pass_rate_with_ci(2, 4)
    assert obj == {"version": 3, "step": 2, "split": "fresh", "n": 4, "passed": 2, "pass_at_1": 0.5,
                   "ci_low": ci.low, "ci_high": ci.high, "mean_reward": 0.625, "time": 12.5,
                   "rewards": [1.0, 0.5, 1.0, 0.0], "tool_calls": []}
    with pytest.raises(ValueError, match="at least one task"):
        make_record(version=0, step=0, split="fresh", rewards=[], time=0.0)


def test_tool_calls_are_kept_per_task_and_give_the_tool_use_rate():
    rec = make_record(version=1, step=1, split="fresh", rewards=[1.0, 0.0, 0.0, 1.0], time=0.0,
                      tool_calls=[1, 0, 2, 0])
    assert rec.tool_calls == (1, 0, 2, 0) and tool_use(rec) == 0.5
    assert tool_use(make_record(version=1, step=1, split="fresh", rewards=[1.0], time=0.0)) == 0.0
    with pytest.raises(ValueError, match="3 counts for 4 tasks"):
        make_record(version=1, step=1, split="fresh", rewards=[1.0, 0.0, 0.0, 1.0], time=0.0, tool_calls=[1, 0, 2])


@given(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=1, max_size=50))
def test_record_counts_only_full_passes(rewards):
    rec = make_record(version=0, step=0, split="general", rewards=rewards, time=0.0)
    assert rec.passed == rewards.count(1.0) and rec.n == len(rewards)
    assert rec.ci_low <= rec.pass_at_1 <= rec.ci_high
    assert isinstance(msgspec.json.decode(msgspec.json.encode(rec), type=EvalRecord), EvalRecord)
    assert list(rec.rewards) == rewards


def test_lines_written_before_per_task_rewards_still_read():
    old = {"version": 1, "step": 1, "split": "fresh", "n": 2, "passed": 1, "pass_at_1": 0.5, "ci_low": 0.1,
           "ci_high": 0.9, "mean_reward": 0.5, "time": 1.0}
    assert msgspec.json.decode(json.dumps(old), type=EvalRecord).rewards == ()


def test_is_due():
    assert is_due(0, [], 10)             # nothing evaluated: the first version is due
    assert not is_due(0, [0], 10)        # never twice
    assert not is_due(9, [0], 10)
    assert is_due(10, [0], 10) and is_due(25, [0, 10], 10)
    assert not is_due(19, [0, 10], 10)


@given(st.lists(st.integers(0, 200), unique=True), st.integers(0, 250), st.integers(1, 20))
def test_is_due_never_repeats_and_spaces_evaluations(done, version, every):
    due = is_due(version, done, every)
    if version in done:
        assert not due
    elif done and version < max(done) + every:
        assert not due


def test_step_of_maps_versions_through_restarts():
    lines = [json.dumps({"step": s, "version": v, "skipped": k}) for s, v, k in
             [(1, 1, False), (2, 2, False), (2, 2, True), (3, 3, False),
              # a restart resumed at step 2 and published its weights as version 4, then stepped on
              (3, 5, False)]]
    lines.insert(2, '{"step": 9, "vers')  # a line cut by a kill
    assert step_of(0, lines) == 0
    assert step_of(2, lines) == 2 and step_of(3, lines) == 3
    assert step_of(4, lines) == 3  # no line of its own: the newest step below it
    assert step_of(5, lines) == 3
    assert step_of(7, []) == 0


def test_report_parsing():
    tasks = generate_tasks(3, split="fresh", seed=0)
    report = [[0, "8/8\n"], [1, "synthetic check: wrong\n3/8\n"], [-9, ""]]
    scores = rewards_from_report(tasks, "noise\n" + json.dumps(report) + "\n")
    assert scores.rewards == (1.0, 0.375, 0.0) and scores.errors == 1
    junk = rewards_from_report(tasks, json.dumps([[0, "8/8"], [1, "no fraction here"], [0, "1/8"]]))
    assert junk.rewards == (1.0, 0.0, 0.125) and junk.errors == 1
    with pytest.raises(ScoringError, match="printed nothing"):
        rewards_from_report(tasks, "")
    with pytest.raises(ScoringError, match="not JSON"):
        rewards_from_report(tasks, "Traceback ...")
    with pytest.raises(ScoringError, match="driver exited 1"):
        rewards_from_report(tasks, json.dumps({"error": "driver exited 1: boom"}))
    with pytest.raises(ScoringError, match="2 results for 3 tasks"):
        rewards_from_report(tasks, json.dumps(report[:2]))

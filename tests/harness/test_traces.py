"""Production traces -> tasks: a 50-session fixture with malformed lines, missing
fields, successful and failed outcomes gives exactly the expected tasks and a report
naming every skipped line and why; turn prefixes; report invariants (Hypothesis)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.harness.tasks import (
    Evaluator,
    FunctionCall,
    Limits,
    Message,
    Setup,
    Source,
    Task,
    ToolCall,
)
from fleetrl.harness.traces import SkippedLine, tasks_from_traces

FILE = "prod.jsonl"


def good_session(i: int, *, outcome: str | None, score: float | None, turns: int = 2, system: bool = True) -> dict:
    """A well-formed session: optional system prompt, the user's request, then
    ``turns`` assistant tool calls each answered by a tool result, then a final reply."""
    msgs: list[dict] = []
    if system:
        msgs.append({"role": "system", "content": f"You are agent #{i}."})
    msgs.append({"role": "user", "content": [{"type": "text", "text": f"Fix bug {i} "}, {"type": "text", "text": "please"}]})
    for t in range(turns):
        msgs.append(
            {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [
                    {"id": f"c{i}-{t}", "type": "function", "function": {"name": "bash", "arguments": f'{{"cmd": "ls {t}"}}'}}
                ],
            }
        )
        msgs.append({"role": "tool", "tool_call_id": f"c{i}-{t}", "content": f"out {t}"})
    msgs.append({"role": "assistant", "content": "Done."})
    s: dict = {
        "id": f"s{i:02d}",
        "messages": msgs,
        "workspace": {"files": {"src/app.py": f"BUG = {i}\n"}, "setup": ["pip install -e ."]},
        "eval": {"command": "pytest -q", "reward": "exit_code", "timeout_s": 120},
        "metadata": {"customer": "acme", "n": i},
        "logged_at": "2026-11-30T00:00:00Z",  # unknown top-level keys are ignored
    }
    if outcome is not None:
        s["outcome"] = outcome
    if score is not None:
        s["score"] = score
    if i % 5 == 0:
        s["image"] = "corp/agent-env:7"
        s["limits"] = {"max_turns": 12, "timeout_s": 300}
    return s


def expected_task(s: dict, line: int, *, failed: bool, from_turn: int = 0) -> Task:
    """The task a session must become, written out independently of traces.py."""
    i = int(s["id"][1:])
    msgs = []
    if "You are agent" in json.dumps(s["messages"][0]):
        msgs.append(Message(role="system", content=f"You are agent #{i}."))
    msgs.append(Message(role="user", content=f"Fix bug {i} please"))
    for t in range(from_turn):
        msgs.append(
            Message(
                role="assistant",
                content="",
                tool_calls=[ToolCall(id=f"c{i}-{t}", function=FunctionCall(name="bash", arguments=f'{{"cmd": "ls {t}"}}'))],
            )
        )
        msgs.append(Message(role="tool", content=f"out {t}", tool_call_id=f"c{i}-{t}"))
    return Task(
        id=f"trace:{s['id']}" if from_turn == 0 else f"trace:{s['id']}@turn{from_turn}",
        messages=msgs,
        image=s.get("image", "fleetrl-sandbox:py311"),
        workdir="/work",
        setup=Setup(files={"src/app.py": f"BUG = {i}\n"}, commands=["pip install -e ."]),
        evaluator=Evaluator(command="pytest -q", reward="exit_code", timeout_s=120.0),
        limits=Limits(max_turns=12, timeout_s=300.0) if "limits" in s else Limits(),
        metadata={
            "customer": "acme",
            "n": i,
            "trace.outcome": "failure" if failed else "success",
            "trace.score": s.get("score"),
            "trace.messages": len(s["messages"]),
        },
        source=Source(kind="trace", ref=f"{FILE}:{line}", trace_id=s["id"], from_turn=from_turn),
    )


def build_fixture():
    """50 sessions (plus blank lines) and, per line, what must come of it:
    ("failed"|"succeeded", session) or ("skip", trace_id, field, reason fragment)."""
    rows: list[tuple[str, object]] = []  # (raw line, expectation)

    def add(obj_or_raw, expect):
        raw = obj_or_raw if isinstance(obj_or_raw, str) else json.dumps(obj_or_raw)
        rows.append((raw, expect))

    i = 0
    for k in range(32):
        i += 1
        if k % 8 == 0:  # by score only
            s = good_session(i, outcome=None, score=0.25 if k % 16 == 0 else 1.0, system=k % 3 != 0)
            add(s, ("failed" if s["score"] < 1.0 else "succeeded", s))
        elif k % 3 == 0:
            s = good_session(i, outcome="success", score=0.9, turns=1 + k % 3)  # the outcome wins over the score
            add(s, ("succeeded", s))
        else:
            s = good_session(i, outcome="failure", score=None, turns=k % 4, system=k % 2 == 0)
            add(s, ("failed", s))
        if k % 10 == 9:
            rows.append(("   ", None))  # blank lines are not sessions

    def broken(mutate, field, fragment, *, keep_id=True):
        nonlocal i
        i += 1
        s = good_session(i, outcome="failure", score=None)
        mutate(s)
        add(s, ("skip", s.get("id") if keep_id and isinstance(s.get("id"), str) and s.get("id") else None, field, fragment))

    i += 1
    add('{"id": "s99", "messages": [', ("skip", None, "", "invalid JSON"))
    i += 1
    add("[1, 2, 3]", ("skip", None, "", "must be a JSON object"))
    broken(lambda s: s.pop("id"), "id", "missing required field")
    broken(lambda s: s.update(id=""), "id", "length >= 1")
    broken(lambda s: s.pop("messages"), "messages", "missing required field")
    broken(lambda s: s.pop("workspace"), "workspace", "missing required field")
    broken(lambda s: s.pop("eval"), "eval", "missing required field")
    broken(lambda s: s["eval"].update(command=""), "eval.command", "length >= 1")
    broken(lambda s: s.pop("outcome"), "outcome", "neither `outcome` nor `score`")
    broken(lambda s: s.update(outcome="partial"), "outcome", "Invalid enum value 'partial'")
    broken(lambda s: (s.pop("outcome"), s.update(score="high")), "score", "Expected `float | null`, got `str`")
    broken(lambda s: s.update(messages=[m for m in s["messages"] if m["role"] != "user"]), "messages", "no user message")
    broken(lambda s: s["messages"][2].update(role="robot"), "messages[2].role", "Invalid enum value 'robot'")
    broken(
        lambda s: s["messages"][1].update(content=[{"type": "image_url", "image_url": {"url": "x"}}]),
        "messages[1].content[0]",
        "only text parts",
    )
    broken(lambda s: s["workspace"]["files"].update({"../etc/passwd": "x"}), "workspace.files['../etc/passwd']", "inside workdir")
    broken(lambda s: s["workspace"].update(file={}), "workspace.file", "unknown field")
    broken(lambda s: s["messages"][2]["tool_calls"][0].pop("function"), "messages[2].tool_calls[0].function", "missing required field")

    # a repeated session id: the first one (line of session s01) keeps its task
    dup = good_session(1, outcome="failure", score=None)
    i += 1
    first_line = 1
    add(dup, ("skip", "s01", "id", f"duplicate session id (first at line {first_line})"))
    return rows


def numbered(rows):
    """(line number, raw, expectation) for every row, blank ones included."""
    return [(n, raw, exp) for n, (raw, exp) in enumerate(rows, start=1)]


def test_fixture_has_50_sessions():
    rows = build_fixture()
    assert sum(1 for raw, _ in rows if raw.strip()) == 50
    kinds = [exp[0] for _, exp in rows if exp is not None]
    assert kinds.count("skip") == 18 and kinds.count("failed") > 10 and kinds.count("succeeded") > 5


@pytest.mark.parametrize("only_failed", [False, True])
def test_fifty_sessions_give_exactly_the_expected_tasks_and_report(only_failed):
    rows = build_fixture()
    result = tasks_from_traces([raw for raw, _ in rows], file=FILE, only_failed=only_failed)

    expected_tasks = []
    expected_skips = []
    n_failed = n_succeeded = n_filtered = 0
    for line, _, exp in numbered(rows):
        if exp is None:
            continue
        if exp[0] == "skip":
            expected_skips.append((line, exp[1], exp[2], exp[3]))
            continue
        failed = exp[0] == "failed"
        if only_failed and not failed:
            n_filtered += 1
            continue
        n_failed += failed
        n_succeeded += not failed
        expected_tasks.append(expected_task(exp[1], line, failed=failed))

    assert result.tasks == expected_tasks
    report = result.report
    assert report.sessions_read == 50
    assert (report.tasks, report.failed, report.succeeded, report.filtered_out) == (
        len(expected_tasks),
        n_failed,
        n_succeeded,
        n_filtered,
    )
    assert len(report.skipped) == 18
    for got, (line, trace_id, field, fragment) in zip(report.skipped, expected_skips, strict=True):
        assert (got.line, got.trace_id, got.field) == (line, trace_id, field), got
        assert fragment in got.reason, got
    assert report.sessions_read == report.tasks + report.filtered_out + len(report.skipped)

    text = report.render()
    for line, *_ in expected_skips:
        assert f"skipped {FILE}:{line}" in text
    assert text.splitlines()[0].startswith(f"{FILE}: read 50 sessions: {len(expected_tasks)} tasks")


@pytest.mark.parametrize("from_turn", [1, 2])
def test_fixture_from_turn_keeps_the_recorded_prefix(from_turn):
    rows = build_fixture()
    result = tasks_from_traces([raw for raw, _ in rows], file=FILE, from_turn=from_turn)
    expected = []
    too_short = []
    for line, _, exp in numbered(rows):
        if exp is None or exp[0] == "skip":
            continue
        tool_turns = sum(1 for m in exp[1]["messages"] if m["role"] == "tool")
        if tool_turns >= from_turn:
            expected.append(expected_task(exp[1], line, failed=exp[0] == "failed", from_turn=from_turn))
        else:
            too_short.append(line)
    assert expected and too_short
    assert result.tasks == expected
    short = [s for s in result.report.skipped if s.line in too_short]
    assert [s.line for s in short] == too_short
    assert all(s.field == "messages" and f"no turn-{from_turn} prefix" in s.reason for s in short)
    assert len(result.report.skipped) == 18 + len(too_short)


def simple_session(messages, **extra):
    return {
        "id": "t",
        "messages": messages,
        "outcome": "failure",
        "workspace": {},
        "eval": {"command": "true"},
        **extra,
    }


S = {"role": "system", "content": "sys"}
U = {"role": "user", "content": "req"}
U2 = {"role": "user", "content": "more"}
A = {"role": "assistant", "content": "ans"}
T = {"role": "tool", "content": "res", "tool_call_id": "c"}
ATC = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}


@pytest.mark.parametrize(
    ("messages", "from_turn", "prefix_len"),
    [
        ([S, U, A], 0, 2),
        ([U, U2, A, U, A], 0, 2),  # several user messages before the first reply: all are the request
        ([S, U, ATC, T, A], 1, 4),
        ([S, U, ATC, T, ATC, T, A], 2, 6),
        ([S, U, A, U2], 1, 4),  # the session ends with the user's follow-up: continue from it
        ([A, S, U, A], 0, 3),  # an assistant message before the first request is not a turn
        ([U], 0, 1),
    ],
)
def test_turn_prefixes(messages, from_turn, prefix_len):
    result = tasks_from_traces([json.dumps(simple_session(messages))], file=FILE, from_turn=from_turn)
    assert result.report.skipped == []
    (task,) = result.tasks
    assert task.messages is not None and len(task.messages) == prefix_len
    assert [m.role for m in task.messages] == [
        "system" if m["role"] == "developer" else m["role"] for m in messages[:prefix_len]
    ]
    assert task.source is not None and task.source.from_turn == from_turn
    assert task.id == ("trace:t" if from_turn == 0 else f"trace:t@turn{from_turn}")


@pytest.mark.parametrize(
    ("messages", "from_turn", "fragment"),
    [
        ([S, U, A], 1, "1 assistant turn and ends with an assistant reply"),
        ([S, U, ATC, T], 2, "1 assistant turn and no later turn"),
        ([S, A], 0, "no user message"),
        ([], 0, "no user message"),
    ],
)
def test_missing_turn_prefix_is_skipped_with_reason(messages, from_turn, fragment):
    result = tasks_from_traces([json.dumps(simple_session(messages))], file=FILE, from_turn=from_turn)
    assert result.tasks == []
    assert result.report.skipped == [SkippedLine(line=1, trace_id="t", field="messages", reason=result.report.skipped[0].reason)]
    assert fragment in result.report.skipped[0].reason


def test_developer_role_becomes_system_and_score_threshold_applies():
    lines = [
        json.dumps(simple_session([{"role": "developer", "content": "d"}, U], id="a", outcome=None, score=0.7)),
        json.dumps(simple_session([U], id="b", outcome=None, score=0.7)),
    ]
    strict = tasks_from_traces(lines, file=FILE, only_failed=True)  # default: below 1.0 failed
    assert [t.id for t in strict.tasks] == ["trace:a", "trace:b"]
    assert strict.tasks[0].messages is not None and strict.tasks[0].messages[0].role == "system"
    lenient = tasks_from_traces(lines, file=FILE, only_failed=True, fail_below=0.5)
    assert lenient.tasks == [] and lenient.report.filtered_out == 2


def test_bytes_lines_byte_order_mark_and_bad_utf8():
    good = json.dumps(simple_session([U])).encode()
    result = tasks_from_traces([b"\xef\xbb\xbf" + good + b"\n", b'{"id": "\xff"}\n'], file=FILE)
    assert [t.id for t in result.tasks] == ["trace:t"]
    assert [(s.line, s.field) for s in result.report.skipped] == [(2, "")]
    assert "invalid JSON" in result.report.skipped[0].reason


def test_deeply_nested_line_is_skipped_not_a_crash():
    result = tasks_from_traces(["[" * 100_000 + "]" * 100_000], file=FILE)
    assert [(s.line, s.reason) for s in result.report.skipped] == [(1, "invalid JSON: nested too deeply")]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="from_turn"):
        tasks_from_traces([], file=FILE, from_turn=-1)
    with pytest.raises(ValueError, match="fail_below"):
        tasks_from_traces([], file=FILE, fail_below=float("nan"))


line_strategy = st.one_of(
    st.text(max_size=30),
    st.builds(
        lambda msgs, outcome, score, drop: json.dumps(
            {k: v for k, v in simple_session(msgs, outcome=outcome, score=score).items() if k != drop}
        ),
        st.lists(st.sampled_from([S, U, U2, A, T, ATC]), max_size=6),
        st.sampled_from([None, "success", "failure", "meh"]),
        st.none() | st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from([None, "id", "workspace", "eval", "messages"]),
    ),
)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(lines=st.lists(line_strategy, max_size=8), only_failed=st.booleans(), from_turn=st.integers(0, 2))
def test_every_non_blank_line_is_accounted_for_exactly_once(lines, only_failed, from_turn):
    result = tasks_from_traces(lines, file=FILE, only_failed=only_failed, from_turn=from_turn)
    r = result.report
    non_blank = [n for n, raw in enumerate(lines, start=1) if raw.strip()]
    assert r.sessions_read == len(non_blank)
    assert r.sessions_read == r.tasks + r.filtered_out + len(r.skipped)
    assert r.tasks == len(result.tasks) == r.failed + r.succeeded
    task_lines = [int(t.source.ref.rsplit(":", 1)[1]) for t in result.tasks if t.source is not None]
    assert set(task_lines).isdisjoint(s.line for s in r.skipped)
    assert all(s.reason for s in r.skipped)
    assert set(task_lines) | {s.line for s in r.skipped} <= set(non_blank)

"""The ATIF reader: fixtures written for these tests (tests/fixtures/atif: tool calls,
content parts, a trajectory continued in another file, non-ASCII JSON Lines) give exactly
the expected Sessions; malformed trajectories each give one problem naming the
trajectory and the field path, and the valid ones beside them still load."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from fleetrl.harness.atif import read_atif
from fleetrl.harness.task_schema import FunctionCall, Message, ToolCall
from fleetrl.harness.trace_import import read_sessions
from fleetrl.harness.trace_sessions import Session, SessionProblem

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "atif"


def call(call_id: str, name: str, arguments: str) -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))


def read(name: str):
    return read_atif((FIXTURES / name).read_bytes(), name)


def test_tool_calls_become_assistant_calls_and_tool_results():
    r = read("tool-calls.atif.json")
    assert r.problems == [] and r.format == "atif"
    assert r.sessions == [Session(
        id="run-tools-1", format="atif", ref="tool-calls.atif.json",
        messages=[
            Message(role="system", content="You are a coding agent. Use the bash tool."),
            Message(role="user", content="Fix the failing test in parser.py"),
            Message(role="assistant", content="Let me run the tests first.",
                    tool_calls=[call("call_1", "bash", '{"cmd": "pytest -q"}'), call("call_2", "read_file", "{}")]),
            Message(role="tool", content="1 failed: test_parse_empty", tool_call_id="call_1"),
            Message(role="tool", content="def parse(s):\n    return s.split(',')\n", tool_call_id="call_2"),
            Message(role="user", content="Hurry up, please."),
            Message(role="assistant", content="I could not fix it."),
        ],
        outcome="failure", score=0.0,
        metadata={"atif.schema_version": "ATIF-v1.4", "agent": "terminus-2", "agent.version": "2.0.1",
                  "model": "qwen3-8b"})]


def test_content_parts_are_joined_and_results_without_a_call_are_user_messages():
    r = read("multipart.atif.json")
    assert r.problems == []
    assert r.sessions == [Session(
        id="run-parts-1", format="atif", ref="multipart.atif.json",
        messages=[
            Message(role="user", content="Open the file notes.txt and summarise it."),
            Message(role="assistant", content="", tool_calls=[call("t1", "cat", '{"path": "notes.txt"}')]),
            Message(role="tool", content="line one\nline two\n", tool_call_id="t1"),
            Message(role="assistant", content="Two lines."),
            Message(role="user", content="the session timer fired"),
            Message(role="system", content="Context compacted."),
            Message(role="user", content="checkpoint saved"),
        ],
        score=1.0,  # Harbor's verifier_result.rewards.reward
        metadata={"atif.schema_version": "ATIF-v1.6", "agent": "computer-use", "agent.version": "1.0.0"})]


def test_a_trajectory_continued_elsewhere_is_truncated_and_string_arguments_are_kept():
    (s,) = read("truncated.atif.json").sessions
    assert s.truncated and s.score == 0.25 and s.outcome is None
    assert s.messages[1].tool_calls == [call("c", "bash", '{"cmd":"make"}')]


def test_non_ascii_json_lines_are_kept_exactly():
    r = read("non-ascii.jsonl")
    assert r.problems == []
    first, second = r.sessions
    assert first == Session(
        id="ünï-1", format="atif", ref="non-ascii.jsonl:1",
        messages=[Message(role="user", content="写一个函数 🐍, café"),
                  Message(role="assistant", content="好的 — voilà ✓",
                          tool_calls=[call("c1", "écrire", '{"texte": "naïve ☃"}')]),
                  Message(role="tool", content="ok ✓", tool_call_id="c1")],
        outcome="success", score=1.0,
        metadata={"atif.schema_version": "ATIF-v1.7", "agent": "agent-ä", "agent.version": "1"})
    assert second.ref == "non-ascii.jsonl:2" and second.truncated
    assert second.messages == [Message(role="user", content="Grüße\x00😀"), Message(role="assistant", content="Ελληνικά")]


def test_trace_import_sniffs_and_reads_atif():
    data = (FIXTURES / "tool-calls.atif.json").read_bytes()
    r = read_sessions(data, "auto", "x.json")
    assert r.format == "atif" and len(r.sessions) == 1 and r.sessions[0].id == "run-tools-1"


def test_copied_context_restarts_the_conversation():
    doc = {"schema_version": "ATIF-v1.5", "session_id": "s", "agent": {"name": "a", "version": "1"}, "steps": [
        {"step_id": 1, "source": "user", "message": "long task", "is_copied_context": True},
        {"step_id": 2, "source": "agent", "message": "working"},
        {"step_id": 3, "source": "user", "message": "summary of the work so far", "is_copied_context": True},
        {"step_id": 4, "source": "agent", "message": "continuing"},
    ]}
    (s,) = read_atif(json.dumps(doc).encode(), "f").sessions
    assert s.messages == [Message(role="user", content="summary of the work so far"),
                          Message(role="assistant", content="continuing")]
    assert s.metadata["atif.restarts"] == 1


# --------------------------------------------------------------------------- malformed

VALID = {
    "schema_version": "ATIF-v1.6", "session_id": "ok", "agent": {"name": "a", "version": "1"},
    "steps": [
        {"step_id": 1, "source": "user", "message": "hi"},
        {"step_id": 2, "source": "agent", "message": "calling",
         "tool_calls": [{"tool_call_id": "c1", "function_name": "f", "arguments": {"x": 1}}],
         "observation": {"results": [{"source_call_id": "c1", "content": "done"}]}},
    ],
}


def _set(path: list, value):
    def mutate(doc):
        node = doc
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return doc
    return mutate


_DELETE = object()

MALFORMED = [
    ("not an object", lambda d: ["a", "list"], "", "must be a JSON object"),
    ("no steps", _set(["steps"], _DELETE), "", "missing required field `steps`"),
    ("empty steps", _set(["steps"], []), "steps", "holds no step"),
    ("v2", _set(["schema_version"], "ATIF-v2.0"), "schema_version", "not an ATIF v1 version"),
    ("unknown source", _set(["steps", 0, "source"], "robot"), "steps[0].source", "Invalid enum value 'robot'"),
    ("step ids out of order", _set(["steps", 1, "step_id"], 3), "steps[1].step_id", "expected 2"),
    ("function name not a string", _set(["steps", 1, "tool_calls", 0, "function_name"], 7),
     "steps[1].tool_calls[0].function_name", "Expected `str`, got `int`"),
    ("empty function name", _set(["steps", 1, "tool_calls", 0, "function_name"], ""),
     "steps[1].tool_calls[0].function_name", "must be a non-empty string"),
    ("arguments a number", _set(["steps", 1, "tool_calls", 0, "arguments"], 5),
     "steps[1].tool_calls[0].arguments", "Expected `str | object | null`, got `int`"),
    ("result for an unknown call", _set(["steps", 1, "observation", "results", 0, "source_call_id"], "c9"),
     "steps[1].observation.results[0].source_call_id", "'c9' names no tool call of this step"),
    ("image part", _set(["steps", 0, "message"], [{"type": "text", "text": "see "},
                                                 {"type": "image", "source": {"media_type": "image/png",
                                                                              "path": "a.png"}}]),
     "steps[0].message[1]", "only text parts can be replayed, got type 'image'"),
    ("image in a result", _set(["steps", 1, "observation", "results", 0, "content"],
                               [{"type": "image", "source": {"media_type": "image/png", "path": "s.png"}}]),
     "steps[1].observation.results[0].content[0]", "only text parts"),
    ("tool calls on a user step", _set(["steps", 0, "tool_calls"], []), "steps[0].tool_calls",
     "only agent steps carry tool_calls"),
    ("reward not a number", _set(["extra"], {"reward": "high"}), "extra.reward", "must be a finite number"),
    ("bad outcome", _set(["extra"], {"outcome": "maybe"}), "extra.outcome", "must be \"success\" or \"failure\""),
    ("logprobs not numbers", _set(["steps", 1, "metrics"], {"logprobs": ["x"]}), "steps[1].metrics.logprobs[0]",
     "Expected `float | null`, got `str`"),
]


@pytest.mark.parametrize("name, mutate, field, reason", MALFORMED, ids=[m[0] for m in MALFORMED])
@pytest.mark.parametrize("layout", ["array", "jsonl"])
def test_a_malformed_trajectory_is_one_problem_and_costs_nothing_else(name, mutate, field, reason, layout):
    bad = mutate(copy.deepcopy(VALID))
    docs = [dict(VALID, session_id="first"), bad, dict(VALID, session_id="last")]
    if layout == "array":
        data, where = json.dumps(docs).encode(), "many.json:1"
    else:
        data, where = "\n".join(json.dumps(d, ensure_ascii=False) for d in docs).encode(), "many.json:2"
    r = read_atif(data, "many.json")
    assert [s.id for s in r.sessions] == ["first", "last"]
    (problem,) = r.problems
    assert problem.where == where and problem.field == field, problem
    assert reason in problem.reason, problem.reason


def test_a_line_that_is_no_json_is_one_problem():
    data = (json.dumps(VALID) + "\n{not json\n" + json.dumps(dict(VALID, session_id="z"))).encode()
    r = read_atif(data, "t.jsonl")
    assert [s.id for s in r.sessions] == ["ok", "z"]
    (p,) = r.problems
    assert p.where == "t.jsonl:2" and p.field == "" and p.reason.startswith("invalid JSON")


def test_empty_input_is_one_problem():
    assert read_atif(b"  \n", "e.json").problems == [
        SessionProblem(where="e.json", field="", reason="no trajectory (the input is empty)")]


def test_a_document_cut_short_is_one_problem_not_one_per_line():
    text = json.dumps(VALID, indent=2)
    r = read_atif(text[: len(text) // 2].encode(), "cut.json")
    assert r.sessions == []
    (p,) = r.problems
    assert p.where == "cut.json" and p.reason.startswith("invalid JSON") and "cut" in p.reason

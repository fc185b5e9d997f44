"""Trajectory readers: mini-swe-agent files (made by mini-swe-agent's own DefaultAgent,
tests/fixtures/traces/make_mswea_fixtures.py) and an OpenAI request log (tool calls,
multi-part and non-ASCII content, interleaved runs, string bodies, streams, a length
cut, a line cut mid-write) give exactly the expected Sessions; 22 malformed records
across these two formats and our own each give one problem naming the record and the
field, and cost nothing else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetrl.harness.task_schema import FunctionCall, Message, ToolCall
from fleetrl.harness.trace_formats import read_fleetrl_traces, read_mini_swe_agent, read_openai_log
from fleetrl.harness.trace_sessions import Session, SessionProblem

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
SYSTEM = Message(role="system", content="You are a helpful assistant that can interact with a computer.")


def tool_call(call_id: str, command: str) -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name="bash", arguments=json.dumps({"command": command})))


def observation(output: str) -> str:
    return f"<returncode>0</returncode>\n<output>\n{output}\n</output>"


def mswea_meta(status: str, model: str, cost: float) -> dict:
    return {
        "mswea.exit_status": status,
        "model": model,
        "mswea.api_calls": 2,
        "mswea.cost": cost,
        "mswea.version": "2.4.6",
        "mswea.trajectory_format": "mini-swe-agent-1.1",
    }


def read_fixture(name: str):
    path = FIXTURES / name
    return read_mini_swe_agent(path.read_bytes(), f"runs/{name}")


RENAME = [SYSTEM, Message(role="user", content="Please solve this issue: Rename the helper"),
          Message(role="assistant", content="Listing files.", tool_calls=[tool_call("call_1", "echo a.py")]),
          Message(role="tool", content=observation("a.py"), tool_call_id="call_1")]

EXPECTED_MSWEA = {
    "mswea-submitted.traj.json": Session(
        id="mswea-submitted", format="mini-swe-agent", ref="runs/mswea-submitted.traj.json",
        messages=[
            SYSTEM,
            Message(role="user", content="Please solve this issue: Fix the CSV export — it drops the last row (ümlaut test)"),
            Message(role="assistant", content="Je regarde d'abord le dépôt 🔍",
                    tool_calls=[tool_call("call_1", "echo 'naïve café'")]),
            Message(role="tool", content=observation("naïve café"), tool_call_id="call_1"),
            # the submitting call has no tool result: Submitted ends the run inside the action
            Message(role="assistant", content="",
                    tool_calls=[tool_call("call_2", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]),
        ],
        outcome="success", score=None, truncated=False,
        metadata=mswea_meta("Submitted", "deterministic_toolcall", 2.0),
    ),
    "mswea-limits.traj.json": Session(
        id="mswea-limits", format="mini-swe-agent", ref="runs/mswea-limits.traj.json",
        messages=[
            SYSTEM,
            Message(role="user", content="Please solve this issue: Make the tests pass"),
            Message(role="assistant", content="THOUGHT: step 0\n\n```mswea_bash_command\necho step 0\n```"),
            Message(role="user", content=observation("step 0")),
            Message(role="assistant", content="THOUGHT: step 1\n\n```mswea_bash_command\necho step 1\n```"),
            Message(role="user", content=observation("step 1")),
        ],
        outcome="failure", truncated=True, metadata=mswea_meta("LimitsExceeded", "deterministic", 2.0),
    ),
    "mswea-error.traj.json": Session(
        id="mswea-error", format="mini-swe-agent", ref="runs/mswea-error.traj.json", messages=RENAME,
        outcome="failure", truncated=False, metadata=mswea_meta("RuntimeError", "deterministic_toolcall", 1.0),
    ),
    "mswea-crashed.traj.json": Session(
        id="mswea-crashed", format="mini-swe-agent", ref="runs/mswea-crashed.traj.json", messages=RENAME,
        outcome=None, truncated=True, metadata=mswea_meta("", "deterministic_toolcall", 1.0),
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_MSWEA))
def test_mini_swe_agent_trajectories_read_exactly(name):
    read = read_fixture(name)
    assert read.problems == []
    assert read.sessions == [EXPECTED_MSWEA[name]]
    assert read.format == "mini-swe-agent"


def test_mini_swe_agent_score_and_instance_id():
    doc = json.loads((FIXTURES / "mswea-submitted.traj.json").read_text())
    doc["instance_id"] = "django__django-11099"
    doc["info"]["score"] = 0.0  # an evaluation pipeline's verdict: it decides over "Submitted"
    (session,) = read_mini_swe_agent(json.dumps(doc).encode(), "x.json").sessions
    assert (session.id, session.outcome, session.score) == ("django__django-11099", None, 0.0)


SYS = Message(role="system", content="You are a coding agent. Use the bash tool.")
USER = Message(role="user", content="Fix the failing test in parser.py")


def bash(call_id: str, cmd: str) -> ToolCall:
    return ToolCall(id=call_id, function=FunctionCall(name="bash", arguments=json.dumps({"cmd": cmd})))


RUN_A = [
    SYS, USER,
    Message(role="assistant", content="", tool_calls=[bash("call_a1", "pytest -q")]),
    Message(role="tool", content="1 failed: test_parse_empty", tool_call_id="call_a1"),
    Message(role="assistant", content="Let me read the parser.", tool_calls=[bash("call_a2", "cat parser.py")]),
    Message(role="tool", content="def parse(s):\n    return s.split(',')\n", tool_call_id="call_a2"),
    Message(role="assistant", content="I could not fix it."),
]

EXPECTED_LOG = [
    Session(id="chatcmpl-b1", format="openai-log", ref="log.jsonl:3",
            messages=[Message(role="system", content="Réponds en français."),
                      Message(role="user", content="Écris un haïku 🌸"),
                      Message(role="assistant", content="Le vent du matin —\nune fleur de cerisier\ntombe sur l'étang.")],
            score=0.25, metadata={"tenant": "fr-1", "model": "gpt-4o-mini", "openai.finish_reason": "stop"}),
    Session(id="run-a", format="openai-log", ref="log.jsonl:4", messages=RUN_A, outcome="failure",
            metadata={"session_id": "run-a", "team": "parsers", "model": "gpt-4o", "openai.finish_reason": "stop"}),
    Session(id="chatcmpl-c1", format="openai-log", ref="log.jsonl:5", truncated=True,
            messages=[Message(role="user", content="Summarise the design doc in 2000 words."),
                      Message(role="assistant", content="The design doc proposes a")],
            metadata={"model": "gpt-4o", "openai.finish_reason": "length"}),
    Session(id="chatcmpl-d1", format="openai-log", ref="log.jsonl:6", outcome="success",
            messages=[Message(role="user", content="List the files"),
                      Message(role="assistant", content="", tool_calls=[bash("call_d1", "ls")])],
            metadata={"model": "gpt-4o", "openai.finish_reason": "tool_calls"}),
    Session(id="chatcmpl-e1", format="openai-log", ref="log.jsonl:8", truncated=True,
            messages=[Message(role="system", content="Be brief."),
                      Message(role="user", content="Explain the bug in one line"),
                      Message(role="assistant", content="The loop stops one ")],
            metadata={"model": "gpt-4o"}),
]


def test_openai_log_reads_exactly():
    read = read_openai_log((FIXTURES / "openai-log.jsonl").read_bytes(), "log.jsonl")
    assert read.sessions == EXPECTED_LOG
    assert read.merged == 2  # lines 1 and 2 are prefixes of line 4 (run-a)
    assert read.problems == [SessionProblem(where="log.jsonl:9", field="", reason=read.problems[0].reason)]
    assert read.problems[0].reason.startswith("the log ends mid-line (cut while it was written): invalid JSON")


def test_openai_log_equal_conversations_keep_the_last_and_missing_response_is_truncated():
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    lines = [
        {"request": req, "response": None},  # the answer was never logged: folded into line 2
        {"request": req, "response": {"id": "r1", "choices": [{"message": {"role": "assistant", "content": "yo"}}]}},
        {"request": req, "response": {"id": "r2", "choices": [{"message": {"role": "assistant", "content": "yo"}}]}},
        {"request": {"model": "m", "messages": [{"role": "user", "content": "bye"}]},
         "response": {"error": {"message": "rate limited"}}},
    ]
    read = read_openai_log("\n".join(json.dumps(x) for x in lines).encode() + b"\n", "l")
    assert [(s.id, s.ref, s.truncated, len(s.messages)) for s in read.sessions] == [
        ("r2", "l:3", False, 2), ("line4", "l:4", True, 1)]
    assert read.merged == 2 and read.problems == []


# --------------------------------------------------------------------------- malformed records

LOG_LINES = (FIXTURES / "openai-log.jsonl").read_text(encoding="utf-8").splitlines()[:8]  # without the cut line
GOOD_REQ = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
GOOD_RESP = {"id": "r", "choices": [{"message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}]}


def _with(path: list, value) -> dict:
    line = {"request": json.loads(json.dumps(GOOD_REQ)), "response": GOOD_RESP}
    node = line
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return line


LOG_VARIANTS = [
    ("[1, 2]", "", "a log line must be a JSON object"),
    ('{"foo": 1}', "", "no request"),
    (_with(["request", "messages"], None), "request.messages", "missing"),
    (_with(["request", "messages"], [{"role": "system", "content": "s"}, {"role": "robot", "content": "x"}]),
     "request.messages[1].role", "unknown role 'robot'"),
    (_with(["request", "messages"], [{"role": "user", "content": [
        {"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "data:"}}]}]),
     "request.messages[0].content[1]", "only text parts"),
    (_with(["request", "messages"], [{"role": "user", "content": "a"},
                                     {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]),
     "request.messages[1].tool_calls[0].function", "must be an object"),
    (_with(["response"], {"id": "r", "object": "chat.completion"}), "response.choices", "missing"),
    ({"request": GOOD_REQ, "response": GOOD_RESP, "metadata": {"outcome": "meh"}}, "metadata.outcome", "'meh'"),
    (_with(["request", "metadata"], {"score": "high"}), "request.metadata.score", "must be a number"),
    ({"body": GOOD_REQ, "response_body": "<html>502 Bad Gateway</html>"}, "response_body", "must hold JSON"),
    ('{"request": {"model": "m", "messages": [}', "", "invalid JSON"),
]

MSWEA_DOC = json.loads((FIXTURES / "mswea-submitted.traj.json").read_text())


def _mswea(mutate) -> bytes:
    doc = json.loads(json.dumps(MSWEA_DOC))
    out = mutate(doc)  # None: the document was changed in place
    if out is None:
        return json.dumps(doc).encode()
    return out if isinstance(out, bytes) else out.encode()


MSWEA_VARIANTS = [
    (lambda d: json.dumps(d)[:500].encode(), "", "cut while it was written"),
    (lambda d: json.dumps([d]), "", "is a JSON object"),
    (lambda d: d.pop("messages") and None, "messages", "missing"),
    (lambda d: d.update(trajectory_format="swe-agent-2") or None, "trajectory_format", "not a mini-swe-agent trajectory"),
    (lambda d: d["messages"][2].update(content=[{"type": "text", "text": "look"},
                                               {"type": "image_url", "image_url": {"url": "data:"}}]) or None,
     "messages[2].content[1]", "only text parts"),
    (lambda d: d["info"].update(exit_status=3) or None, "info.exit_status", "must be a string"),
    (lambda d: d["messages"].insert(2, {"type": "function_call", "call_id": "c", "name": "bash"}) or None,
     "messages[2].type", "Responses-API item"),
]

OWN_BASE = [
    {"id": "s1", "messages": [{"role": "user", "content": "do it"}], "outcome": "failure"},
    {"id": "s2", "messages": [{"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}], "score": 0.5},
]
OWN_VARIANTS = [
    ({"messages": [{"role": "user", "content": "x"}]}, "id", "missing"),
    ({"id": "s3", "messages": [{"role": "user", "content": "x"}], "outcome": "partial"}, "outcome", "'partial'"),
    ({"id": "s4", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": 7}]},
     "messages[1].content", "must be a string, null or a list of parts"),
    ({"id": "s1", "messages": [{"role": "user", "content": "x"}]}, "id", "duplicate session id (first at line 1)"),
]


def test_there_are_twenty_two_malformed_variants():
    assert len(LOG_VARIANTS) + len(MSWEA_VARIANTS) + len(OWN_VARIANTS) == 22


@pytest.mark.parametrize(("line", "field", "fragment"), LOG_VARIANTS)
def test_openai_log_malformed_line_is_one_problem_and_costs_nothing_else(line, field, fragment):
    raw = line if isinstance(line, str) else json.dumps(line)
    # the bad line sits between run-a's lines: the folding of the others must not change
    lines = [*LOG_LINES[:2], raw, *LOG_LINES[2:]]
    read = read_openai_log(("\n".join(lines) + "\n").encode(), "log.jsonl")
    assert [(p.where, p.field) for p in read.problems] == [("log.jsonl:3", field)]
    assert fragment in read.problems[0].reason
    assert "cut while" not in read.problems[0].reason
    shifted = [s.ref.rsplit(":", 1) for s in read.sessions]
    assert [int(n) for _, n in shifted] == [4, 5, 6, 7, 9]  # every valid session, one line lower
    assert [s.messages for s in read.sessions] == [s.messages for s in EXPECTED_LOG]
    assert read.merged == 2


@pytest.mark.parametrize(("mutate", "field", "fragment"), MSWEA_VARIANTS)
def test_mini_swe_agent_malformed_file_is_one_problem(mutate, field, fragment):
    read = read_mini_swe_agent(_mswea(mutate), "runs/bad.traj.json")
    assert read.sessions == []
    assert [(p.where, p.field) for p in read.problems] == [("runs/bad.traj.json", field)]
    assert fragment in read.problems[0].reason


@pytest.mark.parametrize(("line", "field", "fragment"), OWN_VARIANTS)
def test_own_format_malformed_line_is_one_problem(line, field, fragment):
    text = "\n".join(json.dumps(x) for x in [OWN_BASE[0], line, OWN_BASE[1]]) + "\n"
    read = read_fleetrl_traces(text.encode(), "t.jsonl")
    assert [(p.where, p.field) for p in read.problems] == [("t.jsonl:2", field)]
    assert fragment in read.problems[0].reason
    assert [(s.id, s.ref, s.outcome, s.score) for s in read.sessions] == [
        ("s1", "t.jsonl:1", "failure", None), ("s2", "t.jsonl:3", None, 0.5)]


def test_a_log_cut_mid_line_keeps_the_whole_request_messages_as_a_truncated_session():
    lines = LOG_LINES[:2] + [LOG_LINES[3][: LOG_LINES[3].index('"response"') + 40]]  # run-a's last call, cut
    read = read_openai_log("\n".join(lines).encode(), "log.jsonl")
    assert read.problems == []
    assert read.sessions == [Session(id="line3", format="openai-log", ref="log.jsonl:3", messages=RUN_A[:6],
                                     truncated=True, metadata={"openai.cut_line": True})]
    assert read.merged == 2  # the two earlier calls are prefixes of what was salvaged


def test_mini_swe_agent_list_content_text_parts_are_joined():
    doc = json.loads(json.dumps(MSWEA_DOC))
    doc["messages"][1]["content"] = [{"type": "text", "text": "Please solve: "},
                                     {"type": "text", "text": "ça marche pas", "cache_control": {"type": "ephemeral"}}]
    (session,) = read_mini_swe_agent(json.dumps(doc).encode(), "x.traj.json").sessions
    assert session.messages[1] == Message(role="user", content="Please solve: ça marche pas")
    assert session.messages[2:] == EXPECTED_MSWEA["mswea-submitted.traj.json"].messages[2:]

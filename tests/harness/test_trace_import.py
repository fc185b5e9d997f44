"""Sessions -> tasks on a template: format dispatch and sniffing, the template's
workspace and grader with the session's conversation cut at a turn, failure filtering
that never guesses, duplicates collapsed by content (also across calls), stable ids,
templates from task files and Harbor directories, `fleetrl traces import` with
--format / --template; a Hypothesis property over cuts and ids."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.harness.cli import register_traces
from fleetrl.harness.task_codec import dump_tasks_jsonl, load_tasks_jsonl
from fleetrl.harness.task_schema import Evaluator, Limits, Message, Setup, Source, Task
from fleetrl.harness.trace_import import (
    SkippedSession,
    TemplateError,
    load_template,
    load_template_harbor,
    read_sessions,
    sniff_format,
    tasks_from_sessions,
)
from fleetrl.harness.trace_sessions import Session

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
HARBOR = Path(__file__).resolve().parent / "harbor_tasks" / "hello-upper"
MSWEA = sorted(FIXTURES.glob("mswea-*.traj.json"))
LOG = FIXTURES / "openai-log.jsonl"

TEMPLATE = Task(
    id="repo-fix",
    prompt="(replaced by the session)",
    image="corp/agent-env:7",
    workdir="/srv/app",
    setup=Setup(files={"parser.py": "def parse(s):\n    return s.split(',')\n"}, commands=["pip install -e ."]),
    evaluator=Evaluator(command="pytest -q", timeout_s=90.0, files={"tests/test_parser.py": "def test(): ..."}),
    limits=Limits(max_turns=12, timeout_s=300.0),
    metadata={"suite": "parsers", "team": "template"},
)


def log_sessions() -> list[Session]:
    return read_sessions(LOG.read_bytes(), "openai-log", "log.jsonl").sessions


def run_a() -> Session:
    (s,) = [s for s in log_sessions() if s.id == "run-a"]
    return s


# --------------------------------------------------------------------------- reading


@pytest.mark.parametrize(
    ("path", "fmt"),
    [*((p, "mini-swe-agent") for p in MSWEA), (LOG, "openai-log")],
)
def test_auto_sniffs_each_fixture_and_says_which(path, fmt):
    data = path.read_bytes()
    assert sniff_format(data) == fmt
    auto = read_sessions(data, "auto", str(path))
    named = read_sessions(data, fmt, str(path))
    assert auto == named and auto.format == fmt


def test_auto_sniffs_our_own_lines_and_atif_and_refuses_to_guess():
    own = b'\n{"id": "s", "messages": [{"role": "user", "content": "x"}], "outcome": "failure"}\n'
    assert read_sessions(own, "auto", "t.jsonl").format == "fleetrl"
    assert sniff_format(b'{"schema_version": "ATIF-v1.4", "session_id": "x", "steps": []}') == "atif"
    read = read_sessions(b"hello\n[1]\n", "auto", "what.txt")
    assert read.sessions == [] and read.format == ""
    assert [(p.where, p.field) for p in read.problems] == [("what.txt", "")]
    assert "cannot tell the format" in read.problems[0].reason
    with pytest.raises(ValueError, match="unknown trace format 'har'"):
        read_sessions(b"", "har", "x")


# --------------------------------------------------------------------------- template substitution


def test_session_becomes_the_template_with_the_cut_conversation():
    session = run_a()
    result = tasks_from_sessions([session], template=TEMPLATE, from_turn=1)
    (task,) = result.tasks
    cut = session.messages[:4]  # system, request, the first tool call and its result
    assert [m.role for m in cut] == ["system", "user", "assistant", "tool"]
    expected = Task(
        id=task.id,
        messages=cut,
        image="corp/agent-env:7",
        workdir="/srv/app",
        setup=TEMPLATE.setup,
        evaluator=TEMPLATE.evaluator,
        limits=TEMPLATE.limits,
        metadata={
            "suite": "parsers",
            "team": "parsers",  # the session's metadata wins over the template's
            "session_id": "run-a",
            "model": "gpt-4o",
            "openai.finish_reason": "stop",
            "trace.format": "openai-log",
            "trace.outcome": "failure",
            "trace.score": None,
            "trace.messages": 7,
            "trace.truncated": False,
            "trace.template": "repo-fix",
        },
        source=Source(kind="trace", ref="log.jsonl:4", trace_id="run-a", from_turn=1),
    )
    assert task == expected
    assert task.prompt is None
    assert task.id.startswith("trace:") and len(task.id) == len("trace:") + 16
    assert result.report.tasks == 1 and result.report.failed == 1 and result.report.skipped == []


@pytest.mark.parametrize(
    ("at", "turns"),
    [("first", [0]), ("last", [2]), ("every", [0, 1, 2])],
)
def test_at_first_last_every(at, turns):
    result = tasks_from_sessions([run_a()], template=TEMPLATE, at=at)
    assert [t.source.from_turn for t in result.tasks if t.source] == turns
    assert [len(t.messages or []) for t in result.tasks] == [{0: 2, 1: 4, 2: 6}[n] for n in turns]


def test_at_last_continues_a_run_cut_after_a_tool_result():
    (crashed,) = read_sessions((FIXTURES / "mswea-crashed.traj.json").read_bytes(), "mini-swe-agent", "c").sessions
    (task,) = tasks_from_sessions([crashed], template=TEMPLATE, at="last").tasks
    assert task.source is not None and task.source.from_turn == 1
    assert task.messages == crashed.messages  # the model writes the reply the run never got to
    assert task.metadata["trace.truncated"] is True and task.metadata["trace.outcome"] is None


def test_harbor_template():
    template = load_template_harbor(str(HARBOR), build=False)  # building: tests/sandboxes/test_harbor_docker.py
    (task,) = tasks_from_sessions([run_a()], template=template).tasks
    assert (task.image, task.workdir, task.evaluator, task.limits, task.setup) == (
        template.image, template.workdir, template.evaluator, template.limits, template.setup)
    assert task.messages == run_a().messages[:2] and task.prompt is None
    assert task.metadata["trace.template"] == template.id
    with pytest.raises(TemplateError, match="cannot load the Harbor task"):
        load_template_harbor(str(HARBOR.parent / "missing"))


def test_template_from_task_file(tmp_path):
    f = tmp_path / "tasks.jsonl"
    other = msgspec.structs.replace(TEMPLATE, id="other")
    dump_tasks_jsonl([TEMPLATE, other], f)
    assert load_template(f"{f}:other").id == "other"
    with pytest.raises(TemplateError, match="holds 2 valid tasks"):
        load_template(str(f))
    with pytest.raises(TemplateError, match="no valid task 'nope'"):
        load_template(f"{f}:nope")
    one = tmp_path / "one.jsonl"
    dump_tasks_jsonl([TEMPLATE], one)
    loaded = load_template(str(one))
    assert msgspec.structs.replace(loaded, source=None) == TEMPLATE
    with pytest.raises(TemplateError, match="cannot read template file"):
        load_template(str(tmp_path / "none.jsonl"))


# --------------------------------------------------------------------------- failure filter


def session(sid: str, *, outcome=None, score=None, messages=None) -> Session:
    msgs = messages or [Message(role="user", content=f"task {sid}"), Message(role="assistant", content="done")]
    return Session(id=sid, format="fleetrl", ref=f"t:{sid}", messages=msgs, outcome=outcome, score=score)


def test_only_failed_uses_outcome_then_score_and_never_guesses():
    sessions = [
        session("f", outcome="failure"),
        session("ok", outcome="success", score=0.0),  # the outcome decides
        session("low", score=0.4),
        session("high", score=0.9),
        session("none"),
        session("nouser", outcome="failure", messages=[Message(role="system", content="s")]),
    ]
    result = tasks_from_sessions(sessions, template=TEMPLATE, only_failed=True, fail_below=0.5)
    assert [t.source.trace_id for t in result.tasks if t.source] == ["f", "low"]
    r = result.report
    assert (r.sessions, r.tasks, r.failed, r.succeeded, r.unknown, r.filtered_out) == (6, 2, 2, 0, 0, 2)
    assert r.skipped == [
        SkippedSession(ref="t:none", session_id="none", field="outcome", reason=r.skipped[0].reason),
        SkippedSession(ref="t:nouser", session_id="nouser", field="messages",
                       reason="no user message: there is no request to start from"),
    ]
    assert "not guessed" in r.skipped[0].reason
    everything = tasks_from_sessions(sessions, template=TEMPLATE)
    assert everything.report.unknown == 1 and everything.report.tasks == 5
    assert "1 skipped" in everything.report.render()


def test_valid_records_beside_malformed_ones_still_become_tasks():
    text = LOG.read_text(encoding="utf-8").splitlines()[:8]
    text.insert(3, '{"request": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}}')
    read = read_sessions(("\n".join(text) + "\n").encode(), "openai-log", "log.jsonl")
    assert [(p.where, p.field) for p in read.problems] == [("log.jsonl:4", "request.messages[0].content[0]")]
    result = tasks_from_sessions(read.sessions, template=TEMPLATE)
    assert len(result.tasks) == 5 and result.report.skipped == []


# --------------------------------------------------------------------------- dedupe and ids


def test_duplicates_collapse_by_cut_conversation_and_across_calls():
    reads = [read_sessions(p.read_bytes(), "mini-swe-agent", p.name) for p in MSWEA]
    sessions = [s for r in reads for s in r.sessions]
    assert len(sessions) == 4
    seen: set[str] = set()
    first = tasks_from_sessions(sessions, template=TEMPLATE, seen=seen)
    # error and crashed ran the same request: one task at turn 0
    assert (first.report.tasks, first.report.duplicates) == (3, 1)
    assert len({t.id for t in first.tasks}) == 3 and len(seen) == 3
    again = tasks_from_sessions(sessions, template=TEMPLATE, seen=seen)
    assert (again.report.tasks, again.report.duplicates) == (0, 4)
    fresh = tasks_from_sessions(list(reversed(sessions)), template=TEMPLATE)
    assert {t.id for t in fresh.tasks} == {t.id for t in first.tasks}  # ids do not depend on order
    other = tasks_from_sessions(sessions, template=msgspec.structs.replace(TEMPLATE, id="another"))
    assert {t.id for t in other.tasks}.isdisjoint(t.id for t in first.tasks)  # ... but on the template


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="from_turn"):
        tasks_from_sessions([], template=TEMPLATE, from_turn=-1)
    with pytest.raises(ValueError, match="not both"):
        tasks_from_sessions([], template=TEMPLATE, from_turn=1, at="last")
    with pytest.raises(ValueError, match="fail_below"):
        tasks_from_sessions([], template=TEMPLATE, fail_below=float("inf"))


ROLES = st.lists(st.sampled_from(["system", "user", "assistant", "tool"]), max_size=9)


def make_session(roles: list[str], sid: str) -> Session:
    msgs = [Message(role=r, content=f"{r}{i}") for i, r in enumerate(roles)]  # type: ignore[arg-type]
    return Session(id=sid, format="fleetrl", ref=f"r:{sid}", messages=msgs, outcome="failure")


@settings(max_examples=150, deadline=None, derandomize=True)
@given(roles=ROLES, at=st.sampled_from(["first", "last", "every"]), from_turn=st.none() | st.integers(0, 4))
def test_cuts_end_before_an_assistant_reply_and_ids_are_stable(roles, at, from_turn):
    if from_turn is not None:
        at = "first"
    s = make_session(roles, "a")
    result = tasks_from_sessions([s], template=TEMPLATE, at=at, from_turn=from_turn)
    r = result.report
    assert r.sessions == 1 and len(r.skipped) + (1 if result.tasks else 0) >= 1
    for task in result.tasks:
        cut = task.messages or []
        assert cut == s.messages[: len(cut)]  # a prefix of the recording
        assert "user" in [m.role for m in cut]
        # it ends where the model has to reply: before an assistant message or at the end
        if len(cut) < len(s.messages):
            assert s.messages[len(cut)].role == "assistant"
        else:
            assert cut[-1].role != "assistant"  # the whole recording: it awaits a reply
    again = tasks_from_sessions([make_session(roles, "b")], template=TEMPLATE, at=at, from_turn=from_turn)
    assert [t.id for t in again.tasks] == [t.id for t in result.tasks]  # the id is the content's
    assert len({t.id for t in result.tasks}) == len(result.tasks)


# --------------------------------------------------------------------------- CLI


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fleetrl")
    sub = parser.add_subparsers(dest="command")
    register_traces(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_mini_swe_agent_files_on_a_template(tmp_path, capsys):
    tpl = tmp_path / "tpl.jsonl"
    dump_tasks_jsonl([TEMPLATE], tpl)
    bad = tmp_path / "bad.traj.json"
    bad.write_text('{"messages": [], "info": {"exit_status": "Subm')
    out = tmp_path / "tasks.jsonl"
    argv = ["traces", "import", *map(str, MSWEA), str(bad), "--format", "mini-swe-agent",
            "--template", f"{tpl}:repo-fix", "--only-failed", "--out", str(out)]
    assert run(argv) == 1  # bad.traj.json is unusable and the crashed run has no outcome
    text = capsys.readouterr().out
    assert f"unusable {bad}: invalid JSON" in text
    assert "(session 'mswea-crashed'): outcome:" in text
    tasks = load_tasks_jsonl(out).tasks
    assert sorted(t.source.trace_id for t in tasks if t.source) == ["mswea-error", "mswea-limits"]
    assert all(t.image == "corp/agent-env:7" for t in tasks)

    assert run([*argv[:-2], "--json", "--out", str(out)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [i["format"] for i in doc["inputs"]] == ["mini-swe-agent"] * 5
    assert (doc["tasks"], doc["filtered_out"], len(doc["problems"]), len(doc["skipped"])) == (2, 1, 1, 1)


def test_cli_auto_request_log_with_harbor_template(tmp_path, capsys):
    out = tmp_path / "tasks.jsonl"
    argv = ["traces", "import", str(LOG), "--format", "auto", "--template-harbor", str(HARBOR), "--no-build",
            "--at", "last", "--out", str(out)]
    assert run(argv) == 1  # the last line of the log was cut mid-write
    text = capsys.readouterr().out
    assert f"{LOG}: openai-log: 5 sessions, 1 unusable records, 2 request lines folded" in text
    assert [t.source.trace_id for t in load_tasks_jsonl(out).tasks if t.source] == [
        "chatcmpl-b1", "run-a", "chatcmpl-c1", "chatcmpl-d1", "chatcmpl-e1"]


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--format", "openai-log"], "needs --template"),
        (["--format", "openai-log", "--template", "TPL", "--at", "last", "--from-turn", "1"], "not both"),
        (["--format", "openai-log", "--template", "NOPE"], "cannot read template file"),
        (["--template", "TPL", "--template-harbor", "x"], None),
        (["--at", "last"], "needs --template"),
        (["SECOND"], "takes one file"),  # our own format, two files, no template
        (["--format", "openai-log", "--template", "TPL", "--fail-below", "nan"], "fail_below"),
    ],
)
def test_cli_usage_errors(tmp_path, capsys, extra, fragment):
    tpl = tmp_path / "tpl.jsonl"
    dump_tasks_jsonl([TEMPLATE], tpl)
    extra = [str(tpl) if a == "TPL" else str(tmp_path / "nope.jsonl") if a == "NOPE" else a for a in extra]
    out = tmp_path / "o.jsonl"
    if fragment is None:  # mutually exclusive options: argparse exits 2
        with pytest.raises(SystemExit) as exc:
            run(["traces", "import", str(LOG), "--out", str(out), *extra])
        assert exc.value.code == 2
        return
    files = [str(LOG), str(LOG)] if extra == ["SECOND"] else [str(LOG)]
    extra = [] if extra == ["SECOND"] else extra
    assert run(["traces", "import", *files, "--out", str(out), *extra]) == 2
    assert fragment in capsys.readouterr().err
    assert not out.exists()


def test_atif_goes_to_its_reader():
    doc = b'{"schema_version": "ATIF-v1.4", "session_id": "s", "agent": {"name": "a"}, "steps": []}'
    read = read_sessions(doc, "auto", "s.json")
    assert read.format == "atif"
    assert read.sessions or read.problems  # whatever the ATIF reader makes of it, it says so


def test_worked_example_in_docs_is_what_the_code_does(tmp_path):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "traces.md").read_text(encoding="utf-8")
    (template_block,) = [b for b in re.findall(r"```json\n(.*?)```", doc, re.DOTALL) if b.startswith('{"id": "parser-fix"')]
    tpl = tmp_path / "templates.jsonl"
    tpl.write_text(" ".join(template_block.split("\n")) + "\n", encoding="utf-8")
    lines = LOG.read_text(encoding="utf-8").splitlines()
    proxy = ("\n".join([lines[0], lines[1], lines[3]]) + "\n").encode()
    read = read_sessions(proxy, "auto", "proxy.jsonl")
    assert (read.format, read.merged, len(read.sessions)) == ("openai-log", 2, 1)
    result = tasks_from_sessions(read.sessions, template=load_template(f"{tpl}:parser-fix"), from_turn=1,
                                 only_failed=True)
    (task,) = result.tasks
    assert f'"id": "{task.id}"' in doc
    assert task.source == Source(kind="trace", ref="proxy.jsonl:3", trace_id="run-a", from_turn=1)
    assert [m.role for m in task.messages or []] == ["system", "user", "assistant", "tool"]


def test_cli_refuses_to_write_over_an_input_with_a_template(tmp_path, capsys):
    tpl = tmp_path / "tpl.jsonl"
    dump_tasks_jsonl([TEMPLATE], tpl)
    log = tmp_path / "log.jsonl"
    log.write_bytes(LOG.read_bytes())
    argv = ["traces", "import", str(LOG), str(log), "--format", "openai-log", "--template", str(tpl),
            "--out", str(log)]
    assert run(argv) == 2
    assert "--out must not be the input file" in capsys.readouterr().err
    assert log.read_bytes() == LOG.read_bytes()  # the input is untouched

"""`tasks check`, `tasks humaneval` and `traces import` through register() on a real
argparse parser (as the fleetrl CLI mounts them) and once as a subprocess."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from fleetrl.harness.cli import main, register_tasks, register_traces
from fleetrl.harness.tasks import load_tasks_jsonl

GOOD = {"id": "a", "prompt": "p", "evaluator": {"command": "true"}}


def run(argv: list[str]) -> int:
    """Mount the groups the way daemon/cli.py does (one entry point each) and run."""
    parser = argparse.ArgumentParser(prog="fleetrl")
    sub = parser.add_subparsers(dest="command")
    register_tasks(sub)
    register_traces(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


def session(i: int, outcome: str) -> dict:
    return {
        "id": f"s{i}",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": f"task {i}"}, {"role": "assistant", "content": "x"}],
        "outcome": outcome,
        "workspace": {"files": {"a.txt": "1"}, "setup": ["true"]},
        "eval": {"command": "test -f done"},
    }


def test_tasks_check_all_valid(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "id": "b"}) + "\n")
    assert run(["tasks", "check", str(f)]) == 0
    assert capsys.readouterr().out == f"{f}: 2 records: 2 valid, 0 invalid\n"


def test_tasks_check_lists_invalid_records(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text(
        "\n".join([json.dumps(GOOD), "nope", json.dumps({**GOOD, "id": "c", "limits": {"max_turns": 0}})]) + "\n"
    )
    assert run(["tasks", "check", str(f)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{f}: 3 records: 1 valid, 2 invalid"
    assert out[1].startswith(f"  {f}:2: invalid JSON")
    assert out[2].startswith(f"  {f}:3: limits.max_turns: ")

    assert run(["tasks", "check", "--json", str(f)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["valid"], doc["invalid"]) == (1, 2)
    assert [(e["line"], e["field"]) for e in doc["errors"]] == [(2, ""), (3, "limits.max_turns")]


def test_tasks_check_empty_and_missing_files(tmp_path, capsys):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    assert run(["tasks", "check", str(empty)]) == 1
    assert "holds no task" in capsys.readouterr().out
    assert run(["tasks", "check", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_tasks_humaneval_export(tmp_path, capsys):
    out = tmp_path / "he.jsonl"
    assert run(["tasks", "humaneval", "--out", str(out), "--ids", "HumanEval/0,HumanEval/5"]) == 0
    assert [t.id for t in load_tasks_jsonl(out).tasks] == ["HumanEval/0", "HumanEval/5"]
    assert run(["tasks", "humaneval", "--out", str(out), "--ids", "HumanEval/0,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_traces_import_writes_tasks_and_reports_skips(tmp_path, capsys):
    src = tmp_path / "traces.jsonl"
    src.write_text("\n".join([json.dumps(session(1, "failure")), json.dumps(session(2, "success")), "{oops"]) + "\n")
    out = tmp_path / "tasks.jsonl"
    out.write_text("stale\n")

    assert run(["traces", "import", str(src), "--out", str(out)]) == 1  # line 3 was skipped
    text = capsys.readouterr().out
    assert f"{src}: read 3 sessions: 2 tasks (1 from failed, 1 from successful sessions)" in text
    assert f"skipped {src}:3: invalid JSON" in text
    assert f"wrote 2 tasks to {out}" in text
    report = load_tasks_jsonl(out)
    assert [t.id for t in report.tasks] == ["trace:s1", "trace:s2"] and report.errors == []
    assert report.tasks[0].source is not None and report.tasks[0].source.ref == f"{src}:1"

    assert run(["traces", "import", str(src), "--only-failed", "--json", "--out", str(out)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (doc["tasks"], doc["filtered_out"], doc["sessions_read"]) == (1, 1, 3)
    assert doc["skipped"][0]["line"] == 3
    assert [t.id for t in load_tasks_jsonl(out).tasks] == ["trace:s1"]


def test_traces_import_all_usable_exits_zero(tmp_path, capsys):
    src = tmp_path / "traces.jsonl"
    src.write_text(json.dumps(session(1, "failure")) + "\n")
    out = tmp_path / "tasks.jsonl"
    assert run(["traces", "import", str(src), "--from-turn", "0", "--out", str(out)]) == 0
    assert len(load_tasks_jsonl(out).tasks) == 1


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [(["--from-turn", "-1"], "--from-turn must be >= 0"), (["--fail-below", "nan"], "fail_below")],
)
def test_traces_import_bad_arguments(tmp_path, capsys, extra, fragment):
    src = tmp_path / "traces.jsonl"
    src.write_text(json.dumps(session(1, "failure")) + "\n")
    out = tmp_path / "tasks.jsonl"
    assert run(["traces", "import", str(src), "--out", str(out), *extra]) == 2
    assert fragment in capsys.readouterr().err
    assert not out.exists()


def test_traces_import_refuses_to_overwrite_its_input_and_missing_input(tmp_path, capsys):
    src = tmp_path / "traces.jsonl"
    src.write_text(json.dumps(session(1, "failure")) + "\n")
    assert run(["traces", "import", str(src), "--out", str(src)]) == 2
    assert "--out must not be the input file" in capsys.readouterr().err
    assert json.loads(src.read_text())["id"] == "s1"
    assert run(["traces", "import", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_group_without_subcommand_prints_help(capsys):
    assert run(["traces"]) == 2
    assert "import" in capsys.readouterr().out
    assert main([]) == 2


def test_module_main_runs_as_a_process(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(GOOD) + "\n{bad\n")
    proc = subprocess.run(
        [sys.executable, "-m", "fleetrl.harness.cli", "tasks", "check", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines()[0] == f"{f}: 2 records: 1 valid, 1 invalid"

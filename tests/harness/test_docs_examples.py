"""The examples in docs/guides/tasks.md are valid: the task line loads, the trace line imports."""

from __future__ import annotations

import re
from pathlib import Path

from fleetrl.harness.tasks import decode_task_json
from fleetrl.harness.traces import tasks_from_traces

DOC = Path(__file__).resolve().parents[2] / "docs" / "guides" / "tasks.md"


def json_blocks() -> list[str]:
    return re.findall(r"```json\n(.*?)```", DOC.read_text(), re.DOTALL)


def test_task_example_is_valid():
    task_example, _ = json_blocks()
    task = decode_task_json(task_example.strip(), where="docs/guides/tasks.md")
    assert task.id == "fix-off-by-one"
    assert set(task.setup.files) == {"count.py", "test_count.py"}


def test_trace_example_imports():
    _, trace_example = json_blocks()
    line = " ".join(trace_example.split("\n"))  # the doc wraps the session for reading
    result = tasks_from_traces([line], file="docs", only_failed=True)
    assert result.report.skipped == []
    (task,) = result.tasks
    assert task.id == "trace:sess-8812"
    assert [m.role for m in task.messages or []] == ["system", "user"]
    assert task.limits.max_turns == 20 and task.image == "corp/agent-env:7"

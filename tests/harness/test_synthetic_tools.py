"""The tool-lookup family (`fleetrl.harness.synthetic_tools`): deterministic tasks, the
fresh split never asks a training question, the tool's answers, the evaluator command
agrees with `answer_reward`, the worker's task source by name."""

from __future__ import annotations

import json
import subprocess

import msgspec
import pytest

from fleetrl.actors.envworker.config import EnvWorkerConfig
from fleetrl.actors.envworker.sources import open_task_source
from fleetrl.harness.synthetic_tools import (
    ANSWER_FILE,
    answer_reward,
    generate_tool_tasks,
    is_tool_eval_reserved,
    make_tool_task,
    read_error,
    reference_messages,
    run_tool,
    tool_task_stream,
)
from fleetrl.harness.tasks import decode_task_json, encode_task_json


def test_tasks_are_deterministic_and_resumable():
    assert generate_tool_tasks(5, split="train", seed=3) == generate_tool_tasks(5, split="train", seed=3)
    stream = tool_task_stream(3, start=2)
    assert [next(stream) for _ in range(3)] == generate_tool_tasks(3, split="train", seed=3, start=2)
    assert stream.cursor == 5
    task = make_tool_task(0, "fresh", 7)
    assert decode_task_json(encode_task_json(task), where="t") == task  # a valid task in the task format


def test_fresh_never_asks_a_training_question():
    train = generate_tool_tasks(400, split="train", seed=0)
    fresh = generate_tool_tasks(200, split="fresh", seed=1)
    key = lambda t: (t.metadata["path"], t.metadata["code"])  # noqa: E731
    assert not {key(t) for t in train} & {key(t) for t in fresh}
    assert all(is_tool_eval_reserved(*key(t)) for t in fresh) and not any(is_tool_eval_reserved(*key(t)) for t in train)
    assert len({key(t) for t in fresh}) >= 20 and len({key(t) for t in train}) >= 150  # every pair of its share


def test_the_answer_is_only_in_the_sandbox_file():
    task = make_tool_task(0, "train", 0)
    path, code = task.metadata["path"], task.metadata["code"]
    assert task.setup.files == {path: code} and code not in task.prompt and path in task.prompt
    assert task.limits.max_turns >= 2  # a call and an answer


def test_run_tool_reads_the_tasks_files_as_the_harness_does():
    task = make_tool_task(0, "train", 0)
    path, code = task.metadata["path"], task.metadata["code"]
    for spelled in (path, f"./{path}", f"/work/{path}"):
        assert run_tool(task, "read_file", json.dumps({"path": spelled})) == code
    assert run_tool(task, "read_file", '{"path": "x.txt"}') == read_error("x.txt") == "error: cannot read x.txt"
    assert run_tool(task, "read_file", "{") == "error: arguments are not JSON"
    assert run_tool(task, "read_file", "{}") == "error: read_file needs a path"
    assert run_tool(task, "write_file", "{}") == "error: unknown tool write_file"


def test_reference_conversation_reads_then_answers():
    task = make_tool_task(0, "train", 4)
    user, call, result, answer = reference_messages(task)
    assert user == {"role": "user", "content": task.prompt}
    (tc,) = call["tool_calls"]
    assert tc["function"] == {"name": "read_file", "arguments": json.dumps({"path": task.metadata["path"]})}
    assert result == {"role": "tool", "tool_call_id": tc["id"], "content": task.metadata["code"]}
    assert answer == {"role": "assistant", "content": task.metadata["code"]}


@pytest.mark.parametrize("written", [None, "", "Q", " Q ", "QQ", "Q\n", "q"])
def test_the_evaluator_command_agrees_with_answer_reward(tmp_path, written):
    task = make_tool_task(0, "train", 0)
    task = msgspec.structs.replace(task, evaluator=msgspec.structs.replace(
        task.evaluator, command=task.evaluator.command.replace(task.metadata["code"], "Q")),
        metadata={**task.metadata, "code": "Q"})
    if written is not None:  # the harness writes the stripped answer
        (tmp_path / ANSWER_FILE).write_text(written.strip())
    code = subprocess.run(["sh", "-c", task.evaluator.command], cwd=tmp_path, check=False).returncode
    assert (1.0 if code == 0 else 0.0) == answer_reward(task, written)


def test_worker_config_names_the_family():
    cfg = msgspec.convert({"tasks": {"kind": "tool_lookup", "seed": 2}, "model": {
        "kind": "local", "model_dir": "m"}}, EnvWorkerConfig)
    source = open_task_source(cfg.tasks, None)
    assert source.get(5) == make_tool_task(2, "train", 5) and source.describe == "tool_lookup(seed=2)"

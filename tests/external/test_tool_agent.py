"""examples/harnesses/tool_agent.py, the example tool-calling harness, run unchanged as
an external command against a scripted OpenAI server of this test (Starlette on
127.0.0.1: it answers with the ``tool_calls`` it is given, as an endpoint that supports
tools does) and acting in a real Docker sandbox prepared with a tool-lookup task.

Checked: the official client sends ``tools``; each tool call runs in the sandbox and its
result comes back as a ``tool`` message after the assistant message that made it; the
final answer lands in ``answer.txt`` and the task's evaluator scores it; a wrong path
reads an error; the turn limit ends a loop of tool calls with no answer (reward 0)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import trio
from fakes import serving
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fleetrl.harness.external import ExternalCommand, ExternalHarness, run_attempt
from fleetrl.harness.openai_api import AttemptRegistry
from fleetrl.harness.synthetic_tools import READ_FILE_TOOL, make_tool_task

AGENT = Path(__file__).resolve().parents[2] / "examples" / "harnesses" / "tool_agent.py"


def _load_agent():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tool_agent", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_agents_read_file_tool_is_the_task_familys():
    assert _load_agent().READ_FILE == READ_FILE_TOOL


class ScriptedServer:
    """Answers each chat call with the next scripted reply: a str is a final answer, a
    list of (name, arguments) pairs is a tool-call answer. Keeps every request body."""

    def __init__(self, replies) -> None:
        self.replies = list(replies)
        self.requests: list[dict] = []

    async def chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        reply = self.replies[min(len(self.requests), len(self.replies)) - 1]
        if isinstance(reply, str):
            message, finish = {"role": "assistant", "content": reply}, "stop"
        else:
            n = len(self.requests)
            message = {"role": "assistant", "content": None, "tool_calls": [
                {"id": f"call_{n}_{i}", "type": "function", "function": {"name": name, "arguments": args}}
                for i, (name, args) in enumerate(reply)]}
            finish = "tool_calls"
        return JSONResponse({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                             "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])


async def _run(tok, sandbox_factory, task, replies, *args):
    server = ScriptedServer(replies)
    with trio.fail_after(90):
        async with serving(server.app()) as base, sandbox_factory() as sb:
            harness = ExternalHarness(ExternalCommand(argv=(sys.executable, str(AGENT), *args), timeout_s=60),
                                      registry=AttemptRegistry(tok), base_url=base, model_name="tiny")
            result = await run_attempt(harness, task, sb)
            answer = await sb.exec(["cat", "answer.txt"])
    assert result.episode.exit_code == 0, result.episode.stderr_tail.decode()
    return result, server.requests, answer



@pytest.mark.docker
async def test_tool_call_then_answer_is_scored_by_the_tasks_evaluator(tok, sandbox_factory):
    task = make_tool_task(0, "train", 0)
    path, code = task.metadata["path"], task.metadata["code"]
    result, requests, answer = await _run(tok, sandbox_factory, task,
                                          [[("read_file", json.dumps({"path": path}))], f" {code}\n"])
    assert result.reward == 1.0 and answer.stdout.decode() == code
    first, second = requests
    assert first["tools"] == [READ_FILE_TOOL] and second["tools"] == [READ_FILE_TOOL]
    assert first["messages"] == [{"role": "user", "content": task.prompt}]
    assert first["max_tokens"] == 96 and first["temperature"] == 1.0
    user, assistant, tool = second["messages"]
    assert assistant["role"] == "assistant" and assistant["tool_calls"] == [
        {"id": "call_1_0", "type": "function", "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}]
    assert tool == {"role": "tool", "tool_call_id": "call_1_0", "content": code}  # read in the sandbox


@pytest.mark.docker
async def test_a_wrong_path_reads_an_error_and_the_turn_limit_ends_the_loop(tok, sandbox_factory):
    task = make_tool_task(0, "train", 1)
    loop = [[("read_file", '{"path": "nope.txt"}'), ("run", '{"command": "id -u; pwd"}')]]
    result, requests, answer = await _run(tok, sandbox_factory, task, loop, "--tools", "read_file,run")
    assert len(requests) == 3  # FLEETRL_MAX_TURNS = the task's limits.max_turns
    assert result.reward == 0.0 and answer.exit_code != 0  # no answer written
    assert [t["name"] for t in (x["function"] for x in requests[0]["tools"])] == ["read_file", "run"]
    _, _, read, run = requests[1]["messages"]
    assert read["content"] == "error: cannot read nope.txt"
    assert run["content"] == "1000\n/work\n"  # the sandbox user, in the work dir

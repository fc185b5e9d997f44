"""Tasks to and from JSON: one record, and JSONL files of them.

`parse_task` validates a decoded record, `decode_task_json` / `encode_task_json` are
one line of JSON, `load_tasks_jsonl` / `dump_tasks_jsonl` a whole file. Every
problem is a `TaskError` naming the record (``file:line``, ...) and the dotted path of
the field at fault (`field_path_of` reads it from msgspec's error). Loading a file
never stops at the first bad record: every invalid record is reported with its file,
line and field path, and every valid one is kept.

Pure apart from ``load_tasks_jsonl`` / ``dump_tasks_jsonl``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import msgspec

from fleetrl.daemon.files import write_atomic

from .errors import FieldProblem, TaskError
from .task_schema import Source, Task
from .trace_messages import json_kind

__all__ = [
    "LoadReport",
    "RecordError",
    "decode_task_json",
    "dump_tasks_jsonl",
    "encode_task_json",
    "field_path_of",
    "load_tasks_jsonl",
    "parse_task",
    "validate_task",
]

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
    a ``__post_init__`` named through ``FieldProblem``.
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
    if isinstance(cause, FieldProblem):
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
        raise TaskError(f"a task record must be a JSON object, got {json_kind(obj)}", where=where)
    return parse_task(obj, where=where)


_ENCODER = msgspec.json.Encoder()


def encode_task_json(task: Task) -> bytes:
    """One task as a single line of JSON (no trailing newline), every field written
    so that the file does not depend on this version's defaults."""
    return _ENCODER.encode(task)


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
    its place. A UTF-8 byte-order mark at the start of the file is ignored. A task
    without ``source`` gets ``Source(kind="user", ref="file:line")``.
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

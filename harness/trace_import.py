"""Recorded sessions of any format -> tasks, on the workspace and grader of a template.

`read_sessions` reads one input in a named format (or sniffs it: ``"auto"``) into a
`SessionRead`. `tasks_from_sessions` turns sessions into tasks: the image, workdir,
setup, evaluator and limits are the template task's (a recorded session says nothing of
the sandbox or the grader); the template's prompt is replaced by the session's
conversation cut at one assistant turn (`traces.turn_prefix`):

* ``from_turn=N``: before the session's (N+1)-th assistant reply (0: the user's
  original request);
* ``at="first"`` (the default): turn 0;
* ``at="last"``: the last point where the model had to reply: before its final reply
  when the session ends with one (redo it), else after the last recorded message (a run
  cut after a tool result continues from there);
* ``at="every"``: one task per turn, from turn 0 to ``"last"``.

The actions of the prefix are not replayed: the sandbox starts from the template's
state. With ``only_failed``, a session counts as failed by its ``outcome``, else by its
``score`` (``< fail_below``); a session with neither is skipped with the reason, never
guessed. Cuts with the same conversation on the same template are one task: the id is
``trace:`` + 16 hex digits of a SHA-256 of the template id and the cut conversation, so
it is stable across runs, and ``seen`` carries the hashes across calls.

Pure apart from `load_template` / `load_template_harbor`, which read the template.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec

from .errors import HarnessError, TaskError
from .task_codec import load_tasks_jsonl, validate_task
from .task_schema import MetadataValue, Source, Task
from .trace_formats import read_fleetrl_traces, read_mini_swe_agent, read_openai_log
from .trace_messages import decode_json
from .trace_sessions import Session, SessionProblem, SessionRead
from .traces import _Skip as _SkipSession  # a session that makes no task: field and why
from .traces import turn_prefix

__all__ = [
    "FORMATS",
    "At",
    "SessionImport",
    "SessionImportReport",
    "SkippedSession",
    "TemplateError",
    "load_template",
    "load_template_harbor",
    "read_sessions",
    "sniff_format",
    "tasks_from_sessions",
]

FORMATS = ("fleetrl", "atif", "mini-swe-agent", "openai-log", "auto")
At = Literal["first", "last", "every"]
_ENCODER = msgspec.json.Encoder()


class TemplateError(HarnessError, ValueError):
    """The template task cannot be had: the file or directory, and why."""


# --------------------------------------------------------------------------- reading


def sniff_format(data: bytes) -> str | None:
    """The format of ``data`` judged from its first JSON value, or None.

    A whole-file JSON object is ATIF (``schema_version`` ``ATIF-...``, or ``steps``) or a
    mini-swe-agent trajectory (``messages`` with ``info`` or ``trajectory_format``);
    otherwise the first line that parses decides: a request log line (``request``,
    ``body``, ``request_body``, ``response_body``) or one of our trace lines
    (``id`` and ``messages``)."""
    data = data.removeprefix(b"\xef\xbb\xbf")
    try:
        whole = decode_json(data)
    except HarnessError:
        whole = None
    if isinstance(whole, dict):
        version = whole.get("schema_version")
        if (isinstance(version, str) and version.upper().startswith("ATIF")) or "steps" in whole:
            return "atif"
        if "messages" in whole and ("info" in whole or "trajectory_format" in whole):
            return "mini-swe-agent"
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = decode_json(raw)
        except HarnessError:
            continue
        if not isinstance(obj, dict):
            continue
        if {"request", "body", "request_body", "response_body"} & obj.keys():
            return "openai-log"
        if "messages" in obj and "id" in obj:
            return "fleetrl"
        if "schema_version" in obj or "steps" in obj:
            return "atif"
        return None
    return None


def _read_atif(data: bytes, where: str) -> SessionRead:
    try:
        from .atif import read_atif  # imported only when asked for
    except ModuleNotFoundError as err:
        if err.name != f"{__package__}.atif":
            raise
        return SessionRead(sessions=[], problems=[SessionProblem(
            where=where, field="", reason="this fleetrl has no ATIF reader (fleetrl.harness.atif)")], format="atif")
    return read_atif(data, where)


_READERS = {
    "fleetrl": read_fleetrl_traces,
    "atif": _read_atif,
    "mini-swe-agent": read_mini_swe_agent,
    "openai-log": read_openai_log,
}


def read_sessions(data: bytes, fmt: str, where: str) -> SessionRead:
    """The sessions of one input (its bytes; ``where`` names it, it is not opened) read
    as ``fmt``: one of `FORMATS`. ``"auto"`` sniffs the format (`sniff_format`) and
    says which in ``SessionRead.format``; when it cannot tell, the input is one problem.
    Raises ``ValueError`` for an unknown ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r} (expected one of {', '.join(FORMATS)})")
    if fmt == "auto":
        sniffed = sniff_format(data)
        if sniffed is None:
            return SessionRead(sessions=[], problems=[SessionProblem(
                where=where, field="", reason="cannot tell the format (no JSON object of a known format); "
                                              "name it with --format")])
        fmt = sniffed
    read = _READERS[fmt](data, where)
    return read if read.format == fmt else msgspec.structs.replace(read, format=fmt)


# --------------------------------------------------------------------------- report


class SkippedSession(msgspec.Struct, frozen=True, kw_only=True):
    """A session (or one cut of it) that made no task: where it was read, its id, the
    field at fault (``"messages"``, ``"outcome"``, a task field) and why."""

    ref: str
    session_id: str
    field: str
    reason: str

    def render(self) -> str:
        what = f"{self.field}: {self.reason}" if self.field else self.reason
        return f"{self.ref} (session {self.session_id!r}): {what}"


class SessionImportReport(msgspec.Struct, frozen=True, kw_only=True):
    """What `tasks_from_sessions` did. Each session is exactly one of: used (it made
    ``tasks`` / ``duplicates``, counted in ``failed`` / ``succeeded`` / ``unknown`` by how
    it went), ``filtered_out`` (successful, with ``only_failed``) or ``skipped``
    (with ``at="every"``, a session may be both used and skipped for some turn)."""

    sessions: int
    tasks: int
    duplicates: int
    failed: int
    succeeded: int
    unknown: int
    filtered_out: int
    skipped: list[SkippedSession]
    template: str
    cut: str
    only_failed: bool
    fail_below: float

    def render(self) -> str:
        """One summary line, then every skipped session."""
        head = (
            f"read {self.sessions} sessions: {self.tasks} tasks on template {self.template!r} at {self.cut} "
            f"(sessions used: {self.failed} failed, {self.succeeded} successful, {self.unknown} without outcome), "
            f"{self.duplicates} duplicate cuts collapsed, {self.filtered_out} successful sessions left out "
            f"(--only-failed), {len(self.skipped)} skipped"
        )
        return "\n".join([head, *(f"  skipped {s.render()}" for s in self.skipped)])


class SessionImport(msgspec.Struct, frozen=True, kw_only=True):
    tasks: list[Task]
    report: SessionImportReport


# --------------------------------------------------------------------------- conversion


def _failed(session: Session, fail_below: float) -> bool | None:
    if session.outcome is not None:
        return session.outcome == "failure"
    if session.score is None:
        return None
    if not math.isfinite(session.score):
        raise _SkipSession("score", "must be a finite number")
    return session.score < fail_below


def _turns(roles: list[str], from_turn: int | None, at: At) -> list[int]:
    """The turns to cut ``roles`` at; raises `_SkipSession` when there is no request."""
    if "user" not in roles:
        raise _SkipSession("messages", "no user message: there is no request to start from")
    if from_turn is not None:
        return [from_turn]
    if at == "first":
        return [0]
    first_user = roles.index("user")
    n = sum(1 for r in roles[first_user + 1:] if r == "assistant")
    last = n - 1 if roles[-1] == "assistant" else n
    last = max(last, 0)
    return [last] if at == "last" else list(range(last + 1))


def _cut_digest(template_id: str, messages: list) -> str:
    h = hashlib.sha256(template_id.encode() + b"\x00")
    for m in messages:
        h.update(_ENCODER.encode(m) + b"\n")
    return h.hexdigest()


def _task(session: Session, template: Task, turn: int, cut: list, digest: str, failed: bool | None) -> Task:
    metadata: dict[str, MetadataValue] = {**template.metadata, **session.metadata}
    metadata.update({
        "trace.format": session.format,
        "trace.outcome": None if failed is None else ("failure" if failed else "success"),
        "trace.score": session.score,
        "trace.messages": len(session.messages),
        "trace.truncated": session.truncated,
        "trace.template": template.id,
    })
    task = msgspec.structs.replace(
        template,
        id=f"trace:{digest[:16]}",
        prompt=None,
        messages=cut,
        metadata=metadata,
        source=Source(kind="trace", ref=session.ref, trace_id=session.id, from_turn=turn),
    )
    return validate_task(task, where=session.ref)


def tasks_from_sessions(
    sessions: Iterable[Session],
    *,
    template: Task,
    from_turn: int | None = None,
    at: At = "first",
    only_failed: bool = False,
    fail_below: float = 1.0,
    seen: set[str] | None = None,
) -> SessionImport:
    """Tasks from ``sessions`` on ``template``'s workspace and grader (module docstring).

    ``from_turn`` (>= 0) picks one turn and excludes ``at`` other than ``"first"``.
    ``seen`` holds the full hex digests of cuts already made (by earlier calls); the
    digests of this call's tasks are added to it. Raises ``ValueError`` for bad
    arguments; every session problem is in the report.
    """
    if from_turn is not None and from_turn < 0:
        raise ValueError(f"from_turn must be >= 0, got {from_turn}")
    if from_turn is not None and at != "first":
        raise ValueError("give either from_turn or at, not both")
    if at not in ("first", "last", "every"):
        raise ValueError(f"at must be 'first', 'last' or 'every', got {at!r}")
    if not math.isfinite(fail_below):
        raise ValueError(f"fail_below must be a finite number, got {fail_below}")
    seen = set() if seen is None else seen
    tasks: list[Task] = []
    skipped: list[SkippedSession] = []
    n = dup = failed_n = ok_n = unknown_n = filtered = 0
    for session in sessions:
        n += 1
        try:
            failed = _failed(session, fail_below)
            if only_failed and failed is None:
                raise _SkipSession("outcome", "neither an outcome nor a score says how the session went "
                                              "(not guessed with --only-failed)")
            if only_failed and not failed:
                filtered += 1
                continue
            turns = _turns([m.role for m in session.messages], from_turn, at)
        except _SkipSession as skip:
            skipped.append(SkippedSession(ref=session.ref, session_id=session.id, field=skip.field, reason=skip.reason))
            continue
        used = False
        for turn in turns:
            try:
                end = turn_prefix([m.role for m in session.messages], turn)  # raises _SkipSession
                cut = session.messages[:end]
                digest = _cut_digest(template.id, cut)
                if digest in seen:
                    dup += 1
                    used = True
                    continue
                try:
                    task = _task(session, template, turn, cut, digest, failed)
                except TaskError as err:
                    raise _SkipSession(err.field, err.message) from None
            except _SkipSession as skip:
                skipped.append(SkippedSession(ref=session.ref, session_id=session.id, field=skip.field,
                                              reason=skip.reason))
                continue
            seen.add(digest)
            tasks.append(task)
            used = True
        if used:
            if failed is None:
                unknown_n += 1
            elif failed:
                failed_n += 1
            else:
                ok_n += 1
    cut_name = f"turn {from_turn}" if from_turn is not None else {"first": "turn 0", "last": "the last turn",
                                                                   "every": "every turn"}[at]
    report = SessionImportReport(
        sessions=n, tasks=len(tasks), duplicates=dup, failed=failed_n, succeeded=ok_n, unknown=unknown_n,
        filtered_out=filtered, skipped=skipped, template=template.id, cut=cut_name, only_failed=only_failed,
        fail_below=fail_below,
    )
    return SessionImport(tasks=tasks, report=report)


# --------------------------------------------------------------------------- templates (I/O)


def load_template(spec: str) -> Task:
    """The template task named ``FILE`` or ``FILE:ID`` (a task JSONL file; without an
    id the file must hold exactly one task). Raises `TemplateError`."""
    path, task_id = spec, None
    if not os.path.exists(spec) and ":" in spec:
        path, task_id = spec.rsplit(":", 1)
    try:
        loaded = load_tasks_jsonl(path)
    except OSError as err:
        raise TemplateError(f"cannot read template file {path}: {err.strerror or err}") from None
    if task_id is None:
        if len(loaded.tasks) != 1:
            ids = ", ".join(t.id for t in loaded.tasks[:5]) or "none"
            raise TemplateError(f"{path} holds {len(loaded.tasks)} valid tasks ({ids}); name one as {path}:ID")
        return loaded.tasks[0]
    for task in loaded.tasks:
        if task.id == task_id:
            return task
    bad = [str(e) for e in loaded.errors]
    raise TemplateError(f"{path} holds no valid task {task_id!r}" + (f" ({'; '.join(bad[:3])})" if bad else ""))


def load_template_harbor(path: str, image_map: Mapping[str, str] | None = None, *, build: bool = True) -> Task:
    """The template task of a Harbor task directory, its image built locally when
    `build` (`harbor_load.load_built_harbor_task`: the tasks made on it name an image
    that exists). `image_map`: FROM image -> local image, as ``tasks import-harbor
    --map-image``. Raises `TemplateError`."""
    from docker.errors import DockerException

    from fleetrl.sandboxes.errors import SandboxError

    from .harbor_load import load_built_harbor_task  # reads files, may build: only when asked for

    try:
        return load_built_harbor_task(path, image_map, build=build)[0]
    except (OSError, ValueError, HarnessError, SandboxError, DockerException) as err:
        raise TemplateError(f"cannot load the Harbor task {path}: {err}") from None

"""Trajectory files of other agents -> `Session` values (pure: bytes in, `SessionRead` out).

* `read_mini_swe_agent`: one ``*.traj.json`` file as mini-swe-agent's
  ``DefaultAgent.save`` writes it (``{"info": {...}, "messages": [...],
  "trajectory_format": "mini-swe-agent-1.1"}``); one file is one session.
* `read_openai_log`: OpenAI chat-completions request logs, one JSON object a line
  (`trace_openai_log`).
* `read_fleetrl_traces`: our own trace lines (docs/guides/tasks.md, "Trace input") as
  sessions, ignoring their ``workspace`` / ``eval`` (a template supplies those).

docs/traces.md maps every field read to the `Session` and on to the `Task`. Messages are
converted by `trace_messages.openai_message`; every unusable record is one
`SessionProblem` naming it and the field at fault, and costs no other record.

mini-swe-agent's outcome: its ``info.exit_status`` says how the run ended, not whether
the task was solved (it never grades). ``"Submitted"`` (the agent said it was done) is
``outcome="success"`` unless a score is present, which then decides; every other status
(``LimitsExceeded``, ``TimeExceeded``, ``RepeatedFormatError``, an exception's class
name) is ``"failure"``; an empty status (the file a run saves after every step, left by
a run that was killed) is no outcome. Limits and a missing exit are ``truncated``.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping

from .trace_messages import BadRecord, decode_json, json_kind, openai_message, scalar_metadata, score_value
from .trace_openai_log import read_openai_log
from .trace_sessions import Session, SessionProblem, SessionRead

__all__ = ["read_fleetrl_traces", "read_mini_swe_agent", "read_openai_log"]

_BOM = b"\xef\xbb\xbf"
_LIMIT_EXITS = frozenset({"LimitsExceeded", "TimeExceeded"})


# --------------------------------------------------------------------------- mini-swe-agent


def _mswea_id(doc: Mapping[str, object], where: str) -> str:
    instance_id = doc.get("instance_id")  # mini-extra swebench adds it
    if isinstance(instance_id, str) and instance_id:
        return instance_id
    name = posixpath.basename(where.replace("\\", "/")) or where
    for suffix in (".traj.json", ".json"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name or "session"


def _mswea_session(doc: object, where: str) -> Session:
    if not isinstance(doc, dict):
        raise BadRecord("", f"a mini-swe-agent trajectory is a JSON object, got {json_kind(doc)}")
    fmt = doc.get("trajectory_format")
    if fmt is not None and not (isinstance(fmt, str) and fmt.startswith("mini-swe-agent")):
        raise BadRecord("trajectory_format", f"not a mini-swe-agent trajectory: {fmt!r}")
    info = doc.get("info", {})
    if not isinstance(info, dict):
        raise BadRecord("info", f"must be an object, got {json_kind(info)}")
    raw_messages = doc.get("messages")
    if not isinstance(raw_messages, list):
        raise BadRecord("messages", "missing" if raw_messages is None
                        else f"must be a list, got {json_kind(raw_messages)}")

    messages = []
    exit_extra: Mapping[str, object] = {}
    for i, raw in enumerate(raw_messages):
        field = f"messages[{i}]"
        if isinstance(raw, dict) and raw.get("role") == "exit":  # DefaultAgent's last message: how it ended
            extra = raw.get("extra")
            exit_extra = extra if isinstance(extra, dict) else {}
            continue
        if isinstance(raw, dict) and "role" not in raw and isinstance(raw.get("type"), str):
            raise BadRecord(f"{field}.type", f"a Responses-API item ({raw['type']!r}) cannot be replayed; "
                                             "use a chat-completions model class")
        messages.append(openai_message(raw, field))

    status_field = "info.exit_status"
    status = info.get("exit_status")
    if status is None and "exit_status" in exit_extra:
        status, status_field = exit_extra.get("exit_status"), "messages[-1].extra.exit_status"
    if status is not None and not isinstance(status, str):
        raise BadRecord(status_field, f"must be a string, got {json_kind(status)}")
    score = score_value(info.get("score", doc.get("score")), "info.score" if "score" in info else "score")

    if not status:
        outcome, truncated = None, True  # saved mid-run: the run never ended
    elif status == "Submitted":
        outcome, truncated = (None if score is not None else "success"), False
    else:
        outcome, truncated = "failure", status in _LIMIT_EXITS

    metadata: dict[str, str | int | float | bool | None] = {"mswea.exit_status": status or ""}
    config = info.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    if isinstance(model, dict) and isinstance(model.get("model_name"), str):
        metadata["model"] = model["model_name"]
    stats = info.get("model_stats")
    if isinstance(stats, dict):
        for key, name in (("api_calls", "mswea.api_calls"), ("instance_cost", "mswea.cost")):
            value = stats.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                metadata[name] = value
    for key, name in (("mini_version", "mswea.version"),):
        if isinstance(info.get(key), str):
            metadata[name] = info[key]
    if isinstance(fmt, str):
        metadata["mswea.trajectory_format"] = fmt
    return Session(
        id=_mswea_id(doc, where),
        format="mini-swe-agent",
        ref=where,
        messages=messages,
        outcome=outcome,
        score=score,
        truncated=truncated,
        metadata=metadata,
    )


def read_mini_swe_agent(data: bytes, where: str) -> SessionRead:
    """The session of one mini-swe-agent trajectory file (its bytes; ``where`` names it
    in refs and problems, it is not opened). The ``exit`` message DefaultAgent appends
    is not part of the conversation; ``extra`` of every message is ignored. A file that
    is no trajectory, or holds a message that cannot be replayed, is one problem."""
    try:
        doc = decode_json(data.removeprefix(_BOM))
        session = _mswea_session(doc, where)
    except BadRecord as bad:
        reason = bad.reason
        if not bad.field and reason.startswith("invalid JSON"):
            reason += " (a trajectory cut while it was written?)"
        return SessionRead(sessions=[], problems=[SessionProblem(where=where, field=bad.field, reason=reason)],
                           format="mini-swe-agent")
    return SessionRead(sessions=[session], problems=[], format="mini-swe-agent")


# --------------------------------------------------------------------------- our own trace lines


def _fleetrl_session(obj: object, ref: str) -> Session:
    if not isinstance(obj, dict):
        raise BadRecord("", f"a session must be a JSON object, got {json_kind(obj)}")
    sid = obj.get("id")
    if not isinstance(sid, str) or not sid:
        raise BadRecord("id", "missing" if sid is None else f"must be a non-empty string, got {sid!r}")
    raw_messages = obj.get("messages")
    if not isinstance(raw_messages, list):
        raise BadRecord("messages", "missing" if raw_messages is None
                        else f"must be a list, got {json_kind(raw_messages)}")
    messages = [openai_message(m, f"messages[{i}]") for i, m in enumerate(raw_messages)]
    outcome = obj.get("outcome")
    if outcome not in (None, "success", "failure"):
        raise BadRecord("outcome", f"must be \"success\" or \"failure\", got {outcome!r}")
    score = score_value(obj.get("score"), "score")
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise BadRecord("metadata", f"must be an object, got {json_kind(metadata)}")
    return Session(id=sid, format="fleetrl", ref=ref, messages=messages, outcome=outcome, score=score,
                   metadata=scalar_metadata(metadata))


def read_fleetrl_traces(data: bytes, where: str) -> SessionRead:
    """Our own trace lines as sessions: ``id``, ``messages``, ``outcome``, ``score``,
    ``metadata`` are read as `traces.tasks_from_traces` reads them; ``workspace``,
    ``eval``, ``image`` and ``limits`` are not (a template supplies them). A repeated
    session id is a problem on the later line."""
    sessions: list[Session] = []
    problems: list[SessionProblem] = []
    first_line: dict[str, int] = {}
    for lineno, raw in enumerate(data.removeprefix(_BOM).split(b"\n"), start=1):
        if not raw.strip():
            continue
        ref = f"{where}:{lineno}"
        try:
            session = _fleetrl_session(decode_json(raw), ref)
            if session.id in first_line:
                raise BadRecord("id", f"duplicate session id (first at line {first_line[session.id]})")
        except BadRecord as bad:
            problems.append(SessionProblem(where=ref, field=bad.field, reason=bad.reason))
            continue
        first_line[session.id] = lineno
        sessions.append(session)
    return SessionRead(sessions=sessions, problems=problems, format="fleetrl")

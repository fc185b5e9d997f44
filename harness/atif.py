"""ATIF (Agent Trajectory Interchange Format, Harbor's RFC 0001, v1.x) files -> `Session` values (pure).

ATIF is one JSON object per trajectory: ``schema_version`` (``"ATIF-v1.7"``),
``session_id``, ``agent`` and ``steps``, each step a ``system`` prompt, a ``user``
message or an ``agent`` turn (its ``message``, ``tool_calls``, the ``observation`` of
their results and the call's ``metrics``, token ids and log-probs included). The
structs below are that schema as msgspec Structs, used to write (`atif_write`) and,
unknown fields tolerated (a later v1.x may add some), to read.

`read_atif(data, where)` accepts one trajectory object, a JSON array of them, or JSON
Lines, and makes one `Session` (format ``"atif"``) of each trajectory:

* ``system`` / ``user`` steps -> system / user messages; ``agent`` steps -> assistant
  messages whose tool calls carry the ``arguments`` object as its JSON text (or the
  exact text fleetrl recorded, kept in the step's ``extra.fleetrl.arguments_text``);
* each ``observation`` result answering a tool call of its step (``source_call_id``)
  -> a tool message with that ``tool_call_id``, after the assistant message; a result
  without ``source_call_id`` (an action without a tool call, a system event) -> a user
  message;
* a message or result given as content parts -> its text parts joined without a
  separator; any other part (an image) is a problem naming it;
* ``is_copied_context`` steps after steps of the trajectory's own restart the
  conversation there (the context was rebuilt: a summary, a rewritten history; what
  follows continues the rebuilt one), as does a step marked ``extra.fleetrl.restart``
  (fleetrl writes it where an attempt's harness rewrote its history);
* the score: ``extra.reward``, else ``extra.rewards.reward`` or
  ``extra.verifier_result.rewards.reward`` (Harbor keeps a trial's rewards as
  ``verifier_result.rewards`` in its result.json, not in the trajectory), else
  ``final_metrics.extra.reward``; the outcome: ``extra.outcome`` (``"success"`` /
  ``"failure"``) when given, never guessed from the score;
* ``truncated``: ``continued_trajectory_ref`` is set (the run goes on in another file)
  or ``extra.truncated`` is true.

Every trajectory that cannot be read is one `SessionProblem` naming it (``file`` for a
single object, ``file:INDEX`` (from 0) in an array, ``file:LINE`` in JSON Lines) and the
field at fault by its path (``steps[3].tool_calls[0].function_name``); the others load.
docs/guides/atif.md maps every field both ways.
"""

from __future__ import annotations

import json
import posixpath
import re
from typing import Any, Literal

import msgspec

from .trace_messages import BadRecord, decode_json, json_kind, score_value
from .task_schema import FunctionCall, Message, MetadataValue, ToolCall
from .trace_sessions import Session, SessionProblem, SessionRead

__all__ = [
    "ATIF_VERSION",
    "AtifAgent",
    "AtifContentPart",
    "AtifFinalMetrics",
    "AtifMetrics",
    "AtifObservation",
    "AtifObservationResult",
    "AtifStep",
    "AtifToolCall",
    "AtifTrajectory",
    "read_atif",
]

ATIF_VERSION = "ATIF-v1.7"
"""The version fleetrl writes; it reads every ``ATIF-v1.x``."""

_VERSION = re.compile(r"^ATIF-v1\.\d+$")
_BOM = b"\xef\xbb\xbf"


class _Atif(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of the ATIF structs: keyword-only, None fields left out when written,
    unknown fields ignored when read (later v1.x versions add optional ones)."""


class AtifContentPart(_Atif):
    """One part of a multimodal message (ATIF-v1.6): ``text`` or ``image`` (``source``:
    ``media_type`` and ``path``)."""

    type: str
    text: str | None = None
    source: dict[str, Any] | None = None


Content = str | list[AtifContentPart]


class AtifToolCall(_Atif):
    tool_call_id: str
    function_name: str
    arguments: dict[str, Any] | str | None = None
    """An object by the spec; a JSON string is accepted when read."""


class AtifObservationResult(_Atif):
    source_call_id: str | None = None
    content: Content | None = None
    subagent_trajectory_ref: list[dict[str, Any]] | None = None


class AtifObservation(_Atif):
    results: list[AtifObservationResult]


class AtifMetrics(_Atif):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cost_usd: float | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float | None] | None = None
    extra: dict[str, Any] | None = None


class AtifStep(_Atif):
    step_id: int
    source: Literal["system", "user", "agent"]
    message: Content | None = None
    """Required by the spec (may be ``""``); a missing one is read as ``""``."""
    timestamp: str | None = None
    model_name: str | None = None
    reasoning_effort: str | float | None = None
    reasoning_content: str | None = None
    tool_calls: list[AtifToolCall] | None = None
    observation: AtifObservation | None = None
    metrics: AtifMetrics | None = None
    is_copied_context: bool | None = None
    llm_call_count: int | None = None
    extra: dict[str, Any] | None = None


class AtifAgent(_Atif):
    name: str
    version: str | None = None
    model_name: str | None = None
    tool_definitions: list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None


class AtifFinalMetrics(_Atif):
    total_prompt_tokens: int | None = None
    total_completion_tokens: int | None = None
    total_cached_tokens: int | None = None
    total_cost_usd: float | None = None
    total_steps: int | None = None
    extra: dict[str, Any] | None = None


class AtifTrajectory(_Atif, kw_only=True):
    """One ATIF trajectory document (the root object)."""

    schema_version: str | None = None
    """Required by the spec (fleetrl writes `ATIF_VERSION`); a missing one is read as v1."""
    session_id: str | None = None
    trajectory_id: str | None = None
    agent: AtifAgent | None = None
    """Required by the spec; a missing one is tolerated when read."""
    steps: list[AtifStep]
    notes: str | None = None
    final_metrics: AtifFinalMetrics | None = None
    continued_trajectory_ref: str | None = None
    extra: dict[str, Any] | None = None
    subagent_trajectories: list[dict[str, Any]] | None = None


# --------------------------------------------------------------------------- reading

_AGENT_ONLY = ("model_name", "reasoning_effort", "reasoning_content", "tool_calls", "metrics")
_AT = re.compile(r"^(?P<reason>.*?) - at `\$(?P<path>[^`]*)`$", re.S)


def _validation_problem(err: msgspec.ValidationError) -> BadRecord:
    """msgspec's ``Expected `str`, got `int` - at `$.steps[0].source``` as a field path and reason."""
    text = str(err)
    m = _AT.match(text)
    if m is None:
        return BadRecord("", text)
    return BadRecord(m["path"].lstrip("."), m["reason"])


def _text(content: Content | None, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    pieces = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise BadRecord(f"{field}[{j}]", f"only text parts can be replayed, got type {part.type!r}")
        if part.text is None:
            raise BadRecord(f"{field}[{j}].text", "a text part's text must be a string, got null")
        pieces.append(part.text)
    return "".join(pieces)


def _fleetrl_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    own = (extra or {}).get("fleetrl")
    return own if isinstance(own, dict) else {}


def _arguments(call: AtifToolCall, exact: dict[str, Any], field: str) -> str:
    text = exact.get(call.tool_call_id)
    if isinstance(text, str):
        return text
    args = call.arguments
    if args is None:
        return "{}"
    if isinstance(args, str):
        return args
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError as err:
        raise BadRecord(f"{field}.arguments", f"cannot be written as JSON: {err}") from None


def _step_messages(step: AtifStep, i: int) -> list[Message]:
    field = f"steps[{i}]"
    if step.source != "agent":
        for name in _AGENT_ONLY:
            if getattr(step, name) is not None:
                raise BadRecord(f"{field}.{name}", f"only agent steps carry {name}, not a {step.source} step")
    content = _text(step.message, f"{field}.message")
    calls: list[ToolCall] = []
    exact = _fleetrl_extra(step.extra).get("arguments_text")
    exact = exact if isinstance(exact, dict) else {}
    seen: set[str] = set()
    for j, call in enumerate(step.tool_calls or ()):
        where = f"{field}.tool_calls[{j}]"
        if not call.tool_call_id:
            raise BadRecord(f"{where}.tool_call_id", "must be a non-empty string")
        if call.tool_call_id in seen:
            raise BadRecord(f"{where}.tool_call_id", f"{call.tool_call_id!r} is used twice in the step")
        seen.add(call.tool_call_id)
        if not call.function_name:
            raise BadRecord(f"{where}.function_name", "must be a non-empty string")
        calls.append(ToolCall(id=call.tool_call_id,
                              function=FunctionCall(name=call.function_name, arguments=_arguments(call, exact, where))))
    role = {"system": "system", "user": "user", "agent": "assistant"}[step.source]
    out = [Message(role=role, content=content, tool_calls=calls or None)]
    if step.observation is not None:
        if step.source == "user":
            raise BadRecord(f"{field}.observation", "a user step carries no observation")
        for j, result in enumerate(step.observation.results):
            where = f"{field}.observation.results[{j}]"
            text = _text(result.content, f"{where}.content")
            if result.source_call_id is None:
                out.append(Message(role="user", content=text))
            elif result.source_call_id in seen:
                out.append(Message(role="tool", content=text, tool_call_id=result.source_call_id))
            else:
                raise BadRecord(f"{where}.source_call_id",
                                f"{result.source_call_id!r} names no tool call of this step")
    return out


def _reward(doc: AtifTrajectory) -> tuple[float | None, str | None]:
    """The recorded score and outcome (see the module docstring)."""
    extra = doc.extra or {}
    score = None
    if "reward" in extra:
        score = score_value(extra["reward"], "extra.reward")
    else:
        for path in (("rewards", "reward"), ("verifier_result", "rewards", "reward")):
            node: Any = extra
            for key in path:
                node = node.get(key) if isinstance(node, dict) else None
            if node is not None:
                score = score_value(node, "extra." + ".".join(path))
                break
        if score is None and doc.final_metrics is not None and doc.final_metrics.extra:
            score = score_value(doc.final_metrics.extra.get("reward"), "final_metrics.extra.reward")
    outcome = extra.get("outcome")
    if outcome not in (None, "success", "failure"):
        raise BadRecord("extra.outcome", f"must be \"success\" or \"failure\", got {outcome!r}")
    return score, outcome


def _metadata(doc: AtifTrajectory, restarts: int) -> dict[str, MetadataValue]:
    meta: dict[str, MetadataValue] = {"atif.schema_version": doc.schema_version}
    if doc.agent is not None:
        meta["agent"] = doc.agent.name
        if doc.agent.version is not None:
            meta["agent.version"] = doc.agent.version
        if doc.agent.model_name is not None:
            meta["model"] = doc.agent.model_name
    if restarts:
        meta["atif.restarts"] = restarts
    return meta


def _fallback_id(where: str) -> str:
    name = posixpath.basename(where.replace("\\", "/")) or where
    for suffix in (".atif.json", ".trajectory.json", ".json", ".jsonl"):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)]
    return name or "trajectory"


def _session(obj: object, ref: str) -> Session:
    if not isinstance(obj, dict):
        raise BadRecord("", f"a trajectory must be a JSON object, got {json_kind(obj)}")
    try:
        doc = msgspec.convert(obj, AtifTrajectory)
    except msgspec.ValidationError as err:
        raise _validation_problem(err) from None
    if doc.schema_version is not None and not _VERSION.match(doc.schema_version):
        raise BadRecord("schema_version", f"not an ATIF v1 version: {doc.schema_version!r} (expected \"ATIF-v1.N\")")
    if not doc.steps:
        raise BadRecord("steps", "holds no step")
    messages: list[Message] = []
    own_seen = False
    restarts = 0
    for i, step in enumerate(doc.steps):
        if step.step_id != i + 1:
            raise BadRecord(f"steps[{i}].step_id", f"expected {i + 1} (sequential from 1), got {step.step_id}")
        new = _step_messages(step, i)
        if _fleetrl_extra(step.extra).get("restart") is True and messages:
            messages, own_seen = [], False
            restarts += 1
        elif step.is_copied_context:
            if own_seen:  # the context was rebuilt: the conversation goes on from the copy
                messages, own_seen = [], False
                restarts += 1
        else:
            own_seen = True
        messages.extend(new)
    score, outcome = _reward(doc)
    sid = doc.session_id or doc.trajectory_id or _fallback_id(ref)
    truncated = bool(doc.continued_trajectory_ref) or (doc.extra or {}).get("truncated") is True
    return Session(id=sid, format="atif", ref=ref, messages=messages, outcome=outcome, score=score,
                   truncated=truncated, metadata=_metadata(doc, restarts))


def _records(data: bytes, where: str) -> list[tuple[str, object]] | SessionProblem:
    """(ref, decoded value or BadRecord) of each trajectory of the input (not empty), or
    the one problem of an input that is neither JSON nor JSON Lines."""
    try:
        whole = decode_json(data)
    except BadRecord as bad:
        first = next((raw for raw in data.split(b"\n") if raw.strip()), b"")
        try:
            decode_json(first)
        except BadRecord:  # not JSON Lines either: one document that does not parse (cut short?)
            return SessionProblem(where=where, field="", reason=bad.reason + " (a file cut while it was written?)")
    else:
        if isinstance(whole, list):
            return [(f"{where}:{i}", obj) for i, obj in enumerate(whole)]
        return [(where, whole)]
    out: list[tuple[str, object]] = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        ref = f"{where}:{lineno}"
        try:
            out.append((ref, decode_json(raw)))
        except BadRecord as bad:
            out.append((ref, bad))
    return out


def read_atif(data: bytes, where: str) -> SessionRead:
    """The sessions of one ATIF input (its bytes; ``where`` names it in refs and
    problems, it is not opened): one trajectory object, a JSON array of them or JSON
    Lines. See the module docstring for the mapping; one problem per unreadable
    trajectory, the others are read."""
    data = data.removeprefix(_BOM)
    if not data.strip():
        return SessionRead(sessions=[], problems=[SessionProblem(
            where=where, field="", reason="no trajectory (the input is empty)")], format="atif")
    records = _records(data, where)
    if isinstance(records, SessionProblem):
        return SessionRead(sessions=[], problems=[records], format="atif")
    sessions: list[Session] = []
    problems: list[SessionProblem] = []
    for ref, obj in records:
        try:
            if isinstance(obj, BadRecord):
                raise obj
            sessions.append(_session(obj, ref))
        except BadRecord as bad:
            problems.append(SessionProblem(where=ref, field=bad.field, reason=bad.reason))
    return SessionRead(sessions=sessions, problems=problems, format="atif")

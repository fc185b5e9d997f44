"""OpenAI chat-completions request logs -> `Session` values (pure).

A logging proxy writes one JSON object a line holding a request and its response.
Accepted line shapes (docs/traces.md, "OpenAI request logs"):

* ``{"request": {...}, "response": {...}}``;
* ``{"body": {...}, "response_body": {...}}`` or ``{"request_body": ..., "response_body": ...}``;
* either side may be a JSON *string* of the body, or wrap it as ``{"body": ...}``
  (with headers or a status next to it);
* a streamed response is a list of ``chat.completion.chunk`` objects, or the text of
  the server-sent events (``data: {...}`` lines, ``data: [DONE]``);
* a missing / ``null`` response, or one holding an ``error``, leaves the request's
  messages only and marks the session truncated.

A line makes the conversation ``request.messages + [the response's assistant
message]`` (``choices[0]``). Agents resend the whole history on every call, so a
line whose conversation is a prefix of another line's (or equal to a later line's) is
folded into it: a session is the longest conversation, one per agent run, counted in
``SessionRead.merged``. Its outcome and score come from the kept line's
``metadata`` (top level, or the request's OpenAI ``metadata``, whose values are strings):
``outcome`` (``"success"``/``"failure"``) and ``score`` (a number); without them a session
has neither. ``finish_reason`` ``"length"``, a stream that never finished and a missing
response set ``truncated``. A last line cut mid-write (no final newline, invalid JSON)
keeps the request messages that are whole in it, as a truncated session
(``metadata["openai.cut_line"]``); with none whole it is a problem saying so.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping

import msgspec

from .task_schema import Message
from .trace_messages import BadRecord, decode_json, json_kind, openai_message, scalar_metadata, score_value
from .trace_sessions import Session, SessionProblem, SessionRead

__all__ = ["read_openai_log"]

_BOM = b"\xef\xbb\xbf"
_ENCODER = msgspec.json.Encoder()


class _Line(msgspec.Struct, frozen=True, kw_only=True):
    lineno: int
    messages: list[Message]
    response_id: str | None
    truncated: bool
    finish_reason: str | None
    metadata: dict[str, str | int | float | bool | None]
    outcome: str | None
    score: float | None
    session_id: str | None


def _body(value: object, field: str) -> object:
    """A logged body: an object, a JSON string of one, or ``{"body": ...}`` around it."""
    if isinstance(value, str | bytes):
        try:
            value = decode_json(value.encode() if isinstance(value, str) else value)
        except BadRecord as bad:
            raise BadRecord(field, f"a string body must hold JSON: {bad.reason}") from None
    if isinstance(value, dict) and "body" in value and not ({"messages", "choices"} & value.keys()):
        return _body(value["body"], f"{field}.body")
    return value


def _sse_chunks(text: str, field: str) -> list[object]:
    chunks: list[object] = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            break
        try:
            chunks.append(decode_json(payload.encode()))
        except BadRecord as bad:
            raise BadRecord(field, f"an event of the stream is no JSON: {bad.reason}") from None
    return chunks


def _from_chunks(chunks: list[object], field: str) -> tuple[dict[str, object], str | None, str | None]:
    """Assemble a streamed response: (assistant message dict, finish_reason, response id)."""
    content: list[str] = []
    calls: dict[int, dict[str, object]] = {}
    finish: str | None = None
    response_id: str | None = None
    role = "assistant"
    for k, chunk in enumerate(chunks):
        where = f"{field}[{k}]"
        if not isinstance(chunk, dict):
            raise BadRecord(where, f"a stream chunk must be an object, got {json_kind(chunk)}")
        if isinstance(chunk.get("id"), str) and response_id is None:
            response_id = chunk["id"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise BadRecord(f"{where}.choices", f"must be a list, got {json_kind(choices)}")
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise BadRecord(f"{where}.choices[0].delta", f"must be an object, got {json_kind(delta)}")
            if isinstance(delta.get("role"), str):
                role = delta["role"]
            piece = delta.get("content")
            if isinstance(piece, str):
                content.append(piece)
            for j, tc in enumerate(delta.get("tool_calls") or []):
                if not isinstance(tc, dict):
                    raise BadRecord(f"{where}.choices[0].delta.tool_calls[{j}]", "a tool call delta must be an object")
                index = tc.get("index", j)
                if not isinstance(index, int) or isinstance(index, bool):
                    raise BadRecord(f"{where}.choices[0].delta.tool_calls[{j}].index",
                                    f"must be an integer, got {index!r}")
                slot = calls.setdefault(index, {"id": "", "name": "", "arguments": ""})
                if isinstance(tc.get("id"), str):
                    slot["id"] = tc["id"]
                fn = tc.get("function") or {}
                if isinstance(fn, dict):
                    if isinstance(fn.get("name"), str):
                        slot["name"] = str(slot["name"]) + fn["name"]
                    if isinstance(fn.get("arguments"), str):
                        slot["arguments"] = str(slot["arguments"]) + fn["arguments"]
            if isinstance(choice.get("finish_reason"), str):
                finish = choice["finish_reason"]
    message: dict[str, object] = {"role": role, "content": "".join(content)}
    if calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(calls.items())
        ]
    return message, finish, response_id


def _response(response: object, field: str) -> tuple[Message | None, str | None, str | None, bool]:
    """(assistant message, finish_reason, response id, truncated) of a logged response."""
    if response is None:
        return None, None, None, True  # the request was logged, its answer never was
    if isinstance(response, str) and "data:" in response:
        response = _sse_chunks(response, field)
    else:
        response = _body(response, field)
    if isinstance(response, list):
        raw, finish, response_id = _from_chunks(response, field)
        if not raw["content"] and "tool_calls" not in raw and finish is None:
            return None, None, response_id, True  # a stream cut before its first token
        message = openai_message(raw, field)
        return message, finish, response_id, finish is None or finish == "length"
    if not isinstance(response, dict):
        raise BadRecord(field, f"must be a chat completion object, a list of chunks or null, got {json_kind(response)}")
    response_id = response.get("id") if isinstance(response.get("id"), str) else None
    if "error" in response and "choices" not in response:
        return None, None, response_id, True
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices:
        raise BadRecord(f"{field}.choices", "missing" if choices is None else "must be a non-empty list")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise BadRecord(f"{field}.choices[0]", f"must be an object, got {json_kind(choice)}")
    message = openai_message(choice.get("message"), f"{field}.choices[0].message")
    finish = choice.get("finish_reason") if isinstance(choice.get("finish_reason"), str) else None
    return message, finish, response_id, finish == "length"


def _outcome(meta: Mapping[str, object], field: str, *, strings: bool) -> tuple[str | None, float | None]:
    outcome = meta.get("outcome")
    if outcome is not None and outcome not in ("success", "failure"):
        raise BadRecord(f"{field}.outcome", f"must be \"success\" or \"failure\", got {outcome!r}")
    return outcome, score_value(meta.get("score"), f"{field}.score", strings=strings)


def _line(obj: object, lineno: int) -> _Line:
    if not isinstance(obj, dict):
        raise BadRecord("", f"a log line must be a JSON object, got {json_kind(obj)}")
    if "request" in obj:
        req_field, resp_field = "request", "response"
    elif "request_body" in obj or "body" in obj:
        req_field = "request_body" if "request_body" in obj else "body"
        resp_field = "response_body" if "response_body" in obj else "response"
    else:
        raise BadRecord("", "no request: expected `request` (with `response`) or `body` / `request_body` "
                            "(with `response_body`)")
    request = _body(obj[req_field], req_field)
    if not isinstance(request, dict):
        raise BadRecord(req_field, f"must be a chat-completions request object, got {json_kind(request)}")
    raw_messages = request.get("messages")
    if not isinstance(raw_messages, list):
        raise BadRecord(f"{req_field}.messages", "missing (not a chat-completions request?)" if raw_messages is None
                        else f"must be a list, got {json_kind(raw_messages)}")
    if not raw_messages:
        raise BadRecord(f"{req_field}.messages", "holds no message")
    messages = [openai_message(m, f"{req_field}.messages[{i}]") for i, m in enumerate(raw_messages)]
    reply, finish, response_id, truncated = _response(obj.get(resp_field), resp_field)
    if reply is not None:
        messages.append(reply)

    outcome = score = None
    metadata: dict[str, str | int | float | bool | None] = {}
    for meta, field, strings in ((request.get("metadata"), f"{req_field}.metadata", True),
                                 (obj.get("metadata"), "metadata", False)):
        if meta is None:
            continue
        if not isinstance(meta, dict):
            raise BadRecord(field, f"must be an object, got {json_kind(meta)}")
        o, s = _outcome(meta, field, strings=strings)
        outcome, score = o or outcome, s if s is not None else score
        metadata.update({k: v for k, v in scalar_metadata(meta).items() if k not in ("outcome", "score")})
    if isinstance(request.get("model"), str):
        metadata["model"] = request["model"]
    if finish is not None:
        metadata["openai.finish_reason"] = finish
    sid = metadata.get("session_id")
    return _Line(lineno=lineno, messages=messages, response_id=response_id, truncated=truncated,
                 finish_reason=finish, metadata=metadata, outcome=outcome, score=score,
                 session_id=sid if isinstance(sid, str) and sid else None)


_MESSAGES_KEY = re.compile(r'"messages"\s*:\s*\[')


def _salvage(raw: bytes, lineno: int) -> _Line | None:
    """The complete request messages at the start of a line cut mid-write, as a
    truncated session's line; None when not one message is whole (or one is unusable)."""
    text = raw.decode("utf-8", errors="replace")
    found = _MESSAGES_KEY.search(text)
    if found is None:
        return None
    decoder = json.JSONDecoder()
    pos, raw_messages = found.end(), []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        raw_messages.append(value)
    try:
        messages = [openai_message(m, f"request.messages[{i}]") for i, m in enumerate(raw_messages)]
    except BadRecord:
        return None
    if not messages:
        return None
    return _Line(lineno=lineno, messages=messages, response_id=None, truncated=True, finish_reason=None,
                 metadata={"openai.cut_line": True}, outcome=None, score=None, session_id=None)


def _prefix_digests(messages: list[Message]) -> list[bytes]:
    """digest[k] identifies messages[:k + 1] (a hash chain over each message's JSON)."""
    out = []
    h = b""
    for m in messages:
        h = hashlib.sha256(h + _ENCODER.encode(m)).digest()
        out.append(h)
    return out


def _fold(lines: list[_Line]) -> tuple[list[_Line], int]:
    """Keep the lines whose conversation no other line extends (and, of equal ones, the
    last): (kept, in input order; how many were folded)."""
    digests = [_prefix_digests(line.messages) for line in lines]
    full: dict[bytes, int] = {}
    for i, d in enumerate(digests):
        if d:
            full[d[-1]] = i  # the last of equal conversations wins
    folded = set()
    for i, d in enumerate(digests):
        if full[d[-1]] != i:
            folded.add(i)
        for prefix in d[:-1]:
            j = full.get(prefix)
            if j is not None:
                folded.add(j)
    kept = [line for i, line in enumerate(lines) if i not in folded]
    return kept, len(lines) - len(kept)


def read_openai_log(data: bytes, where: str) -> SessionRead:
    """The sessions of a chat-completions request log (its bytes; ``where`` names it in
    refs and problems, it is not opened). One problem per unusable line, naming
    ``where:line`` and the field; a session's ``ref`` is the line that made it."""
    problems: list[SessionProblem] = []
    lines: list[_Line] = []
    raw_lines = data.removeprefix(_BOM).split(b"\n")
    cut_at = len(raw_lines) if raw_lines and raw_lines[-1].strip() else None  # no final newline
    for lineno, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            try:
                obj = decode_json(raw)
            except BadRecord as bad:
                if lineno != cut_at:
                    raise
                salvaged = _salvage(raw, lineno)
                if salvaged is None:
                    raise BadRecord("", f"the log ends mid-line (cut while it was written): {bad.reason}") from None
                lines.append(salvaged)  # its whole request messages, a truncated session
                continue
            lines.append(_line(obj, lineno))
        except BadRecord as bad:
            problems.append(SessionProblem(where=f"{where}:{lineno}", field=bad.field, reason=bad.reason))
    kept, folded = _fold(lines)
    sessions = [
        Session(
            id=line.session_id or line.response_id or f"line{line.lineno}",
            format="openai-log",
            ref=f"{where}:{line.lineno}",
            messages=line.messages,
            outcome=line.outcome,  # type: ignore[arg-type]
            score=line.score,
            truncated=line.truncated,
            metadata=line.metadata,
        )
        for line in kept
    ]
    return SessionRead(sessions=sessions, problems=problems, format="openai-log", merged=folded)

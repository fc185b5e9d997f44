"""OpenAI-style chat messages from decoded JSON, for the trajectory readers (pure).

`openai_message` turns one decoded message (a dict from a request log, a
mini-swe-agent trajectory or one of our trace lines) into a `task_schema.Message`, or
raises `BadRecord` naming the field at fault by its dotted path in the input. The rules
are the ones docs/traces.md states for every format:

* roles ``system``, ``developer`` (becomes ``system``), ``user``, ``assistant``,
  ``tool``; any other role is a problem;
* ``content``: a string, ``null`` / absent (``""``) or a list of parts whose text parts
  (``type`` ``"text"``, ``"input_text"`` or ``"output_text"``) are joined without a
  separator; any other part (an image, audio, a file) is a problem naming the part;
* ``tool_calls`` (assistant only; ``[]`` is the same as none), ``tool_call_id`` (tool
  only) and ``name`` are kept; every other key (``refusal``, ``extra``,
  ``reasoning_content``, timestamps) is ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from .errors import HarnessError
from .task_schema import FunctionCall, Message, ToolCall

__all__ = [
    "TEXT_PART_TYPES",
    "BadRecord",
    "decode_json",
    "join_field",
    "json_kind",
    "openai_message",
    "scalar_metadata",
    "score_value",
]

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
_DECODER = msgspec.json.Decoder()
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class BadRecord(HarnessError):
    """A record of a trajectory file that makes no session: the field at fault (a dotted
    path in the input, ``""`` for the whole record) and why (a `SessionProblem`)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


def join_field(path: str, sub: str) -> str:
    """``a.b`` + ``c`` -> ``a.b.c``; ``a`` + ``[0]`` -> ``a[0]``."""
    if not path:
        return sub
    return path + sub if sub.startswith("[") else f"{path}.{sub}"


def json_kind(obj: object) -> str:
    """How a decoded JSON value is called in a problem: ``a string``, ``null``, ..."""
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
        case dict():
            return "an object"
        case _:
            return type(obj).__name__


def _text(content: object, field: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRecord(field, f"must be a string, null or a list of parts, got {json_kind(content)}")
    pieces = []
    for j, part in enumerate(content):
        where = f"{field}[{j}]"
        if isinstance(part, str):  # some loggers flatten text parts to strings
            pieces.append(part)
            continue
        if not isinstance(part, Mapping):
            raise BadRecord(where, f"a content part must be an object, got {json_kind(part)}")
        kind = part.get("type")
        if kind not in TEXT_PART_TYPES:
            raise BadRecord(where, f"only text parts can be replayed, got type {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise BadRecord(join_field(where, "text"), f"a text part's text must be a string, got {json_kind(text)}")
        pieces.append(text)
    return "".join(pieces)


def _tool_calls(raw: object, field: str) -> list[ToolCall] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BadRecord(field, f"must be a list of tool calls, got {json_kind(raw)}")
    calls = []
    for j, call in enumerate(raw):
        where = f"{field}[{j}]"
        if not isinstance(call, Mapping):
            raise BadRecord(where, f"a tool call must be an object, got {json_kind(call)}")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise BadRecord(join_field(where, "id"), f"must be a non-empty string, got {json_kind(call_id)}")
        kind = call.get("type", "function")
        if kind != "function":
            raise BadRecord(join_field(where, "type"), f"only function tool calls can be replayed, got {kind!r}")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            raise BadRecord(join_field(where, "function"), f"must be an object, got {json_kind(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise BadRecord(join_field(where, "function.name"), f"must be a non-empty string, got {json_kind(name)}")
        arguments = fn.get("arguments", "")
        if arguments is None:
            arguments = ""
        if not isinstance(arguments, str):
            raise BadRecord(join_field(where, "function.arguments"),
                            f"must be a JSON string, got {json_kind(arguments)}")
        calls.append(ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments)))
    return calls or None


def openai_message(obj: object, field: str) -> Message:
    """The `Message` of one decoded OpenAI-style chat message found at ``field`` (e.g.
    ``request.messages[3]``), or `BadRecord` naming the sub-field at fault."""
    if not isinstance(obj, Mapping):
        raise BadRecord(field, f"a message must be an object, got {json_kind(obj)}")
    raw_role = obj.get("role")
    role = _ROLES.get(raw_role) if isinstance(raw_role, str) else None
    if role is None:
        raise BadRecord(join_field(field, "role"), f"unknown role {raw_role!r} (expected one of {', '.join(_ROLES)})")
    content = _text(obj.get("content"), join_field(field, "content"))
    name = obj.get("name")
    if name is not None and not isinstance(name, str):
        raise BadRecord(join_field(field, "name"), f"must be a string, got {json_kind(name)}")
    tool_calls = _tool_calls(obj.get("tool_calls"), join_field(field, "tool_calls"))
    if tool_calls is not None and role != "assistant":
        raise BadRecord(join_field(field, "tool_calls"), f"only assistant messages carry tool calls, not {role!r}")
    tool_call_id = obj.get("tool_call_id")
    if tool_call_id is not None:
        if role != "tool":
            raise BadRecord(join_field(field, "tool_call_id"), f"only tool messages carry a tool_call_id, not {role!r}")
        if not isinstance(tool_call_id, str):
            raise BadRecord(join_field(field, "tool_call_id"), f"must be a string, got {json_kind(tool_call_id)}")
    return Message(role=role, content=content, name=name, tool_calls=tool_calls, tool_call_id=tool_call_id)


def decode_json(raw: bytes) -> object:
    """One JSON text, or `BadRecord` (field ``""``) saying why it is none."""
    try:
        return _DECODER.decode(raw)
    except msgspec.DecodeError as err:
        raise BadRecord("", f"invalid JSON: {err}") from None
    except RecursionError:
        raise BadRecord("", "invalid JSON: nested too deeply") from None


def scalar_metadata(obj: Mapping[str, object]) -> dict[str, str | int | float | bool | None]:
    """The entries of ``obj`` a task's metadata can hold (string keys, scalar values,
    finite numbers); the others are dropped."""
    out: dict[str, str | int | float | bool | None] = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        if value is None or isinstance(value, str | int | float | bool):
            out[key] = value
    return out


def score_value(value: object, field: str, *, strings: bool = False) -> float | None:
    """A recorded score: ``None`` when absent, else a finite number (with ``strings``
    also a string holding one, as OpenAI's string-valued request ``metadata`` carries
    it), else `BadRecord` naming ``field``."""
    if value is None:
        return None
    if strings and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise BadRecord(field, f"must be a number, got {value!r}") from None
        if math.isfinite(number):
            return number
    elif not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    raise BadRecord(field, f"must be a finite number, got {value!r}")

"""The chat messages and tools of a request to the OpenAI-compatible endpoint, checked (pure).

`chat_messages` turns ``messages`` into `ChatMessage` values (roles, text content or
text parts, an assistant's ``tool_calls`` with arguments that are the JSON text of an
object, a tool message's ``tool_call_id``); `request_tools` checks ``tools`` (function
tools, names as OpenAI allows them, each once); `request_tool_choice` reads
``tool_choice``: ``"auto"`` and ``"none"`` are served, ``"required"`` and a named
function are a 400 ``unsupported_value`` (fleetrl does not constrain decoding), never a
silent change of meaning. Fields fleetrl does not know are named in ``ignored``.
"""

from __future__ import annotations

import json
import re

from .chat import ChatMessage, ToolCall
from .openai_fields import bad_param, object_field, string_field, type_name

__all__ = ["chat_messages", "content_text", "message_tool_calls", "request_tool_choice", "request_tools"]

_MESSAGE_KNOWN = {"role", "content", "name", "tool_calls", "tool_call_id"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


def content_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_param(f"{where}.content[{j}]", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported",
                                "unsupported_value")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_param(f"{where}.content", f"must be a string or an array of text parts, got {type_name(content)}",
                    "invalid_type")


def chat_messages(body: dict, ignored: list[str]) -> list[ChatMessage]:
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        raise bad_param("messages", "is required and must be an array" if msgs is None else
                        f"must be an array, got {type_name(msgs)}", "invalid_type")
    if not msgs:
        raise bad_param("messages", "must hold at least one message")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_param(where, f"must be an object, got {type_name(m)}", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_param(f"{where}.role", "is required and must be a string" if role is None else
                            f"must be a string, got {type_name(role)}", "invalid_type")
        if role not in _ROLES:
            raise bad_param(f"{where}.role", f"must be one of {', '.join(sorted(_ROLES))}, got {role!r}")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_param(f"{where}.name", f"must be a string, got {type_name(name)}", "invalid_type")
        calls = message_tool_calls(m, role, where)
        call_id = m.get("tool_call_id")
        if role == "tool":
            if not isinstance(call_id, str):
                raise bad_param(f"{where}.tool_call_id", "is required for role tool and must be a string" if call_id is None
                                else f"must be a string, got {type_name(call_id)}", "missing" if call_id is None
                                else "invalid_type")
        elif "tool_call_id" in m:
            ignored.append(f"{where}.tool_call_id")
        out.append(ChatMessage(role, content_text(m.get("content"), where), tool_calls=calls,
                               tool_call_id=call_id if role == "tool" else None, name=name))
        ignored.extend(f"{where}.{k}" for k in m if k not in _MESSAGE_KNOWN)
    return out


def message_tool_calls(m: dict, role: str, where: str) -> tuple[ToolCall, ...]:
    """The ``tool_calls`` of message ``m`` (an assistant's only): each
    ``{"id", "type": "function", "function": {"name", "arguments"}}`` whose arguments are
    the JSON text of an object, as the API returns them."""
    calls = m.get("tool_calls")
    if calls is None:
        return ()
    if role != "assistant":
        raise bad_param(f"{where}.tool_calls", f"only assistant messages carry tool calls, this one has role {role!r}")
    if not isinstance(calls, list):
        raise bad_param(f"{where}.tool_calls", f"must be an array, got {type_name(calls)}", "invalid_type")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict):
            raise bad_param(at, f"must be an object, got {type_name(call)}", "invalid_type")
        call_id = string_field(call, "id", at)
        if call.get("type", "function") != "function":
            raise bad_param(f"{at}.type", f"must be 'function', got {call.get('type')!r}")
        fn = object_field(call, "function", at)
        name = string_field(fn, "name", f"{at}.function")
        arguments = string_field(fn, "arguments", f"{at}.function")
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            raise bad_param(f"{at}.function.arguments", "must be the JSON text of an object (as the API returns it), "
                            f"got {arguments[:40]!r}")
        out.append(ToolCall(id=call_id, name=name, arguments=arguments))
    return tuple(out)


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_NO_CONSTRAINT = ("fleetrl samples the model's own answer and does not constrain decoding, so it cannot force "
                  "a tool call; send tool_choice 'auto' (or 'none')")


def request_tools(body: dict) -> list[dict] | None:
    """The request's ``tools`` as sent (checked; an empty array is no tools)."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_param("tools", f"must be an array, got {type_name(tools)}", "invalid_type")
    names: list[str] = []
    for i, t in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_param(at, f"must be an object, got {type_name(t)}", "invalid_type")
        kind = string_field(t, "type", at)
        if kind != "function":
            raise bad_param(f"{at}.type", f"must be 'function', got {kind!r}")
        fn = object_field(t, "function", at)
        name = string_field(fn, "name", f"{at}.function")
        if not _TOOL_NAME.fullmatch(name):
            raise bad_param(f"{at}.function.name", f"must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name[:80]!r}")
        if name in names:
            raise bad_param(f"{at}.function.name", f"{name!r} is defined twice")
        names.append(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_param(f"{at}.function.description", f"must be a string, got {type_name(fn['description'])}",
                            "invalid_type")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_param(f"{at}.function.parameters", "must be an object (a JSON schema), got "
                            f"{type_name(fn['parameters'])}", "invalid_type")
    return tools or None


def request_tool_choice(body: dict, tools: list[dict] | None) -> str:
    """``"auto"`` or ``"none"`` (the default: ``"auto"`` with tools, else ``"none"``)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice == "none":
            return choice
        if choice not in ("auto", "required"):
            raise bad_param("tool_choice", f"must be 'none', 'auto', 'required' or a named function, got {choice!r}")
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_param("tool_choice", 'a named tool choice is {"type": "function", "function": {"name": ...}}')
    else:
        raise bad_param("tool_choice", f"must be a string or an object, got {type_name(choice)}", "invalid_type")
    if not tools:
        raise bad_param("tool_choice", "a tool_choice other than 'none' needs tools (tools is missing or empty)")
    if choice == "auto":
        return choice
    what = "'required'" if choice == "required" else f"a named function ({choice['function']['name']!r})"
    raise bad_param("tool_choice", f"{what} is not supported: {_NO_CONSTRAINT}", "unsupported_value")

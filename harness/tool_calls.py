"""Tool calls parsed out of a model's answer text (pure).

The format is the one of the tiny model's chat template (``CHAT_TEMPLATE`` of
``fleetrl.actors.model.byte_tokenizer``), the Hermes/Qwen format most open models use::

    {content}<tool_call>{"name": "N", "arguments": {...}}</tool_call><tool_call>...</tool_call>

A block's body is a JSON object with ``name`` (a string) and ``arguments`` (an object,
or a JSON string holding one); whitespace around the JSON is allowed. The text before
the first block is the content (trailing whitespace dropped); only whitespace may
stand between and after blocks. The JSON is read with a JSON decoder rather than up
to the next ``</tool_call>``, so an argument string may contain that text.

An answer that does not follow the format (an unclosed block, a body that is not such
an object, text after a block) is not an error: the whole text comes back as content,
with no tool calls, and ``failed`` says what was wrong (the endpoint counts these).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from .chat import ToolCall
from .errors import HarnessError

__all__ = ["CLOSE", "OPEN", "ParsedAnswer", "parse_tool_calls"]

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ParsedAnswer:
    """An answer split into content and tool calls; ``failed``: why a tool-call block
    did not parse (then ``content`` is the whole text and ``tool_calls`` is empty)."""

    content: str
    tool_calls: tuple[ToolCall, ...]
    failed: str | None = None


class _Malformed(HarnessError):
    """A tool-call block that does not parse (internal: `parse_tool_calls` returns it as ``failed``)."""


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _call_body(text: str, at: int, number: int) -> tuple[str, str, int]:
    """(name, arguments JSON text, index after the closing tag) of the block whose body
    starts at ``at``."""
    at = _skip_space(text, at)
    try:
        body, at = _DECODER.raw_decode(text, at)
    except json.JSONDecodeError as e:
        raise _Malformed(f"tool call {number}: the body is not JSON ({e.msg})") from None
    if not isinstance(body, dict):
        raise _Malformed(f"tool call {number}: the body is not a JSON object")
    name, args = body.get("name"), body.get("arguments")
    if not isinstance(name, str) or not name:
        raise _Malformed(f"tool call {number}: no \"name\" string")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise _Malformed(f"tool call {number}: \"arguments\" is a string that is not JSON") from None
    if not isinstance(args, dict):
        raise _Malformed(f"tool call {number}: \"arguments\" is not a JSON object")
    at = _skip_space(text, at)
    if not text.startswith(CLOSE, at):
        raise _Malformed(f"tool call {number}: no {CLOSE} after the JSON body")
    return name, json.dumps(args, ensure_ascii=False), at + len(CLOSE)


def parse_tool_calls(text: str, *, make_id: Callable[[], str]) -> ParsedAnswer:
    """Split ``text`` into content and tool calls (see the module docstring); each call
    gets the id ``make_id()`` returns. Never raises on any text."""
    first = text.find(OPEN)
    if first < 0:
        return ParsedAnswer(text, ())
    found: list[tuple[str, str]] = []
    at = first
    try:
        while at < len(text):
            if not text.startswith(OPEN, at):
                raise _Malformed(f"text after tool call {len(found)}: {text[at:at + 40]!r}")
            name, args, at = _call_body(text, at + len(OPEN), len(found) + 1)
            found.append((name, args))
            at = _skip_space(text, at)
    except _Malformed as e:
        return ParsedAnswer(text, (), str(e))
    calls = tuple(ToolCall(id=make_id(), name=name, arguments=args) for name, args in found)
    return ParsedAnswer(text[:first].rstrip(), calls)

"""The chat layout of the real-size tokenizer: its added tokens and its chat template.

A ChatML-like layout of our own. Every turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``;
``<|im_end|>`` is the eos token, so it both closes a turn and ends a generation, and
there is no bos token (the template writes none, `HFChatTokenizer.bos_id` is None).
``<|endoftext|>`` separates documents and pads.

Tools and tool calls are written as the byte tokenizer's template writes them
(`byte_tokenizer.CHAT_TEMPLATE`), so `fleetrl.harness.tool_calls` parses a model's calls
back the same way: with ``tools`` the first turn is a system turn (the conversation's
own system message first, when it opens with one) listing each tool as one JSON line
under ``# Tools`` and ending with `byte_tokenizer.TOOL_INSTRUCTION`; an assistant's
calls follow its content as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks; a tool result is a ``tool`` turn.

``<tool_call>`` and ``</tool_call>`` are added tokens but not *special* ones: decoding
with ``skip_special_tokens=True`` (what the harness does with an answer) keeps them, so
the parser still sees the blocks, while ``<|im_end|>`` and the others are dropped.

The template is rendered by transformers' sandboxed jinja environment (trim_blocks,
lstrip_blocks) as vLLM renders it too, so no block tag is followed by a newline of the
text; it is assembled below from the token constants.
"""

from __future__ import annotations

from typing import Final

from .byte_tokenizer import TOOL_INSTRUCTION

__all__ = [
    "ADDED_TOKENS",
    "CHAT_TEMPLATE",
    "END_OF_TEXT",
    "IM_END",
    "IM_START",
    "SPECIAL_TOKENS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
]

END_OF_TEXT: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
TOOL_CALL_OPEN: Final = "<tool_call>"
TOOL_CALL_CLOSE: Final = "</tool_call>"

SPECIAL_TOKENS: Final[tuple[str, ...]] = (END_OF_TEXT, IM_START, IM_END)
"""Added tokens that ``skip_special_tokens`` drops when decoding."""
ADDED_TOKENS: Final[tuple[str, ...]] = (*SPECIAL_TOKENS, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
"""Every added token, in id order: they take the last ids of the vocabulary."""


def _turn(role: str) -> str:
    """The opening of a turn whose role is the jinja expression `role`."""
    return f"{IM_START}{role}\n"


CHAT_TEMPLATE: Final = (
    "{% if tools %}"
    + _turn("system")
    + "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    + TOOL_INSTRUCTION + IM_END + "\n"
    "{% endif %}"
    "{% for message in messages %}"
    # the system message was written into the tools turn above
    "{% if loop.first and tools and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    + _turn("assistant")
    + "{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] %}"
    "{% set arguments = call['function']['arguments'] %}"
    + TOOL_CALL_OPEN
    + '{"name": {{ call[\'function\'][\'name\'] | tojson }}, "arguments": '
    "{% if arguments is string %}{{ arguments }}{% else %}{{ arguments | tojson }}{% endif %}}"
    + TOOL_CALL_CLOSE
    + "{% endfor %}"
    + IM_END + "\n"
    "{% else %}"
    + _turn("{{ message['role'] }}")
    + "{{ message['content'] or '' }}" + IM_END + "\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + _turn("assistant") + "{% endif %}"
)
"""The chat template (see the module docstring)."""

"""Chat messages to token ids, and the token-exact incremental history of one attempt.

Pure: no I/O, no async. Both the OpenAI-compatible endpoint (`openai_api`) and the
built-in harnesses (`builtin`) turn messages into prompts here, so a conversation has
one tokenisation whichever way it reaches the model.

The chat layout
---------------
A prompt is the text of the model's own chat template (`ChatTokenizer.render`: for a
Hugging Face tokenizer, ``apply_chat_template(..., tokenize=False)``) encoded with
``encode``, which maps special-token text such as ``<eos>`` to its id. That is what
``apply_chat_template(..., tokenize=True)`` gives, and what vLLM's chat endpoint feeds
the same model. Messages reach the template as the dicts Hugging Face templates expect
(`template_messages`); ``tools`` is the request's ``tools`` array, unchanged.

Why reuse tokens
----------------
After the model answers, the client sends the whole conversation back with the answer
as an assistant message. Re-tokenising that text need not give the ids the model
produced (a merging tokenizer may split it differently; an answer cut by ``max_tokens``
may end inside a character; the template writes tool calls in its own JSON spelling).
Training on re-tokenised ids would train on tokens the sampler never produced, with
log-probabilities that do not belong to them. So `ChatHistory` keeps, for every call,
the exact ids of the prompt and of the generation and the template's text of the
prompt. A later call whose messages extend ``earlier messages + answer`` (same tools),
and whose template text starts with the earlier prompt's text followed by the answer's
turn, starts from those ids; only the text after the answer's closing eos token is
encoded. Anything else is tokenised from scratch, and the break is recorded with its
cause (`BREAK_CAUSES`): the attempt then has a new segment, never a stream trained
across text the template no longer contains.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import msgspec

__all__ = [
    "BREAK_CAUSES",
    "ChatMessage",
    "ChatTokenizer",
    "ChatHistory",
    "PromptPlan",
    "StopCut",
    "ToolCall",
    "cut_at_stop_strings",
    "same_message",
    "template_messages",
]


class ToolCall(msgspec.Struct, frozen=True):
    """A call of a tool in an assistant message."""

    id: str
    """``call_<24 hex>`` when fleetrl made it."""
    name: str
    arguments: str
    """The JSON text of the arguments object, as OpenAI sends it."""


class ChatMessage(msgspec.Struct, frozen=True):
    """One message: its role (system, developer, user, assistant, tool), its text ("" when
    it has none), an assistant's tool calls, and for a tool result the call it answers."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


@runtime_checkable
class ChatTokenizer(Protocol):
    """What the chat layout needs of a tokenizer.

    ``render`` is the chat template's text of a conversation. ``encode`` turns text into
    ids *without* adding special tokens; text that spells a special token (e.g.
    ``"<eos>"``) encodes to its id, as Hugging Face tokenizers do. ``decode`` turns ids
    into text, dropping special tokens. ``bos_id`` is None for tokenizers without a
    beginning-of-sequence token; ``eos_token`` is the text of ``eos_id``.
    """

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def eos_token(self) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[dict] | None,
               add_generation_prompt: bool) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """``messages`` as the dicts Hugging Face chat templates expect: ``role``,
    ``content``; ``tool_calls`` as ``[{"id", "type": "function", "function": {"name",
    "arguments"}}]`` with the arguments as an object when their JSON parses (templates
    write them with ``tojson``), else the text; ``tool_call_id`` and ``name`` when set."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _json_or_text(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _call_key(c: ToolCall) -> tuple[str, str, str]:
    args = _json_or_text(c.arguments)
    return c.id, c.name, json.dumps(args, sort_keys=True) if not isinstance(args, str) else "\0" + args


def same_message(a: ChatMessage, b: ChatMessage) -> bool:
    """Whether two messages are the same for the history: every field equal, tool-call
    arguments compared as parsed JSON (a client may re-serialise them)."""
    if a == b:
        return True
    return (a.role, a.content, a.tool_call_id, a.name, len(a.tool_calls)) == (
        b.role, b.content, b.tool_call_id, b.name, len(b.tool_calls)
    ) and all(_call_key(x) == _call_key(y) for x, y in zip(a.tool_calls, b.tool_calls))


def _same_messages(a: Sequence[ChatMessage], b: Sequence[ChatMessage]) -> bool:
    return len(a) == len(b) and all(same_message(x, y) for x, y in zip(a, b))


def _tools_key(tools: Sequence[dict] | None) -> str | None:
    """The tools of a call, comparable: None for no tools (or an empty list)."""
    return json.dumps(list(tools), sort_keys=True) if tools else None


# --------------------------------------------------------------------------- stop strings


@dataclass(frozen=True, slots=True)
class StopCut:
    """Where a generation ends once stop strings apply.

    ``n_tokens`` generated tokens are kept (through the token that completed the stop
    string); ``text`` is what the client sees (before the stop string); ``stop`` is
    the stop string found, or None; ``context_tokens`` is the number of generated
    tokens whose text is exactly ``text`` (so they can stand for the answer in a
    later prompt), or None when the stop string starts inside a token.
    """

    n_tokens: int
    text: str
    stop: str | None
    context_tokens: int | None


def cut_at_stop_strings(tok: ChatTokenizer, ids: Sequence[int], stops: Sequence[str]) -> StopCut:
    """Apply OpenAI-style stop strings to generated ``ids`` (decoded with ``tok``).

    The earliest occurrence of any stop string ends the answer: the text before it is
    returned, and the generation is cut after the token that completed it (the
    sampler produced that token, so it stays in the record: a token it produced after
    that did not reach the client and is dropped, like an engine that stops there).
    """
    full = tok.decode(ids)
    if not stops:
        return StopCut(len(ids), full, None, len(ids))
    hits = [(full.find(s), s) for s in stops if s and full.find(s) >= 0]
    if not hits:
        return StopCut(len(ids), full, None, len(ids))
    at, stop = min(hits)
    text = full[:at]
    through = full[: at + len(stop)]

    def reaches(k: int) -> bool:
        return tok.decode(ids[:k]).startswith(through)

    # the shortest prefix whose text holds the stop string: prefixes only grow, so
    # bisect (a scan would decode O(n) prefixes of O(n) tokens on the event loop)
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if reaches(mid):
            hi = mid
        else:
            lo = mid + 1
    n_tokens = lo
    # the longest prefix that spells exactly the answer (just before the stop's tokens)
    context: int | None = None
    for k in range(n_tokens, -1, -1):
        prefix = tok.decode(ids[:k])
        if prefix == text:
            context = k
            break
        if len(prefix) < len(text):  # shorter prefixes only get shorter
            break
    return StopCut(n_tokens, text, stop, context)


# --------------------------------------------------------------------------- history


BREAK_CAUSES: tuple[str, ...] = ("answer_rewritten", "history_rewritten", "history_truncated",
                                  "answer_not_reusable", "template_rewrote_history")
"""Why a chat call after the first did not extend an earlier call token for token (a
retokenisation break: the attempt continues in a new segment, trained with its own
context). Compared with the previous call:

- ``answer_rewritten``: the harness changed the model's answer (reformatted it, dropped
  its reasoning, changed a tool call);
- ``history_rewritten``: an earlier message changed, or the ``tools`` differ (the
  template writes them into the prompt);
- ``history_truncated``: fewer messages (a context-window trim);
- ``answer_not_reusable``: the answer was cut inside a token by a stop string, or the
  template does not close the answer's turn with the eos token;
- ``template_rewrote_history``: the messages extend the earlier call's, but the chat
  template renders the new conversation so that its text no longer starts with the
  earlier prompt followed by the answer's turn (e.g. a template that drops the
  reasoning of earlier turns)."""


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """How a call's prompt was built.

    ``ids``: the prompt. ``extends``: the index of the earlier call whose ids it starts
    with (its prompt and answer, or its prompt alone for a repeat), else None.
    ``reused``: how many leading ids came from that call. ``reason``: why the prompt
    was tokenised from scratch (None when it extends a call). ``cause``: for a call
    after the first that starts a new segment, the kind of break (one of
    `BREAK_CAUSES`); None for the first call and for a call that extends one.
    ``text``: the chat template's text of the conversation (with the generation
    prompt); ``tools``: the tools it was rendered with.
    """

    ids: list[int]
    extends: int | None
    reused: int
    reason: str | None
    cause: str | None = None
    text: str = ""
    tools: tuple[dict, ...] | None = None


@dataclass(frozen=True, slots=True)
class _Known:
    call: int
    prompt_messages: tuple[ChatMessage, ...]
    prompt_ids: tuple[int, ...]
    prompt_text: str  # the template's text of the prompt (T_k), with the generation prompt
    tools: str | None  # `_tools_key` of the call's tools
    answer: ChatMessage | None  # None: the answer cannot stand in a later prompt
    answer_ids: tuple[int, ...]  # the generated ids standing for it, through <eos>


@dataclass
class ChatHistory:
    """The token-exact history of one attempt's chat calls (see the module docstring)."""

    tokenizer: ChatTokenizer
    _known: list[_Known] = field(default_factory=list)

    def plan(self, messages: Sequence[ChatMessage], tools: Sequence[dict] | None = None) -> PromptPlan:
        """The prompt ids for a call with ``messages`` and ``tools``: the ids of the
        longest earlier ``messages + answer`` it extends (same tools, and the template's
        text agrees), else the template's text tokenised from scratch."""
        msgs = tuple(messages)
        key = _tools_key(tools)
        kept_tools = tuple(tools) if tools is not None else None
        candidates: list[tuple[int, _Known]] = []  # (messages covered, call)
        for k in reversed(self._known):
            if k.tools != key:
                continue
            if _same_messages(msgs, k.prompt_messages):
                return PromptPlan(list(k.prompt_ids), k.call, len(k.prompt_ids), None,
                                  text=k.prompt_text, tools=kept_tools)
            if k.answer is None:
                continue
            n = len(k.prompt_messages) + 1
            if (len(msgs) >= n and _same_messages(msgs[:n - 1], k.prompt_messages)
                    and same_message(msgs[n - 1], k.answer)):
                candidates.append((n, k))
        text = self.tokenizer.render(msgs, tools, True)
        first_miss: tuple[str, str] | None = None
        for n, k in sorted(candidates, key=lambda c: -c[0]):  # the longest first; stable: the latest first
            tail, miss = self._tail(k, msgs[:n], tools, text)
            if tail is not None:
                context = [*k.prompt_ids, *k.answer_ids]
                return PromptPlan([*context, *self.tokenizer.encode(tail)], k.call, len(context), None,
                                  text=text, tools=kept_tools)
            first_miss = first_miss or miss
        cause, reason = first_miss or self._why_not(msgs, key)
        return PromptPlan(self.tokenizer.encode(text), None, 0, reason, cause, text=text, tools=kept_tools)

    def _tail(self, k: _Known, upto: tuple[ChatMessage, ...], tools: Sequence[dict] | None,
              text: str) -> tuple[str | None, tuple[str, str] | None]:
        """The text that follows call ``k``'s answer in ``text`` (the template's text of
        the new conversation, whose first messages ``upto`` are k's prompt and answer),
        or None and (cause, reason) when the template's text does not extend k's."""
        rewrote = ("template_rewrote_history",
                   f"the chat template's text of the conversation does not extend that of call {k.call} "
                   "followed by its answer")
        if not text.startswith(k.prompt_text):
            return None, rewrote
        with_answer = self.tokenizer.render(upto, tools, False)
        if not with_answer.startswith(k.prompt_text):
            return None, rewrote
        # the answer's turn as the template writes it; its last eos token closes it (the
        # last, not the first: the answer's own text may spell the eos token)
        turn = with_answer[len(k.prompt_text):]
        eos = self.tokenizer.eos_token
        at = turn.rfind(eos)
        if not eos or at < 0:
            return None, ("answer_not_reusable",
                          f"the chat template does not close call {k.call}'s answer with {eos!r}")
        through = len(k.prompt_text) + at + len(eos)
        if not text.startswith(with_answer[:through]):
            return None, rewrote
        return text[through:], None

    def _why_not(self, msgs: tuple[ChatMessage, ...], tools: str | None) -> tuple[str | None, str]:
        """(cause, reason) of a prompt that extends no earlier call (see `BREAK_CAUSES`)."""
        if not self._known:
            return None, "first call of the attempt"
        k = self._known[-1]
        if k.tools != tools:
            return "history_rewritten", f"the tools differ from those of call {k.call}"
        expected = [*k.prompt_messages, *([k.answer] if k.answer is not None else [])]
        for i, (got, want) in enumerate(zip(msgs, expected)):
            if not same_message(got, want):
                if i == len(k.prompt_messages):
                    return "answer_rewritten", f"message {i} ({got.role}) differs from the answer of call {k.call}"
                return "history_rewritten", f"message {i} ({got.role}) differs from the conversation of call {k.call}"
        if len(msgs) < len(expected):
            return "history_truncated", (f"the conversation is shorter than that of call {k.call} "
                                         f"({len(msgs)} < {len(expected)} messages)")
        return "answer_not_reusable", f"call {k.call}'s answer cannot be reused (cut inside a token)"

    def add(
        self,
        call: int,
        messages: Sequence[ChatMessage],
        plan: PromptPlan,
        generated: Sequence[int],
        answer: ChatMessage,
        context_tokens: int | None,
    ) -> None:
        """Remember call ``call``: its prompt (as ``plan`` built it, with its text and
        tools), and the answer the client saw (its content and tool calls).

        ``context_tokens`` generated ids (a prefix of ``generated``) spell exactly the
        answer's text; None when no prefix does (the answer then cannot be reused).
        The answer's ids end with the eos token: the generated one when the model ended
        with it, else one is added (the template closes the answer's turn with it).
        """
        eos = self.tokenizer.eos_id
        kept_answer: ChatMessage | None = None
        answer_ids: tuple[int, ...] = ()
        if context_tokens is not None:
            kept = list(generated[:context_tokens])
            if len(generated) > context_tokens and generated[context_tokens] == eos:
                kept.append(eos)  # the <eos> that ended it
            elif not kept or kept[-1] != eos:
                kept.append(eos)
            kept_answer = answer
            answer_ids = tuple(kept)
        self._known.append(_Known(call, tuple(messages), tuple(plan.ids), plan.text, _tools_key(plan.tools),
                                  kept_answer, answer_ids))

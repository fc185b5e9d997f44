"""Chat messages to token ids, and the token-exact incremental history of one attempt.

Pure: no I/O, no async. Both the OpenAI-compatible endpoint (`openai_api`) and the
built-in harnesses (`builtin`) turn messages into prompts here, so a conversation has
one tokenisation whichever way it reaches the model.

The chat layout
---------------
The layout is the one of the tiny model's tokenizer (``CHAT_TEMPLATE`` of
``fleetrl.actors.model.byte_tokenizer``; tests check that both give the same ids)::

    <bos>                                  (when the tokenizer has one)
    <|{role}|>\\n{content}<eos>\\n           (each message)
    <|assistant|>\\n                        (the generation prompt)

``<bos>`` and ``<eos>`` are the tokenizer's special ids; everything else is text. Like
Hugging Face's ``apply_chat_template``, the text between two special tokens is encoded
as one run, so for a byte-level tokenizer the ids equal the template's exactly.

Why reuse tokens
----------------
After the model answers, the client sends the whole conversation back with the answer
as an assistant message. Re-tokenising that text need not give the ids the model
produced (a merging tokenizer may split it differently; an answer cut by ``max_tokens``
may end inside a character). Training on re-tokenised ids would train on tokens the
sampler never produced, with log-probabilities that do not belong to them. So
`ChatHistory` keeps, for every answer, the exact ids of the prompt and of the
generation, and a later call whose messages extend ``earlier messages + answer``
starts from those ids; only the new messages are tokenised. A call that extends
nothing is tokenised from scratch and the reason is recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import msgspec

__all__ = [
    "BREAK_CAUSES",
    "ChatMessage",
    "ChatTokenizer",
    "ChatHistory",
    "PromptPlan",
    "StopCut",
    "cut_at_stop_strings",
    "render_chat",
    "render_tail",
]


@runtime_checkable
class ChatTokenizer(Protocol):
    """What the chat layout needs of a tokenizer.

    ``encode`` turns text into ids *without* adding special tokens (text that spells a
    special token, e.g. ``"<eos>"``, may still encode to its id, as Hugging Face
    tokenizers do); ``decode`` turns ids into text, dropping special tokens.
    ``bos_id`` is None for tokenizers without a beginning-of-sequence token.
    """

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ChatMessage(msgspec.Struct, frozen=True):
    """One message as the layout sees it: a role and its text."""

    role: str
    content: str


def _pieces(messages: Sequence[ChatMessage], eos: int, *, leading_newline: bool) -> list[str | int]:
    out: list[str | int] = ["\n"] if leading_newline else []
    for m in messages:
        out.extend((f"<|{m.role}|>\n{m.content}", eos, "\n"))
    return out


def _encode_pieces(tok: ChatTokenizer, pieces: Sequence[str | int]) -> list[int]:
    """Encode text runs (adjacent strings joined) and keep special ids as they are."""
    ids: list[int] = []
    run: list[str] = []
    for p in pieces:
        if isinstance(p, str):
            run.append(p)
            continue
        if run:
            ids.extend(tok.encode("".join(run)))
            run = []
        ids.append(p)
    if run:
        ids.extend(tok.encode("".join(run)))
    return ids


def render_chat(tok: ChatTokenizer, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> list[int]:
    """The ids of ``messages`` in the chat layout, tokenised once from scratch."""
    pieces: list[str | int] = [] if tok.bos_id is None else [tok.bos_id]
    pieces += _pieces(messages, tok.eos_id, leading_newline=False)
    if add_generation_prompt:
        pieces.append("<|assistant|>\n")
    return _encode_pieces(tok, pieces)


def render_tail(tok: ChatTokenizer, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> list[int]:
    """The ids that follow a context ending with a message's ``<eos>``: the newline
    that closes that message, then ``messages``, then the generation prompt."""
    pieces = _pieces(messages, tok.eos_id, leading_newline=True)
    if add_generation_prompt:
        pieces.append("<|assistant|>\n")
    return _encode_pieces(tok, pieces)


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
                                  "answer_not_reusable")
"""Why a chat call after the first did not extend an earlier call token for token (a
retokenisation break: the attempt continues in a new segment, trained with its own
context): the harness changed the model's answer (``answer_rewritten``: reformatted,
reasoning dropped), rewrote earlier history (``history_rewritten``), sent fewer messages
(``history_truncated``: a context-window trim), or the answer was cut inside a token by
a stop string (``answer_not_reusable``)."""


@dataclass(frozen=True, slots=True)
class PromptPlan:
    """How a call's prompt was built.

    ``ids``: the prompt. ``extends``: the index of the earlier call whose ids it starts
    with (its prompt and answer, or its prompt alone for a repeat), else None.
    ``reused``: how many leading ids came from that call. ``reason``: why the prompt
    was tokenised from scratch (None when it extends a call). ``cause``: for a call
    after the first that starts a new segment, the kind of break (one of
    `BREAK_CAUSES`); None for the first call and for a call that extends one.
    """

    ids: list[int]
    extends: int | None
    reused: int
    reason: str | None
    cause: str | None = None


@dataclass(frozen=True, slots=True)
class _Known:
    call: int
    prompt_messages: tuple[ChatMessage, ...]
    prompt_ids: tuple[int, ...]
    answer: ChatMessage | None  # None: the answer cannot stand in a later prompt
    answer_ids: tuple[int, ...]  # the generated ids standing for it, through <eos>


@dataclass
class ChatHistory:
    """The token-exact history of one attempt's chat calls (see the module docstring)."""

    tokenizer: ChatTokenizer
    _known: list[_Known] = field(default_factory=list)

    def plan(self, messages: Sequence[ChatMessage]) -> PromptPlan:
        """The prompt ids for a call with ``messages``: reuse the longest earlier
        ``messages + answer`` it extends, else tokenise from scratch."""
        msgs = tuple(messages)
        best: tuple[int, list[int], int] | None = None  # (messages covered, ids, call)
        for k in reversed(self._known):
            if msgs == k.prompt_messages:
                return PromptPlan(list(k.prompt_ids), k.call, len(k.prompt_ids), None)
            if k.answer is None:
                continue
            n = len(k.prompt_messages) + 1
            if len(msgs) >= n and msgs[:n - 1] == k.prompt_messages and msgs[n - 1] == k.answer:
                if best is None or n > best[0]:
                    best = (n, [*k.prompt_ids, *k.answer_ids], k.call)
        if best is not None:
            n, context, call = best
            ids = context + render_tail(self.tokenizer, msgs[n:])
            return PromptPlan(ids, call, len(context), None)
        cause, reason = self._why_not(msgs)
        return PromptPlan(render_chat(self.tokenizer, msgs), None, 0, reason, cause)

    def _why_not(self, msgs: tuple[ChatMessage, ...]) -> tuple[str | None, str]:
        """(cause, reason) of a prompt that extends no earlier call (see `BREAK_CAUSES`)."""
        if not self._known:
            return None, "first call of the attempt"
        k = self._known[-1]
        expected = [*k.prompt_messages, *([k.answer] if k.answer is not None else [])]
        for i, (got, want) in enumerate(zip(msgs, expected)):
            if got != want:
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
        prompt_ids: Sequence[int],
        generated: Sequence[int],
        answer_text: str,
        context_tokens: int | None,
    ) -> None:
        """Remember call ``call``: its prompt, and the answer the client saw.

        ``context_tokens`` generated ids (a prefix of ``generated``) spell exactly
        ``answer_text``; None when no prefix does (the answer then cannot be reused).
        The answer's ids end with ``<eos>``: the generated one when the model ended
        with it, else one is added (the layout closes every message with it).
        """
        eos = self.tokenizer.eos_id
        answer: ChatMessage | None = None
        answer_ids: tuple[int, ...] = ()
        if context_tokens is not None:
            kept = list(generated[:context_tokens])
            if len(generated) > context_tokens and generated[context_tokens] == eos:
                kept.append(eos)  # the <eos> that ended it
            elif not kept or kept[-1] != eos:
                kept.append(eos)
            answer = ChatMessage("assistant", answer_text)
            answer_ids = tuple(kept)
        self._known.append(_Known(call, tuple(messages), tuple(prompt_ids), answer, answer_ids))

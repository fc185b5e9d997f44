"""Responses of the OpenAI-compatible endpoint, built from a recorded call (pure).

A call's `CallRecord` becomes OpenAI's response body (``chat.completion`` or
``text_completion``) or, for ``stream: true``, the list of server-sent events of its
chunks (``chat.completion.chunk`` / ``text_completion``) ending with ``data:
[DONE]``. The sampler protocol answers a request with a whole `Generation`, so the
chunks are cut from the finished text (`text_deltas`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .chat import ChatTokenizer
from .recording import CallRecord

__all__ = [
    "CALL_HEADER",
    "IGNORED_HEADER",
    "Reply",
    "chat_body",
    "chat_events",
    "chat_logprobs",
    "completion_body",
    "completion_events",
    "completion_logprobs",
    "response_headers",
    "sse",
    "text_deltas",
    "usage",
]

IGNORED_HEADER = "X-Fleetrl-Ignored-Params"
"""Response header naming the request parameters that were ignored (comma-separated)."""
CALL_HEADER = "X-Fleetrl-Call"
"""Response header: the index of the call in its attempt's record."""

_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class Reply:
    """What every body and chunk of one response repeats: its id, creation time
    (seconds since the epoch) and model name."""

    id: str
    created: int
    model: str


def finish_reason(rec: CallRecord) -> str:
    """OpenAI's finish reason of a call (an aborted generation reads as ``stop``)."""
    return rec.segment.finish_reason if rec.segment.finish_reason != "abort" else "stop"


def usage(rec: CallRecord) -> dict[str, int]:
    """OpenAI's ``usage`` of one call: prompt, generated and total tokens."""
    p = rec.segment.prompt_ids.shape[0]
    g = rec.segment.token_ids.shape[0]
    return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g}


def _token_text(tok: ChatTokenizer, i: int) -> str:
    return tok.decode([i])


def chat_logprobs(tok: ChatTokenizer, rec: CallRecord, top: int) -> dict[str, Any]:
    """A chat choice's ``logprobs``: each generated token with its log q^S and its
    ``top`` most likely alternatives (from the sampler's support)."""
    seg = rec.segment
    ids = seg.token_ids.to_numpy().tolist()
    lps = seg.logprobs.to_numpy().tolist()
    content = []
    for t, (i, lp) in enumerate(zip(ids, lps)):
        s_ids, s_lps = seg.support.row(t)
        tops = [{"token": (w := _token_text(tok, int(a))), "logprob": float(b), "bytes": list(w.encode())}
                for a, b in zip(s_ids[:top].tolist(), s_lps[:top].tolist())]
        text = _token_text(tok, i)
        content.append({"token": text, "logprob": float(lp), "bytes": list(text.encode()), "top_logprobs": tops})
    return {"content": content}


def completion_logprobs(tok: ChatTokenizer, rec: CallRecord, top: int) -> dict[str, Any]:
    """A completion choice's ``logprobs`` (the legacy shape): tokens, their log q^S,
    the ``top`` alternatives of each, and text offsets."""
    seg = rec.segment
    ids = seg.token_ids.to_numpy().tolist()
    tokens, offsets, tops = [], [], []
    at = 0
    for t, i in enumerate(ids):
        text = _token_text(tok, i)
        tokens.append(text)
        offsets.append(at)
        at += len(text)
        s_ids, s_lps = seg.support.row(t)
        tops.append({_token_text(tok, int(a)): float(b) for a, b in zip(s_ids[:top].tolist(), s_lps[:top].tolist())})
    return {"tokens": tokens, "token_logprobs": [float(x) for x in seg.logprobs.to_numpy().tolist()],
            "top_logprobs": tops if top else None, "text_offset": offsets}


def text_deltas(tok: ChatTokenizer, ids: Sequence[int], final: str, every: int = 8) -> list[str]:
    """Pieces of ``final`` in generation order (each a prefix's new text); they join to ``final``."""
    pieces: list[str] = []
    sent = ""
    for k in range(every, len(ids), every):
        prefix = tok.decode(ids[:k])
        if prefix.endswith("\ufffd") or not final.startswith(prefix) or len(prefix) <= len(sent):
            continue
        pieces.append(prefix[len(sent):])
        sent = prefix
    if len(final) > len(sent):
        pieces.append(final[len(sent):])
    return pieces


def sse(obj: object) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def response_headers(rec: CallRecord) -> dict[str, str]:
    """The headers of a call's response: its index (`CALL_HEADER`) and the ignored
    parameters (`IGNORED_HEADER`, when there are any, escaped to printable ASCII)."""
    h = {CALL_HEADER: str(rec.index)}
    if rec.ignored_params:
        # the names are the client's JSON keys: anything outside printable ASCII, and
        # spaces (which a header cannot carry, or not at its ends), is written as a
        # Python escape, e.g. \u65e5, \n or \x20
        h[IGNORED_HEADER] = ",".join(p.encode("unicode_escape").decode("ascii").replace(" ", "\\x20")
                                     for p in rec.ignored_params)
    return h


def _usage_chunk(reply: Reply, obj: str, rec: CallRecord) -> bytes:
    return sse({"id": reply.id, "object": obj, "created": reply.created, "model": reply.model,
                "choices": [], "usage": usage(rec)})


def chat_body(reply: Reply, rec: CallRecord, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """The ``chat.completion`` body of a call."""
    return {
        "id": reply.id, "object": "chat.completion", "created": reply.created, "model": reply.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": rec.text},
                     "logprobs": logprobs, "finish_reason": finish_reason(rec)}],
        "usage": usage(rec),
    }


def chat_events(reply: Reply, tok: ChatTokenizer, rec: CallRecord, logprobs: dict[str, Any] | None, *,
                include_usage: bool) -> list[bytes]:
    """The server-sent events of a streamed chat call: the role, the text's pieces,
    the finish (with the log-probabilities), the usage when asked, ``[DONE]``."""

    def chunk(delta: dict, finish: str | None, lp: object = None) -> bytes:
        return sse({"id": reply.id, "object": "chat.completion.chunk", "created": reply.created,
                    "model": reply.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]})

    events = [chunk({"role": "assistant", "content": ""}, None)]
    events += [chunk({"content": piece}, None) for piece in text_deltas(tok, rec.token_ids, rec.text)]
    events.append(chunk({}, finish_reason(rec), logprobs))
    if include_usage:
        events.append(_usage_chunk(reply, "chat.completion.chunk", rec))
    return [*events, _DONE]


def _text_choice(reply: Reply, text: str, finish: str | None, lp: object = None) -> dict[str, Any]:
    return {"id": reply.id, "object": "text_completion", "created": reply.created, "model": reply.model,
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}


def completion_body(reply: Reply, rec: CallRecord, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """The ``text_completion`` body of a call."""
    return {**_text_choice(reply, rec.text, finish_reason(rec), logprobs), "usage": usage(rec)}


def completion_events(reply: Reply, tok: ChatTokenizer, rec: CallRecord, logprobs: dict[str, Any] | None, *,
                      include_usage: bool) -> list[bytes]:
    """The server-sent events of a streamed completion call: the text's pieces, the
    finish (with the log-probabilities), the usage when asked, ``[DONE]``."""
    events = [sse(_text_choice(reply, piece, None)) for piece in text_deltas(tok, rec.token_ids, rec.text)]
    events.append(sse(_text_choice(reply, "", finish_reason(rec), logprobs)))
    if include_usage:
        events.append(_usage_chunk(reply, "text_completion", rec))
    return [*events, _DONE]

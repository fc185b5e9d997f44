"""Per-attempt records of model calls: what every call saw and produced, token-exactly.

Pure (no I/O). An `AttemptRecorder` is fed by whoever makes the calls (the
OpenAI-compatible endpoint or a built-in harness): it plans each chat prompt through
`chat.ChatHistory` (reusing earlier ids where the conversation extends an earlier
call) and records each answer as a `CallRecord`, whose `TokenSegment` is exactly the
wire record the trainer consumes (prompt ids, generated ids, the sampler's log q^S,
support, weight versions, sampler identity, finish reason). `AttemptRecorder.finish`
freezes everything into an `AttemptRecord`, which turns into a `Trajectory` once the
attempt is scored.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec
import numpy as np

from fleetrl.daemon.messages import Generation, TokenSegment, Trajectory
from fleetrl.daemon.protocol import Tensor

from .chat import ChatHistory, ChatMessage, ChatTokenizer, PromptPlan, ToolCall, cut_at_stop_strings
from .tool_calls import parse_tool_calls as _parse_tool_calls

__all__ = [
    "AttemptRecord",
    "AttemptRecorder",
    "CallKind",
    "CallRecord",
    "truncate_generation",
]

CallKind = Literal["chat", "completion"]


class CallRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One model call of an attempt.

    ``segment``: the prompt ids and the generated tokens with everything the trainer
    needs. ``extends``: index of the earlier call whose ids this prompt starts with
    (None: tokenised from scratch, a new segment of the conversation, and
    ``new_segment_reason`` says why). ``reused_tokens``: how many leading prompt ids
    were taken from that call. ``text``: the answer as the caller saw it (after stop
    strings; with parsed tool calls, the content before them). ``stop``: the stop
    string that ended it, if any. ``ignored_params``: request parameters that were
    ignored (unknown or unsupported). ``tool_calls``: the calls parsed from the answer
    (``record_chat(parse_tool_calls=True)``); ``tool_call_parse_failure``: why the
    answer's tool-call blocks did not parse (``text`` is then the whole answer).
    """

    index: int
    kind: CallKind
    segment: TokenSegment
    text: str
    extends: int | None = None
    reused_tokens: int = 0
    new_segment_reason: str | None = None
    break_cause: str | None = None
    """A chat call after the first that extends no earlier call: why (`chat.BREAK_CAUSES`)."""
    stop: str | None = None
    ignored_params: tuple[str, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_parse_failure: str | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.segment.prompt_ids.to_numpy().tolist()

    @property
    def token_ids(self) -> list[int]:
        return self.segment.token_ids.to_numpy().tolist()


class AttemptRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Every model call of one attempt, in the order the calls finished."""

    attempt_id: str
    task_id: str
    calls: tuple[CallRecord, ...] = ()

    @property
    def segments(self) -> tuple[TokenSegment, ...]:
        return tuple(c.segment for c in self.calls)

    @property
    def breaks(self) -> dict[str, int]:
        """Retokenisation breaks of the attempt, by cause (`chat.BREAK_CAUSES`)."""
        out: dict[str, int] = {}
        for c in self.calls:
            if c.break_cause is not None:
                out[c.break_cause] = out.get(c.break_cause, 0) + 1
        return out

    @property
    def tool_call_parse_failures(self) -> int:
        """Calls whose answer had tool-call blocks that did not parse."""
        return sum(c.tool_call_parse_failure is not None for c in self.calls)

    @property
    def n_new_segments(self) -> int:
        """Calls whose prompt was tokenised from scratch (the first one included)."""
        return sum(c.extends is None for c in self.calls)

    def trajectory(self, *, group_id: str, reward: float, metrics: Mapping[str, float] | None = None) -> Trajectory:
        """The `Trajectory` message of this attempt once scored."""
        return Trajectory(
            attempt_id=self.attempt_id,
            task_id=self.task_id,
            group_id=group_id,
            segments=self.segments,
            reward=float(reward),
            metrics=dict(metrics or {}),
        )


def truncate_generation(gen: Generation, n: int) -> Generation:
    """The first ``n`` generated tokens of ``gen`` (with their supports), unchanged
    otherwise; finish reason "stop" when tokens were dropped (a stop string ended it)."""
    total = gen.token_ids.shape[0]
    if not 0 <= n <= total:
        raise ValueError(f"truncate_generation: n={n} is outside [0, {total}]")
    if n == total:
        return gen
    support = gen.support.head(n)
    return msgspec.structs.replace(
        gen,
        token_ids=Tensor.from_numpy(gen.token_ids.to_numpy()[:n]),
        logprobs=Tensor.from_numpy(gen.logprobs.to_numpy()[:n]),
        versions=Tensor.from_numpy(gen.versions.to_numpy()[:n]),
        support=support,
        finish_reason="stop",
    )


def _ended_by(gen: Generation, stop: str | None) -> Generation:
    if stop is not None and gen.finish_reason != "stop":
        return msgspec.structs.replace(gen, finish_reason="stop")
    return gen


def _ids_tensor(ids: Sequence[int]) -> Tensor:
    return Tensor.from_numpy(np.asarray(ids, dtype=np.int64).reshape(-1))


class AttemptRecorder:
    """Records the calls of one attempt (mutable; one per attempt)."""

    def __init__(self, attempt_id: str, task_id: str, tokenizer: ChatTokenizer) -> None:
        self.attempt_id = attempt_id
        self.task_id = task_id
        self.tokenizer = tokenizer
        self.history = ChatHistory(tokenizer)
        self._calls: list[CallRecord] = []
        self._next_index = 0

    @property
    def calls(self) -> tuple[CallRecord, ...]:
        return tuple(self._calls)

    def plan_chat(self, messages: Sequence[ChatMessage], tools: Sequence[dict] | None = None) -> PromptPlan:
        """The prompt of a chat call with ``messages`` and ``tools`` (see `ChatHistory.plan`)."""
        return self.history.plan(messages, tools)

    def _call_id(self, index: int, j: int) -> str:
        """``call_<24 hex>``: the id of tool call ``j`` of call ``index``, unique in the
        attempt and reproducible (a hash of the attempt id and the position)."""
        return "call_" + hashlib.blake2b(f"{self.attempt_id}/{index}/{j}".encode(), digest_size=12).hexdigest()

    def _take_index(self) -> int:
        i = self._next_index
        self._next_index += 1
        return i

    def record_chat(
        self,
        messages: Sequence[ChatMessage],
        plan: PromptPlan,
        gen: Generation,
        *,
        stops: Sequence[str] = (),
        ignored_params: Sequence[str] = (),
        tools: Sequence[dict] | None = None,
        parse_tool_calls: bool = False,
    ) -> CallRecord:
        """Record the answer ``gen`` to a chat call planned as ``plan``; stop strings
        cut it (see `chat.cut_at_stop_strings`); with ``parse_tool_calls``, the answer's
        tool calls are parsed (`tool_calls.parse_tool_calls`). Returns the record.

        ``tools`` is accepted for symmetry with `plan_chat`; the tools the history
        remembers are those the plan was rendered with."""
        del tools  # the plan carries them
        generated = gen.token_ids.to_numpy().tolist()
        cut = cut_at_stop_strings(self.tokenizer, generated, stops)
        gen = _ended_by(truncate_generation(gen, cut.n_tokens), cut.stop)
        index = self._take_index()
        content, calls, failure = cut.text, (), None
        if parse_tool_calls:
            ids = itertools.count()
            parsed = _parse_tool_calls(cut.text, make_id=lambda: self._call_id(index, next(ids)))
            content, calls, failure = parsed.content, parsed.tool_calls, parsed.failed
        answer = ChatMessage("assistant", content, tool_calls=calls)
        self.history.add(index, messages, plan, generated[: cut.n_tokens], answer, cut.context_tokens)
        rec = CallRecord(
            index=index,
            kind="chat",
            segment=TokenSegment.from_generation(_ids_tensor(plan.ids), gen),
            text=content,
            extends=plan.extends,
            reused_tokens=plan.reused,
            new_segment_reason=plan.reason,
            break_cause=plan.cause,
            stop=cut.stop,
            ignored_params=tuple(ignored_params),
            messages=tuple(messages),
            tool_calls=calls,
            tool_call_parse_failure=failure,
        )
        self._calls.append(rec)
        return rec

    def record_completion(
        self,
        prompt_ids: Sequence[int],
        gen: Generation,
        *,
        stops: Sequence[str] = (),
        ignored_params: Sequence[str] = (),
    ) -> CallRecord:
        """Record a plain completion call (always its own segment)."""
        generated = gen.token_ids.to_numpy().tolist()
        cut = cut_at_stop_strings(self.tokenizer, generated, stops)
        gen = _ended_by(truncate_generation(gen, cut.n_tokens), cut.stop)
        rec = CallRecord(
            index=self._take_index(),
            kind="completion",
            segment=TokenSegment.from_generation(_ids_tensor(prompt_ids), gen),
            text=cut.text,
            new_segment_reason="completion call (a raw prompt, not a conversation)",
            stop=cut.stop,
            ignored_params=tuple(ignored_params),
        )
        self._calls.append(rec)
        return rec

    def finish(self) -> AttemptRecord:
        """Everything recorded so far, frozen."""
        return AttemptRecord(attempt_id=self.attempt_id, task_id=self.task_id, calls=tuple(self._calls))

"""One finished attempt -> an ATIF document (pure; `harness.atif` has the structs and the reader).

`atif_from_attempt(record, trajectory, task=...)` lays the attempt's model calls out as
ATIF steps. Each chat call contributes the messages of its prompt that the steps so far
do not hold (system / user steps; assistant messages it did not generate, e.g. a task's
conversation prefix, as agent steps with ``llm_call_count: 0``; tool results as the
``observation`` of the agent step that made the calls), then its answer as an agent
step with ``llm_call_count: 1`` whose ``metrics`` hold exactly what the trainer got
(`Trajectory.segments`): ``prompt_token_ids``, ``completion_token_ids``, ``logprobs``
(the sampler's log q^S of each generated token), token counts and ``cost_usd``, and, in
``metrics.extra.fleetrl``, the weight version of each token, the sampler identity, the
finish reason (and with ``support=True`` the sampler's support CSR, base64-packed:
`SupportCSR.to_json`).

A chat call whose prompt does not extend the steps so far (the harness rewrote its
history: a retokenisation break) repeats the shared start of the conversation as steps
marked ``is_copied_context`` and goes on from there, its first step marked
``extra.fleetrl.restart``; `atif.read_atif` restarts the conversation there. A completion call (a raw prompt) is a user step holding the
task's prompt for the first call and ``""`` after (its ids are in the agent step).

Root: ``session_id`` = the attempt id, ``extra.reward`` = the reward, ``extra.fleetrl``
= attempt, task and group ids, the trajectory's metrics, the weight versions and
samplers seen; ``extra.truncated`` when the last call ended at its token limit or was
aborted. docs/guides/atif.md maps every field.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from fleetrl.daemon.messages import TokenSegment, Trajectory

from .atif import (
    ATIF_VERSION,
    AtifAgent,
    AtifFinalMetrics,
    AtifMetrics,
    AtifObservation,
    AtifObservationResult,
    AtifStep,
    AtifToolCall,
    AtifTrajectory,
)
from .chat import ChatMessage, same_message
from .chat import ToolCall as ChatToolCall
from .recording import AttemptRecord, CallRecord
from .task_schema import Task

__all__ = ["atif_file_name", "atif_from_attempt", "encode_atif"]

_ENCODER = msgspec.json.Encoder()
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _no_constants(name: str) -> Any:
    raise ValueError(name)


def _arguments(raw: str) -> tuple[dict[str, Any], bool]:
    """The arguments object of a call's JSON text, and whether the reader's spelling of
    it (`json.dumps`) gives the text back exactly (else the text is kept beside it)."""
    try:
        parsed = json.loads(raw, parse_constant=_no_constants)
    except ValueError:
        return {}, False
    if not isinstance(parsed, dict):
        return {}, False
    return parsed, json.dumps(parsed, ensure_ascii=False) == raw


def _tool_calls(calls: Sequence[ChatToolCall], exact: dict[str, str]) -> list[AtifToolCall] | None:
    out = []
    for call in calls:
        args, same = _arguments(call.arguments)
        if not same:
            exact[call.id] = call.arguments
        out.append(AtifToolCall(tool_call_id=call.id, function_name=call.name, arguments=args))
    return out or None


def _prune(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None and v != {}}


class _Steps:
    """The steps being laid out, and the conversation they hold."""

    def __init__(self) -> None:
        self.steps: list[AtifStep] = []
        self.held: list[ChatMessage] = []
        self.answered: set[str] = set()
        self.restart = False

    def add(self, step: AtifStep) -> None:
        if self.restart:  # the first step of a rewritten conversation says so
            own = dict((step.extra or {}).get("fleetrl", {}), restart=True)
            step = msgspec.structs.replace(step, extra={**(step.extra or {}), "fleetrl": own})
            self.restart = False
        if step.source == "agent":
            self.answered = set()
        self.steps.append(msgspec.structs.replace(step, step_id=len(self.steps) + 1))

    def message(self, m: ChatMessage, *, copied: bool) -> None:
        """One prompt message as a step (or as an observation of the last agent step)."""
        copy = True if copied else None
        if m.role == "tool":
            follows = bool(self.held) and self.held[-1].role in ("assistant", "tool")  # not across a restart
            last = self.steps[-1] if self.steps and follows else None
            ids = {c.tool_call_id for c in (last.tool_calls or ())} if last is not None else set()
            if last is not None and last.source == "agent":
                known = m.tool_call_id in ids and m.tool_call_id not in self.answered
                result = AtifObservationResult(source_call_id=m.tool_call_id if known else None, content=m.content)
                if known:
                    self.answered.add(m.tool_call_id)
                results = [*(last.observation.results if last.observation else ()), result]
                self.steps[-1] = msgspec.structs.replace(last, observation=AtifObservation(results=results))
            else:  # no agent step to answer: the result stands alone (read back as a user message)
                self.add(AtifStep(step_id=0, source="user", message=m.content, is_copied_context=copy))
        elif m.role == "assistant":
            exact: dict[str, str] = {}
            calls = _tool_calls(m.tool_calls, exact)
            extra = {"fleetrl": {"arguments_text": exact}} if exact else None
            self.add(AtifStep(step_id=0, source="agent", message=m.content, tool_calls=calls, llm_call_count=0,
                              is_copied_context=copy, extra=extra))
        else:
            role = "system" if m.role in ("system", "developer") else "user"
            extra = {"fleetrl": {"role": m.role}} if m.role == "developer" else None
            self.add(AtifStep(step_id=0, source=role, message=m.content, is_copied_context=copy, extra=extra))
        self.held.append(m)

    def prompt(self, messages: Sequence[ChatMessage]) -> None:
        """The messages of a chat call's prompt that the steps do not hold yet."""
        k = 0
        while k < min(len(messages), len(self.held)) and same_message(messages[k], self.held[k]):
            k += 1
        if k < len(self.held):  # the history was rewritten: copy the shared start, go on from it
            self.held = []
            self.restart = True
            for m in messages[:k]:
                self.message(m, copied=True)
        for m in messages[k:]:
            self.message(m, copied=False)


def _metrics(seg: TokenSegment, *, support: bool) -> AtifMetrics:
    prompt = seg.prompt_ids.to_numpy().tolist()
    tokens = seg.token_ids.to_numpy().tolist()
    own: dict[str, Any] = {
        "weight_versions": seg.versions.to_numpy().tolist(),
        "sampler": msgspec.structs.asdict(seg.sampler),
        "finish_reason": seg.finish_reason,
    }
    if seg.sampling is not None:  # what the call was sampled with (its temperature scores its tokens)
        own["sampling"] = msgspec.structs.asdict(seg.sampling)
    if support:
        own["support"] = seg.support.to_json()
    return AtifMetrics(prompt_tokens=len(prompt), completion_tokens=len(tokens), cost_usd=float(seg.cost_usd),
                       prompt_token_ids=prompt, completion_token_ids=tokens,
                       logprobs=[float(x) for x in seg.logprobs.to_numpy().tolist()], extra={"fleetrl": own})


def _answer(call: CallRecord, seg: TokenSegment, *, support: bool) -> AtifStep:
    exact: dict[str, str] = {}
    calls = _tool_calls(call.tool_calls, exact)
    own = _prune({
        "call_index": call.index, "kind": call.kind, "extends": call.extends,
        "reused_tokens": call.reused_tokens or None, "new_segment_reason": call.new_segment_reason,
        "break_cause": call.break_cause, "stop": call.stop,
        "tool_call_parse_failure": call.tool_call_parse_failure, "arguments_text": exact,
    })
    return AtifStep(step_id=0, source="agent", message=call.text, tool_calls=calls, llm_call_count=1,
                    metrics=_metrics(seg, support=support), extra={"fleetrl": own})


def atif_from_attempt(record: AttemptRecord, trajectory: Trajectory, *, task: Task | None = None,
                      agent_name: str = "fleetrl", agent_version: str | None = None,
                      model_name: str | None = None, support: bool = False) -> AtifTrajectory:
    """The ATIF document of one scored attempt: ``record`` (what each call saw and said)
    and ``trajectory`` (what the trainer got: its segments, reward and metrics; the
    token arrays are taken from it). ``task``: the attempt's task (its prompt stands in
    for a completion call's prompt text). Raises ValueError when the two disagree on
    the number of calls."""
    if len(record.calls) != len(trajectory.segments):
        raise ValueError(f"the record has {len(record.calls)} calls, the trajectory {len(trajectory.segments)} "
                         "segments: not the same attempt")
    out = _Steps()
    for call, seg in zip(record.calls, trajectory.segments):
        if call.kind == "chat":
            out.prompt(call.messages)
        else:
            first = not out.steps and task is not None and task.prompt is not None
            out.held = []
            out.add(AtifStep(step_id=0, source="user", message=task.prompt if first else "",
                             extra={"fleetrl": {"prompt": "completion"}}))
        out.add(_answer(call, seg, support=support))
        out.held.append(ChatMessage("assistant", call.text, tool_calls=call.tool_calls))
    if not out.steps:  # an attempt that made no model call: its task's request alone
        text = task.prompt if task is not None and task.prompt is not None else ""
        out.add(AtifStep(step_id=0, source="user", message=text))
    segs = trajectory.segments
    versions = sorted({int(v) for s in segs for v in s.versions.to_numpy().tolist()})
    samplers = list({s.sampler.sampler_id: msgspec.structs.asdict(s.sampler) for s in segs}.values())
    extra: dict[str, Any] = {"reward": float(trajectory.reward)}
    if segs and segs[-1].finish_reason in ("length", "abort"):
        extra["truncated"] = True
    extra["fleetrl"] = _prune({"attempt_id": trajectory.attempt_id, "task_id": trajectory.task_id,
                               "group_id": trajectory.group_id, "metrics": dict(trajectory.metrics),
                               "weight_versions": versions or None, "samplers": samplers or None})
    return AtifTrajectory(
        schema_version=ATIF_VERSION,
        session_id=trajectory.attempt_id,
        agent=AtifAgent(name=agent_name, version=agent_version or _fleetrl_version(), model_name=model_name),
        steps=out.steps,
        final_metrics=AtifFinalMetrics(
            total_prompt_tokens=sum(s.prompt_ids.shape[0] for s in segs),
            total_completion_tokens=sum(s.token_ids.shape[0] for s in segs),
            total_cost_usd=float(sum(s.cost_usd for s in segs)),
            total_steps=len(out.steps)),
        extra=extra,
    )


def _fleetrl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetrl")
    except PackageNotFoundError:
        return "unknown"


def encode_atif(doc: AtifTrajectory) -> bytes:
    """The document as one line of JSON (UTF-8, non-ASCII kept), newline-terminated."""
    return _ENCODER.encode(doc) + b"\n"


def atif_file_name(attempt_id: str) -> str:
    """``<attempt id, unsafe characters as _>-<8 hex>.atif.json``: a file name for the
    attempt, distinct for distinct ids (the hex is a hash of the id)."""
    safe = _UNSAFE.sub("_", attempt_id).strip("._")[:96] or "attempt"
    return f"{safe}-{hashlib.blake2b(attempt_id.encode(), digest_size=4).hexdigest()}.atif.json"

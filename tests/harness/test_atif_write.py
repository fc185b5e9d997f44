"""Attempts -> ATIF: every agent step carries its call's prompt and completion ids,
log-probs, weight versions and sampler identity exactly as the `Trajectory`; writing an
attempt and reading the file back gives the attempt's conversation (Hypothesis over
conversations with tool calls, non-ASCII text and argument spellings), a rewritten
history restarts it, and a Harbor-style reader's rules (sequential ids, agent-only
fields, calls answered in their own step) hold for what is written."""

from __future__ import annotations

import json

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.daemon.examples import example_generation
from fleetrl.daemon.messages import SupportCSR, TokenSegment, Trajectory
from fleetrl.daemon.protocol import Tensor
from fleetrl.harness.atif import ATIF_VERSION, read_atif
from fleetrl.harness.atif_write import atif_file_name, atif_from_attempt, encode_atif
from fleetrl.harness.chat import ChatMessage
from fleetrl.harness.chat import ToolCall as ChatToolCall
from fleetrl.harness.recording import AttemptRecord, CallRecord
from fleetrl.harness.task_schema import Evaluator, FunctionCall, Message, Task, ToolCall


def segment(i: int, n_prompt: int = 5, n_tokens: int = 3, version: int = 7) -> TokenSegment:
    gen = example_generation(n_tokens, 2, vocab=259, version=version, seed=i)
    prompt = Tensor.from_numpy(np.arange(n_prompt, dtype=np.int64) + 10 * i)
    return TokenSegment.from_generation(prompt, gen)


def chat_call(i: int, prompt: list[ChatMessage], answer: ChatMessage, **kw) -> CallRecord:
    return CallRecord(index=i, kind="chat", segment=segment(i, **kw), text=answer.content,
                      messages=tuple(prompt), tool_calls=answer.tool_calls)


def attempt(calls: list[CallRecord], reward: float = 1.0) -> tuple[AttemptRecord, Trajectory]:
    record = AttemptRecord(attempt_id="t#0@env/1.1", task_id="t", calls=tuple(calls))
    return record, record.trajectory(group_id="t#0@env", reward=reward, metrics={"wall_s": 2.5})


def as_message(m: ChatMessage) -> Message:
    calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in m.tool_calls]
    return Message(role=m.role, content=m.content, tool_calls=calls or None, tool_call_id=m.tool_call_id)


def round_trip(record: AttemptRecord, trajectory: Trajectory):
    doc = atif_from_attempt(record, trajectory)
    r = read_atif(encode_atif(doc), "a.atif.json")
    assert r.problems == [], r.problems
    (session,) = r.sessions
    return doc, session


def check_harbor_rules(doc) -> None:
    """What Harbor's own validators check, on the encoded JSON."""
    raw = json.loads(encode_atif(doc))
    assert raw["schema_version"] == ATIF_VERSION and raw["agent"]["name"] and raw["agent"]["version"]
    for i, step in enumerate(raw["steps"]):
        assert step["step_id"] == i + 1
        assert step["source"] in ("system", "user", "agent")
        assert isinstance(step["message"], str)
        if step["source"] != "agent":
            assert not {"model_name", "reasoning_effort", "reasoning_content", "tool_calls", "metrics"} & step.keys()
        if step.get("llm_call_count") == 0:
            assert "metrics" not in step and "reasoning_content" not in step
        ids = {c["tool_call_id"] for c in step.get("tool_calls", ())}
        for result in step.get("observation", {}).get("results", ()):
            assert result.get("source_call_id") is None or result["source_call_id"] in ids
        for c in step.get("tool_calls", ()):
            assert isinstance(c["arguments"], dict)


def test_agent_steps_carry_the_trained_tokens_exactly():
    system, user = ChatMessage("system", "be brief"), ChatMessage("user", "sum 2+2")
    a1 = ChatMessage("assistant", "", tool_calls=(ChatToolCall("call_1", "python", '{"code": "2+2"}'),))
    t1 = ChatMessage("tool", "4", tool_call_id="call_1")
    a2 = ChatMessage("assistant", "It is 4.")
    record, traj = attempt([chat_call(0, [system, user], a1), chat_call(1, [system, user, a1, t1], a2)], reward=0.5)
    doc, session = round_trip(record, traj)
    check_harbor_rules(doc)
    agents = [s for s in doc.steps if s.source == "agent"]
    assert len(agents) == 2
    for step, seg in zip(agents, traj.segments):
        m = step.metrics
        assert m.prompt_token_ids == seg.prompt_ids.to_numpy().tolist()
        assert m.completion_token_ids == seg.token_ids.to_numpy().tolist()
        assert np.array_equal(np.asarray(m.logprobs, dtype=np.float32), seg.logprobs.to_numpy())
        own = m.extra["fleetrl"]
        assert own["weight_versions"] == seg.versions.to_numpy().tolist()
        assert own["sampler"] == msgspec.structs.asdict(seg.sampler) and own["finish_reason"] == seg.finish_reason
        assert own["sampling"] == msgspec.structs.asdict(seg.sampling) and seg.sampling is not None
        assert (m.prompt_tokens, m.completion_tokens) == (seg.prompt_ids.shape[0], seg.token_ids.shape[0])
        assert step.llm_call_count == 1
    assert doc.extra["reward"] == 0.5 and doc.session_id == "t#0@env/1.1"
    assert doc.extra["fleetrl"]["group_id"] == "t#0@env" and doc.extra["fleetrl"]["metrics"] == {"wall_s": 2.5}
    assert [s.source for s in doc.steps] == ["system", "user", "agent", "agent"]
    assert doc.steps[2].observation.results[0].source_call_id == "call_1"
    assert session.score == 0.5 and session.messages == [as_message(m) for m in (system, user, a1, t1, a2)]


def test_the_support_travels_when_asked():
    record, traj = attempt([chat_call(0, [ChatMessage("user", "x")], ChatMessage("assistant", "y"))])
    own = atif_from_attempt(record, traj, support=True).steps[1].metrics.extra["fleetrl"]
    seg = traj.segments[0]
    back = SupportCSR.from_json(json.loads(json.dumps(own["support"])))
    assert back.ids.to_numpy().tolist() == seg.support.ids.to_numpy().tolist()
    assert back.offsets.to_numpy().tolist() == seg.support.offsets.to_numpy().tolist()
    assert back.logprobs.to_numpy().tolist() == seg.support.logprobs.to_numpy().astype(np.float32).tolist()
    assert back.rule == seg.support.rule == own["support"]["rule"]


def test_a_rewritten_history_restarts_the_conversation():
    user = ChatMessage("user", "hello")
    first = ChatMessage("assistant", "hi there")
    rewritten = ChatMessage("assistant", "REWRITTEN")
    more = ChatMessage("user", "go on")
    last = ChatMessage("assistant", "done")
    record, traj = attempt([chat_call(0, [user], first), chat_call(1, [user, rewritten, more], last)])
    doc, session = round_trip(record, traj)
    check_harbor_rules(doc)
    assert session.messages == [as_message(m) for m in (user, rewritten, more, last)]
    copied = [s for s in doc.steps if s.is_copied_context]
    assert [s.message for s in copied] == ["hello"] and copied[0].extra["fleetrl"]["restart"] is True
    assert len([s for s in doc.steps if s.metrics is not None]) == 2  # both calls' tokens are kept


def test_a_prefix_assistant_turn_is_an_agent_step_without_a_call():
    prefix = [ChatMessage("user", "q"), ChatMessage("assistant", "recorded answer"), ChatMessage("user", "again")]
    record, traj = attempt([chat_call(0, prefix, ChatMessage("assistant", "new answer"))])
    doc, session = round_trip(record, traj)
    check_harbor_rules(doc)
    assert [(s.source, s.llm_call_count) for s in doc.steps] == [("user", None), ("agent", 0), ("user", None),
                                                                  ("agent", 1)]
    assert session.messages[-1] == Message(role="assistant", content="new answer")


def test_completion_calls_take_the_task_prompt():
    seg = segment(0)
    rec = CallRecord(index=0, kind="completion", segment=seg, text="    return x\n")
    record, traj = attempt([rec])
    task = Task(id="t", prompt="def f(x):\n", evaluator=Evaluator(command="true"))
    doc = atif_from_attempt(record, traj, task=task)
    (session,) = read_atif(encode_atif(doc), "c").sessions
    assert session.messages == [Message(role="user", content="def f(x):\n"),
                                Message(role="assistant", content="    return x\n")]


def test_file_names_are_safe_and_distinct():
    a, b = atif_file_name("t#0@env/1.1"), atif_file_name("t#0@env_1.1")
    assert a != b and "/" not in a and a.endswith(".atif.json") and a.startswith("t_0_env_1.1-")


# --------------------------------------------------------------------------- round trip

texts = st.text(max_size=12)
arg_texts = st.one_of(
    st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5)), max_size=3).map(
        lambda d: json.dumps(d, ensure_ascii=False)),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3).map(
        lambda d: json.dumps(d, separators=(",", ":"))),
    texts,  # not JSON at all: kept as the exact text
)


@st.composite
def conversations(draw):
    """The calls of one attempt whose prompts extend each other: each turn adds the
    answers to the previous calls' tool calls and some user/system messages."""
    calls = []
    held: list[ChatMessage] = []
    pending: tuple[ChatToolCall, ...] = ()
    for i in range(draw(st.integers(1, 4))):
        new = [ChatMessage("tool", draw(texts), tool_call_id=c.id) for c in pending]
        roles = draw(st.lists(st.sampled_from(["user", "system"]), min_size=0 if new else 1, max_size=2))
        new += [ChatMessage(role, draw(texts)) for role in roles]
        prompt = held + new
        n_calls = draw(st.integers(0, 2))
        tool_calls = tuple(ChatToolCall(f"call_{i}_{j}", draw(st.text(min_size=1, max_size=6)), draw(arg_texts))
                           for j in range(n_calls))
        answer = ChatMessage("assistant", draw(texts), tool_calls=tool_calls)
        calls.append(chat_call(i, prompt, answer, n_tokens=draw(st.integers(0, 3))))
        held = prompt + [answer]
        pending = tool_calls
    return calls, held


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(), st.floats(0.0, 1.0))
def test_write_then_read_gives_back_the_conversation(conv, reward):
    calls, held = conv
    record, traj = attempt(calls, reward=reward)
    doc, session = round_trip(record, traj)
    check_harbor_rules(doc)
    assert session.messages == [as_message(m) for m in held]
    assert session.score == reward and session.id == record.attempt_id
    agents = [s for s in doc.steps if s.llm_call_count == 1]
    assert [s.metrics.completion_token_ids for s in agents] == [s.token_ids.to_numpy().tolist()
                                                                 for s in traj.segments]


pool = st.sampled_from([ChatMessage("user", "a"), ChatMessage("user", "b"), ChatMessage("system", "s"),
                        ChatMessage("assistant", "x"), ChatMessage("assistant", "ü ✓")])


@st.composite
def rewriting_attempts(draw):
    """Calls whose prompts may extend, cut or rewrite the conversation so far."""
    calls = []
    held: list[ChatMessage] = []
    for i in range(draw(st.integers(1, 5))):
        keep = draw(st.integers(0, len(held)))
        prompt = held[:keep] + draw(st.lists(pool, min_size=0 if keep else 1, max_size=3))
        answer = ChatMessage("assistant", draw(texts), tool_calls=tuple(
            ChatToolCall(f"c{i}_{j}", "f", "{}") for j in range(draw(st.integers(0, 1)))))
        calls.append(chat_call(i, prompt, answer))
        held = prompt + [answer]
    return calls


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rewriting_attempts())
def test_a_rewritten_history_reads_back_as_the_last_calls_conversation(calls):
    record, traj = attempt(calls)
    doc, session = round_trip(record, traj)
    check_harbor_rules(doc)
    last = calls[-1]
    answer = ChatMessage("assistant", last.text, tool_calls=last.tool_calls)
    assert session.messages == [as_message(m) for m in (*last.messages, answer)]
    assert len([s for s in doc.steps if s.llm_call_count == 1]) == len(calls)  # every call's tokens are kept

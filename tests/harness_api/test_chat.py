"""The chat template, stop strings and the token-exact history (pure; fake model)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from fakes import ASCII, FakeModel, PairTokenizer

from fleetrl.daemon.messages import ROLLOUTS, SamplingParams
from fleetrl.harness.chat import BREAK_CAUSES, ChatMessage, ToolCall, cut_at_stop_strings, template_messages
from fleetrl.harness.model import HFChatTokenizer, RecordedModel
from fleetrl.harness.recording import AttemptRecorder, truncate_generation

ROLES = ["system", "user", "assistant", "tool"]
texts = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
tool_calls_st = st.lists(st.builds(
    ToolCall, st.text(alphabet="abc0123456789_", min_size=1, max_size=8), st.text(min_size=1, max_size=10),
    st.dictionaries(st.text(max_size=5), json_values, max_size=3).map(json.dumps) | texts,
), max_size=2).map(tuple)
message_st = st.one_of(
    st.builds(ChatMessage, st.sampled_from(ROLES), texts),
    st.builds(ChatMessage, st.just("assistant"), texts, tool_calls=tool_calls_st),
    st.builds(ChatMessage, st.just("tool"), texts, tool_call_id=st.text(max_size=8)),
)
messages_st = st.lists(message_st, min_size=1, max_size=6)
TOOLS = [{"type": "function", "function": {"name": "run", "description": "Run a shell command.",
                                              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                                                             "required": ["cmd"]}}}]
tools_st = st.none() | st.just(TOOLS)


def scratch(tok, messages, tools=None, gen_prompt=True) -> list[int]:
    """The conversation's ids tokenised once from the template's text."""
    return tok.encode(tok.render(messages, tools, gen_prompt))


@settings(max_examples=60, deadline=None)
@given(messages=messages_st, tools=tools_st, gen_prompt=st.booleans())
def test_ids_are_those_of_apply_chat_template(hf_tokenizer, tok, messages, tools, gen_prompt):
    ours = scratch(tok, messages, tools, gen_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        template_messages(messages), tools=tools, add_generation_prompt=gen_prompt, tokenize=True, return_dict=False,
    )
    assert ours == list(theirs)


@settings(max_examples=60, deadline=None)
@given(messages=st.lists(st.builds(ChatMessage, st.sampled_from(ROLES), texts), min_size=1, max_size=6),
       gen_prompt=st.booleans())
def test_without_tools_the_layout_is_the_plain_one(tok, messages, gen_prompt):
    """The template's text without tools is the plain layout the tiny models were trained on."""
    plain = "<bos>" + "".join(f"<|{m.role}|>\n{m.content}<eos>\n" for m in messages)
    assert tok.render(messages, None, gen_prompt) == plain + ("<|assistant|>\n" if gen_prompt else "")
    assert tok.render(messages, [], gen_prompt) == tok.render(messages, None, gen_prompt)


def test_layout_spelled_out(tok):
    ids = scratch(tok, [ChatMessage("user", "hi")])
    assert ids == [tok.bos_id, *b"<|user|>\nhi", tok.eos_id, *b"\n<|assistant|>\n"]
    assert tok.encode("<bos>a<eos>") == [tok.bos_id, ord("a"), tok.eos_id]


def test_tool_layout_spelled_out(tok):
    msgs = [ChatMessage("system", "S"), ChatMessage("user", "U"),
            ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "run", '{"cmd": "ls"}'),)),
            ChatMessage("tool", "out", tool_call_id="call_1")]
    assert tok.render(msgs, TOOLS, True) == (
        "<bos><|system|>\nS\n\n# Tools\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n"
        'To call a tool, answer <tool_call>{"name": ..., "arguments": {...}}</tool_call><eos>\n'
        "<|user|>\nU<eos>\n"
        '<|assistant|>\n<tool_call>{"name": "run", "arguments": {"cmd": "ls"}}</tool_call><eos>\n'
        "<|tool|>\nout<eos>\n<|assistant|>\n")


def test_a_tokenizer_without_a_chat_template_is_refused():
    from fleetrl.actors.model import build_byte_tokenizer

    hf = build_byte_tokenizer()
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        HFChatTokenizer(hf)


async def _converse(model, recorder, turns: int, max_tokens: int = 12):
    rm = RecordedModel(model, recorder)
    messages = [ChatMessage("system", "be brief"), ChatMessage("user", "start")]
    for i in range(turns):
        call = await rm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=1.0))
        messages += [ChatMessage("assistant", call.text), ChatMessage("user", f"turn {i} é ok")]
    return messages[:-1]


async def test_twenty_turns_are_token_exact_with_one_tokenisation(tok):
    # short max_tokens: several answers end by length (no <eos>), others with <eos>
    model = FakeModel(tok, seed=5, alphabet=ASCII)
    recorder = AttemptRecorder("a1", "t1", tok)
    final = await _converse(model, recorder, 20, max_tokens=9)
    record = recorder.finish()
    assert len(record.calls) == 20
    assert {c.segment.finish_reason for c in record.calls} == {"stop", "length"}
    for i, call in enumerate(record.calls):
        assert call.prompt_ids == model.prompts[i]
        # each prompt equals the whole conversation so far tokenised once
        assert call.prompt_ids == scratch(tok, call.messages)
        if i:
            prev = record.calls[i - 1]
            assert call.extends == i - 1 and call.new_segment_reason is None
            before = [*prev.prompt_ids, *prev.token_ids]
            assert call.prompt_ids[: len(before)] == before
            assert call.reused_tokens == len(before) + (prev.segment.finish_reason == "length")
    assert record.calls[0].new_segment_reason == "first call of the attempt"
    last = record.calls[-1]
    whole = scratch(tok, final, gen_prompt=False)
    tail = last.token_ids if last.token_ids[-1:] == [tok.eos_id] else [*last.token_ids, tok.eos_id]
    assert whole == [*last.prompt_ids, *tail, *tok.encode("\n")]


async def test_an_answer_cut_inside_a_character_keeps_its_bytes(tok):
    # the model's bytes end in the middle of "é": the text the client sees (and sends
    # back) ends with U+FFFD, which re-tokenises to other bytes; reuse keeps the real ones
    model = FakeModel(tok, replies=["ok \u00e9"])
    recorder = AttemptRecorder("a", "t", tok)
    rm = RecordedModel(model, recorder)
    c0 = await rm.chat([ChatMessage("user", "q")], SamplingParams(max_tokens=4))
    assert c0.token_ids == [*b"ok ", 0xC3] and c0.text == "ok \ufffd" and c0.segment.finish_reason == "length"
    nxt = [ChatMessage("user", "q"), ChatMessage("assistant", c0.text), ChatMessage("user", "go on")]
    plan = recorder.plan_chat(nxt)
    assert plan.extends == 0
    assert plan.ids[: plan.reused] == [*c0.prompt_ids, *b"ok ", 0xC3, tok.eos_id]
    assert plan.ids != scratch(tok, nxt)


async def test_reuse_keeps_the_models_ids_where_retokenising_would_drift():
    tok = PairTokenizer()  # encodes "ab" as one token, 258
    gen_ids = [ord("x"), ord("a"), ord("b"), tok.eos_id]  # the model spelled "ab" in two tokens
    model = FakeModel(tok, replies=[gen_ids, "ok"])
    recorder = AttemptRecorder("a", "t", tok)
    rm = RecordedModel(model, recorder)
    q = [ChatMessage("user", "q")]
    c0 = await rm.chat(q, SamplingParams(max_tokens=8))
    assert c0.token_ids == gen_ids and c0.text == "xab"
    nxt = [*q, ChatMessage("assistant", "xab"), ChatMessage("user", "more")]
    c1 = await rm.chat(nxt, SamplingParams(max_tokens=8))
    assert c1.extends == 0 and c1.prompt_ids[: len(c0.prompt_ids) + 4] == [*c0.prompt_ids, *gen_ids]
    once = scratch(tok, nxt)
    assert c1.prompt_ids != once and 258 in once  # tokenising once would have merged "ab"
    assert c1.prompt_ids == [*c0.prompt_ids, *gen_ids, *tok.encode("\n<|user|>\nmore"), tok.eos_id,
                             *tok.encode("\n<|assistant|>\n")]


async def test_a_call_that_does_not_extend_the_history_starts_a_new_segment(tok):
    model = FakeModel(tok, replies=["one", "two", "three", "four"])
    recorder = AttemptRecorder("a", "t", tok)
    rm = RecordedModel(model, recorder)
    p = SamplingParams(max_tokens=20)
    base = [ChatMessage("user", "hello")]
    c0 = await rm.chat(base, p)
    # edited answer: does not extend
    c1 = await rm.chat([*base, ChatMessage("assistant", "ONE"), ChatMessage("user", "x")], p)
    assert c1.extends is None and "message 1 (assistant) differs from the answer of call 0" in c1.new_segment_reason
    assert c1.prompt_ids == scratch(tok, c1.messages)
    # a fresh conversation
    c2 = await rm.chat([ChatMessage("user", "other")], p)
    assert c2.extends is None and "message 0 (user) differs" in c2.new_segment_reason
    # an exact repeat of call 0's messages reuses its prompt
    c3 = await rm.chat(base, p)
    assert c3.extends == 0 and c3.prompt_ids == c0.prompt_ids and c3.reused_tokens == len(c0.prompt_ids)
    assert recorder.finish().n_new_segments == 3
    # breaks are counted by cause; the first call and a call that extends are no break
    assert [c.break_cause for c in (c0, c1, c2, c3)] == [None, "answer_rewritten", "history_rewritten", None]
    assert recorder.finish().breaks == {"answer_rewritten": 1, "history_rewritten": 1}


async def test_a_shorter_conversation_is_a_truncation_break(tok):
    """Fewer messages than the previous call sent, and no repeat or extension of any
    earlier call: a ``history_truncated`` break (a context-window trim)."""
    model = FakeModel(tok, replies=["one", "two", "three"])
    recorder = AttemptRecorder("a", "t", tok)
    rm = RecordedModel(model, recorder)
    p = SamplingParams(max_tokens=20)
    system, hello = ChatMessage("system", "be brief"), ChatMessage("user", "hello")
    await rm.chat([system, hello], p)
    c1 = await rm.chat([system, hello, ChatMessage("assistant", "one"), ChatMessage("user", "go")], p)
    assert c1.extends == 0 and c1.break_cause is None
    trimmed = await rm.chat([system], p)
    assert trimmed.extends is None and trimmed.break_cause == "history_truncated", trimmed.new_segment_reason
    assert recorder.finish().breaks == {"history_truncated": 1}
    assert set(recorder.finish().breaks) <= set(BREAK_CAUSES)


def test_stop_strings_cut_text_and_tokens(tok):
    ids = tok.encode("hello STOP world")
    cut = cut_at_stop_strings(tok, ids, ["STOP", "wor"])
    assert cut.text == "hello " and cut.stop == "STOP"
    assert cut.n_tokens == len("hello STOP") and cut.context_tokens == len("hello ")
    none = cut_at_stop_strings(tok, ids, ["zzz"])
    assert none.text == "hello STOP world" and none.stop is None and none.n_tokens == len(ids)


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet="ab\né", max_size=30), stops=st.lists(st.text(alphabet="ab\né", min_size=1, max_size=3), max_size=3))
def test_stop_string_invariants(tok, text, stops):
    ids = tok.encode(text)
    cut = cut_at_stop_strings(tok, ids, stops)
    found = [text.find(s) for s in stops if s in text]
    if not found:
        assert cut.text == text and cut.n_tokens == len(ids)
        return
    at = min(found)
    assert cut.text == text[:at]
    assert tok.decode(ids[: cut.context_tokens]) == cut.text
    kept = tok.decode(ids[: cut.n_tokens])
    assert cut.stop is not None and kept.startswith(cut.text + cut.stop)
    assert not tok.decode(ids[: cut.n_tokens - 1]).startswith(cut.text + cut.stop)


async def test_stop_string_answer_is_reused_without_the_stop(tok):
    model = FakeModel(tok, replies=["abc\nEND junk"])
    recorder = AttemptRecorder("a", "t", tok)
    rm = RecordedModel(model, recorder)
    c0 = await rm.chat([ChatMessage("user", "q")], SamplingParams(max_tokens=40), stop=["\nEND"])
    assert c0.text == "abc" and c0.stop == "\nEND" and c0.segment.finish_reason == "stop"
    assert tok.decode(c0.token_ids) == "abc\nEND"  # tokens through the stop string are kept
    plan = recorder.plan_chat([ChatMessage("user", "q"), ChatMessage("assistant", "abc"), ChatMessage("user", "n")])
    assert plan.extends == 0
    assert plan.ids == scratch(tok, [ChatMessage("user", "q"), ChatMessage("assistant", "abc"), ChatMessage("user", "n")])


async def test_records_make_valid_trajectories(tok):
    model = FakeModel(tok, seed=2)
    recorder = AttemptRecorder("att", "task", tok)
    await _converse(model, recorder, 3)
    traj = recorder.finish().trajectory(group_id="g", reward=0.5, metrics={"turns": 3.0})
    back = ROLLOUTS.decode(ROLLOUTS.encode(traj))
    assert back == traj and len(back.segments) == 3 and back.oldest_version == 3


async def test_truncate_generation_keeps_the_support_aligned(tok):
    gen = await FakeModel(tok, seed=9, p_eos=0.0).generate([tok.bos_id], SamplingParams(max_tokens=10))
    cut = truncate_generation(gen, 4)
    assert cut.token_ids.to_numpy().tolist() == gen.token_ids.to_numpy().tolist()[:4]
    for i in range(4):
        a, b = cut.support.row(i), gen.support.row(i)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert cut.finish_reason == "stop" and truncate_generation(gen, 10) is gen
    with pytest.raises(ValueError, match="outside"):
        truncate_generation(gen, 11)
    assert cut.versions.shape == (4,) and cut.support.positions == 4


async def test_recorded_model_always_stops_at_eos(tok):
    model = FakeModel(tok, seed=1)
    rm = RecordedModel(model, AttemptRecorder("a", "t", tok))
    with trio.fail_after(5):
        await rm.chat([ChatMessage("user", "x")], SamplingParams(max_tokens=5, stop_ids=(7,)))
    assert model.params[0].stop_ids == (7, tok.eos_id)


def test_the_documented_layout_is_the_one_rendered(tok):
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "openai-endpoint.md").read_text()
    line = "<bos><|system|>\\n{content}<eos>\\n<|user|>\\n{content}<eos>\\n<|assistant|>\\n"
    assert line in doc
    ids = scratch(tok, [ChatMessage("system", "S"), ChatMessage("user", "U")])
    expected = line.replace("\\n", "\n").replace("<bos>", "").replace("<eos>", "\x00")
    expected = expected.replace("{content}", "S", 1).replace("{content}", "U", 1)
    want = [tok.bos_id] + [tok.eos_id if b == 0 else b for b in expected.encode()]
    assert ids == want


# --------------------------------------------------------------------------- tool calls


def _sent_back(rec, *, spacing: bool = False) -> ChatMessage:
    """The assistant message a client sends back for ``rec`` (arguments re-serialised
    with other spacing when ``spacing``, as clients may)."""
    calls = tuple(ToolCall(c.id, c.name, json.dumps(json.loads(c.arguments), indent=1) if spacing else c.arguments)
                  for c in rec.tool_calls)
    return ChatMessage("assistant", rec.text, tool_calls=calls)


@pytest.mark.parametrize("spelling", ["template", "other"])
async def test_a_tool_conversation_is_one_stream(hf_tokenizer, tok, spelling):
    """Assistant tool call, tool result, next call, answer: one stream, each prompt
    starting with the previous prompt and the generated ids, token for token. When the
    model spells the call as the template does, that is also the from-scratch tokenisation."""
    call = ('<tool_call>{"name": "run", "arguments": {"cmd": "cat a.txt"}}</tool_call>' if spelling == "template"
            else 'Let me look.\n<tool_call>\n{"name":"run", "arguments":"{\\"cmd\\":\\"cat a.txt\\"}"}\n</tool_call>\n')
    model = FakeModel(tok, replies=[call, "the answer is 4", "bye"])
    recorder = AttemptRecorder("a", "t", tok)
    rm = RecordedModel(model, recorder)
    p = SamplingParams(max_tokens=200)
    msgs = [ChatMessage("system", "use the tools"), ChatMessage("user", "what is in a.txt?")]
    c0 = await rm.chat(msgs, p, tools=TOOLS, parse_tool_calls=True)
    assert c0.prompt_ids == list(hf_tokenizer.apply_chat_template(
        template_messages(msgs), tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert [(c.name, json.loads(c.arguments)) for c in c0.tool_calls] == [("run", {"cmd": "cat a.txt"})]
    assert c0.tool_calls[0].id.startswith("call_") and len(c0.tool_calls[0].id) == 5 + 24
    assert c0.text == ("" if spelling == "template" else "Let me look.") and c0.tool_call_parse_failure is None
    msgs += [_sent_back(c0, spacing=True), ChatMessage("tool", "2 + 2", tool_call_id=c0.tool_calls[0].id)]
    c1 = await rm.chat(msgs, p, tools=TOOLS, parse_tool_calls=True)
    assert c1.extends == 0 and c1.break_cause is None and c1.tool_calls == ()
    assert c1.prompt_ids[: len(c0.prompt_ids) + len(c0.token_ids)] == [*c0.prompt_ids, *c0.token_ids]
    assert c1.prompt_ids[len(c0.prompt_ids) + len(c0.token_ids):] == [
        *b"\n<|tool|>\n2 + 2", tok.eos_id, *b"\n<|assistant|>\n"]
    assert (c1.prompt_ids == scratch(tok, msgs, TOOLS)) == (spelling == "template")
    msgs += [_sent_back(c1), ChatMessage("user", "thanks")]
    c2 = await rm.chat(msgs, p, tools=TOOLS)
    assert c2.extends == 1 and c2.prompt_ids[: len(c1.prompt_ids) + len(c1.token_ids)] == [*c1.prompt_ids, *c1.token_ids]
    record = recorder.finish()
    assert record.breaks == {} and record.n_new_segments == 1 and record.tool_call_parse_failures == 0


async def test_a_malformed_tool_call_comes_back_as_content_and_is_counted(tok):
    bad = '<tool_call>{"name": "run", "arguments": {"cmd": </tool_call>'
    model = FakeModel(tok, replies=[bad, "fine"])
    recorder = AttemptRecorder("a", "t", tok)
    rm = RecordedModel(model, recorder)
    q = [ChatMessage("user", "go")]
    c0 = await rm.chat(q, SamplingParams(max_tokens=200), tools=TOOLS, parse_tool_calls=True)
    assert c0.text == bad and c0.tool_calls == () and "not JSON" in c0.tool_call_parse_failure
    assert recorder.finish().tool_call_parse_failures == 1
    c1 = await rm.chat([*q, ChatMessage("assistant", bad), ChatMessage("user", "again")], SamplingParams(max_tokens=20),
                       tools=TOOLS, parse_tool_calls=True)
    assert c1.extends == 0


async def test_a_changed_tool_call_or_changed_tools_break_the_stream(tok):
    call = '<tool_call>{"name": "run", "arguments": {"cmd": "ls"}}</tool_call>'
    model = FakeModel(tok, replies=[call, "x", "y"])
    recorder = AttemptRecorder("a", "t", tok)
    rm = RecordedModel(model, recorder)
    p = SamplingParams(max_tokens=200)
    q = [ChatMessage("user", "go")]
    c0 = await rm.chat(q, p, tools=TOOLS, parse_tool_calls=True)
    (tc,) = c0.tool_calls
    edited = ChatMessage("assistant", "", tool_calls=(ToolCall(tc.id, tc.name, '{"cmd": "ls -l"}'),))
    c1 = await rm.chat([*q, edited, ChatMessage("tool", "out", tool_call_id=tc.id)], p, tools=TOOLS)
    assert c1.break_cause == "answer_rewritten"
    c2 = await rm.chat([*q, _sent_back(c0), ChatMessage("tool", "out", tool_call_id=tc.id)], p, tools=TOOLS[:0])
    assert c2.break_cause == "history_rewritten" and "tools differ" in c2.new_segment_reason
    assert set(recorder.finish().breaks) <= set(BREAK_CAUSES)


# A template that drops the content of earlier assistant turns (as templates that drop
# earlier reasoning do): the answer's turn as rendered when it was last is not in the
# text of the longer conversation.
FORGETFUL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' and not loop.last %}<|assistant|>\n(earlier){{ eos_token }}\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# A template whose header counts the messages: no prompt is a prefix of a later one.
COUNTING = ("{{ bos_token }}({{ messages | length }})\n{% for message in messages %}"
            "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.mark.parametrize("template", [FORGETFUL, COUNTING], ids=["forgetful", "counting"])
async def test_a_template_that_rewrites_history_is_a_break(template):
    from fleetrl.actors.model import build_byte_tokenizer

    hf = build_byte_tokenizer()
    hf.chat_template = template
    tok = HFChatTokenizer(hf)
    model = FakeModel(tok, replies=["one", "two"])
    recorder = AttemptRecorder("a", "t", tok)
    rm = RecordedModel(model, recorder)
    p = SamplingParams(max_tokens=20)
    q = [ChatMessage("user", "hello")]
    await rm.chat(q, p)
    msgs = [*q, ChatMessage("assistant", "one"), ChatMessage("user", "more")]
    c1 = await rm.chat(msgs, p)
    assert c1.extends is None and c1.break_cause == "template_rewrote_history", c1.new_segment_reason
    assert c1.prompt_ids == scratch(tok, msgs)
    assert recorder.finish().breaks == {"template_rewrote_history": 1}

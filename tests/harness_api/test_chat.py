"""The chat layout, stop strings and the token-exact history (pure; fake model)."""

from __future__ import annotations

import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from fakes import ASCII, FakeModel, PairTokenizer

from fleetrl.daemon.messages import ROLLOUTS, SamplingParams
from fleetrl.harness.chat import BREAK_CAUSES, ChatMessage, cut_at_stop_strings, render_chat
from fleetrl.harness.model import RecordedModel
from fleetrl.harness.recording import AttemptRecorder, truncate_generation

ROLES = ["system", "user", "assistant", "tool"]
texts = st.text(alphabet=st.characters(blacklist_categories=["Cs"]), max_size=40)
messages_st = st.lists(st.builds(ChatMessage, st.sampled_from(ROLES), texts), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(messages=messages_st, gen_prompt=st.booleans())
def test_layout_matches_the_tokenizers_chat_template(hf_tokenizer, tok, messages, gen_prompt):
    ours = render_chat(tok, messages, add_generation_prompt=gen_prompt)
    theirs = hf_tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages],
        add_generation_prompt=gen_prompt, tokenize=True, return_dict=False,
    )
    assert ours == list(theirs)


def test_layout_spelled_out(tok):
    ids = render_chat(tok, [ChatMessage("user", "hi")])
    assert ids == [tok.bos_id, *b"<|user|>\nhi", tok.eos_id, *b"\n<|assistant|>\n"]


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
        assert call.prompt_ids == render_chat(tok, call.messages)
        if i:
            prev = record.calls[i - 1]
            assert call.extends == i - 1 and call.new_segment_reason is None
            before = [*prev.prompt_ids, *prev.token_ids]
            assert call.prompt_ids[: len(before)] == before
            assert call.reused_tokens == len(before) + (prev.segment.finish_reason == "length")
    assert record.calls[0].new_segment_reason == "first call of the attempt"
    last = record.calls[-1]
    whole = render_chat(tok, final, add_generation_prompt=False)
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
    assert plan.ids != render_chat(tok, nxt)


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
    once = render_chat(tok, nxt)
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
    assert c1.prompt_ids == render_chat(tok, c1.messages)
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
    assert plan.ids == render_chat(tok, [ChatMessage("user", "q"), ChatMessage("assistant", "abc"), ChatMessage("user", "n")])


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
    ids = render_chat(tok, [ChatMessage("system", "S"), ChatMessage("user", "U")])
    expected = line.replace("\\n", "\n").replace("<bos>", "").replace("<eos>", "\x00")
    expected = expected.replace("{content}", "S", 1).replace("{content}", "U", 1)
    want = [tok.bos_id] + [tok.eos_id if b == 0 else b for b in expected.encode()]
    assert ids == want

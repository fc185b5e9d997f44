"""`openai_stream.TextStreamer`: what a streamed response sends while the model
generates is always a prefix of the answer as finally recorded (stop strings applied,
tool calls parsed), never holds a stop string or a tool-call block, and the rest
completes it exactly (Hypothesis, over random texts, token splits and stop strings)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.harness.chat import cut_at_stop_strings
from fleetrl.harness.openai_stream import TOOL_CALL_MARKER, TextStreamer
from fleetrl.harness.tool_calls import parse_tool_calls

PIECES = ["a", "b", " ", "\n", "é", "日", "<", ">", "tool_call", TOOL_CALL_MARKER, "</tool_call>",
          '{"name": "f", "arguments": {}}', "STOP"]


def final_text(tok, ids, stops, tool_calls: bool) -> str:
    cut = cut_at_stop_strings(tok, ids, stops)
    if not tool_calls:
        return cut.text
    return parse_tool_calls(cut.text, make_id=lambda: "call_0").content


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=14), cuts=st.lists(st.integers(1, 5), max_size=40),
       stops=st.lists(st.sampled_from(["STOP", "b\n", "ab", "日"]), max_size=2, unique=True),
       tool_calls=st.booleans())
def test_sent_text_is_a_prefix_of_the_answer_and_the_rest_completes_it(tok, parts, cuts, stops, tool_calls):
    ids = tok.encode("".join(parts))
    s = TextStreamer(tok, stops=stops, tool_calls=tool_calls)
    sent, at = "", 0
    for k in cuts:  # chunks of 1..5 tokens, as a sampler's steps arrive
        if at >= len(ids):
            break
        at = min(len(ids), at + k)
        sent += s.push(ids[:at])
    sent += s.push(ids)
    final = final_text(tok, ids, stops, tool_calls)
    assert final.startswith(sent)
    assert sent + s.rest(final) == final
    for stop in stops:
        assert stop not in sent
    if tool_calls:
        assert TOOL_CALL_MARKER not in sent


def test_a_tail_that_may_start_a_stop_string_waits_for_the_next_tokens(tok):
    s = TextStreamer(tok, stops=["END"])
    assert s.push(tok.encode("hello E")) == "hello "
    assert s.push(tok.encode("hello EN")) == ""
    assert s.push(tok.encode("hello ENx")) == "ENx"  # not the stop string after all
    assert s.push(tok.encode("hello ENxEND more")) == ""
    assert s.rest("hello ENx") == ""


def test_an_incomplete_character_is_held_until_its_last_byte(tok):
    ids = tok.encode("é")  # two byte tokens
    s = TextStreamer(tok)
    assert s.push(ids[:1]) == ""
    assert s.push(ids) == "é"


def test_tool_calls_and_trailing_space_are_not_streamed_as_content(tok):
    text = 'Checking.  \n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    ids = tok.encode(text)
    s = TextStreamer(tok, tool_calls=True)
    sent = "".join(s.push(ids[:k]) for k in range(1, len(ids) + 1))
    assert sent == "Checking."
    assert s.rest(parse_tool_calls(text, make_id=lambda: "x").content) == ""
    # a block that does not parse comes back as content: the rest is all of it
    bad = "Checking. <tool_call>{oops"
    s = TextStreamer(tok, tool_calls=True)
    sent = s.push(tok.encode(bad))
    assert sent + s.rest(bad) == bad

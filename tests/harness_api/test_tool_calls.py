"""Tool calls parsed out of answer text (pure): the template's format round-trips."""

from __future__ import annotations

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.harness.chat import ChatMessage, ToolCall
from fleetrl.harness.tool_calls import OPEN, parse_tool_calls

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=6), json_values, max_size=4)
names = st.text(min_size=1, max_size=12)
contents = st.text(max_size=30).filter(lambda t: OPEN not in t)


def ids():
    n = itertools.count()
    return lambda: f"call_{next(n):024x}"


@settings(max_examples=150, deadline=None)
@given(content=contents, calls=st.lists(st.tuples(names, arguments), min_size=1, max_size=3))
def test_the_templates_tool_calls_parse_back(tok, content, calls):
    """An assistant message rendered by the tiny model's template, turn markers
    stripped, parses back to the same content, names and arguments."""
    msg = ChatMessage("assistant", content,
                      tool_calls=tuple(ToolCall(f"c{i}", n, json.dumps(a)) for i, (n, a) in enumerate(calls)))
    text = tok.render([msg], None, False)
    head, tail = "<bos><|assistant|>\n", "<eos>\n"
    assert text.startswith(head) and text.endswith(tail)
    parsed = parse_tool_calls(text[len(head):-len(tail)], make_id=ids())
    assert parsed.failed is None
    assert parsed.content == content.rstrip()
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [(n, a) for n, a in calls]
    assert [c.id for c in parsed.tool_calls] == [f"call_{i:024x}" for i in range(len(calls))]


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(['<tool_call>', '</tool_call>', '{', '}', '"name"', '"arguments"', ':', ',',
                                      '"x"', ' ', '\n', 'a', '[]', '"{}"', '{"name": "f", "arguments": {}}'])
                    | st.characters(), max_size=20).map("".join) | st.text(max_size=60))
def test_any_text_parses_without_raising(text):
    parsed = parse_tool_calls(text, make_id=ids())
    if parsed.failed is not None or OPEN not in text:
        assert parsed.content == text and parsed.tool_calls == ()
    for c in parsed.tool_calls:
        assert isinstance(json.loads(c.arguments), dict)


def test_the_format_spelled_out():
    p = parse_tool_calls('ok \n<tool_call> {"name": "run", "arguments": "{\\"cmd\\": \\"ls\\"}"}\n</tool_call>'
                         '<tool_call>{"name": "b", "arguments": {"s": "</tool_call>"}}</tool_call>  \n', make_id=ids())
    assert p.failed is None and p.content == "ok"
    assert [(c.name, json.loads(c.arguments)) for c in p.tool_calls] == [("run", {"cmd": "ls"}), ("b", {"s": "</tool_call>"})]
    assert parse_tool_calls("no calls  ", make_id=ids()).content == "no calls  "
    for bad, why in [('<tool_call>{"name": "r", "arguments": {}}', "no </tool_call>"),
                     ('<tool_call>{"name": "r", "arguments": {}}</tool_call> and more', "text after tool call 1"),
                     ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
                     ('<tool_call>{"name": "r", "arguments": [1]}</tool_call>', "not a JSON object"),
                     ('<tool_call>{"name": "r", "arguments": "{x"}</tool_call>', "string that is not JSON"),
                     ('<tool_call>[1]</tool_call>', "body is not a JSON object")]:
        p = parse_tool_calls(bad, make_id=ids())
        assert p.content == bad and p.tool_calls == () and why in p.failed, (bad, p.failed)

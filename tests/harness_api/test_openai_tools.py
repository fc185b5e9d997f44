"""Tools, tool calls and ``n`` choices in the endpoint's pure parts: request checking
(every error names its field) and the response builders (bodies and chunks)."""

from __future__ import annotations

import json

import pytest
from fakes import FakeModel

from fleetrl.daemon.messages import SamplingParams
from fleetrl.harness.attempts import AttemptRegistry
from fleetrl.harness.chat import ChatMessage, ToolCall
from fleetrl.harness.errors import ApiError
from fleetrl.harness.openai_request import EndpointConfig, chat_request, completion_request
from fleetrl.harness.openai_response import (
    Reply,
    chat_body,
    chat_final_chunks,
    completion_body,
    response_headers,
    usage,
)

CONFIG = EndpointConfig(context_length=256, default_max_tokens=16, max_n=4)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
USER = {"role": "user", "content": "weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
REPLY = Reply(id="chatcmpl-1", created=7, model="fleetrl")


def chat(**body):
    return chat_request({"model": "fleetrl", "messages": [USER], **body}, CONFIG)


def error(**body) -> ApiError:
    with pytest.raises(ApiError) as info:
        chat(**body)
    return info.value


def test_tools_and_tool_choice_parse():
    req = chat(tools=[WEATHER])
    assert req.tools == [WEATHER] and req.tool_choice == "auto" and req.parse_tool_calls
    req = chat(tools=[WEATHER], tool_choice="none")
    assert req.tools == [WEATHER] and not req.parse_tool_calls  # the template still sees the tools
    assert chat(tools=[], tool_choice="none").tools is None
    assert chat(tool_choice="none").tool_choice == "none"
    assert chat(tools=[WEATHER], parallel_tool_calls=True).ignored == []
    assert chat(tools=[WEATHER], parallel_tool_calls=False).ignored == ["parallel_tool_calls"]


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"tools": {"a": 1}}, "tools", "invalid_type"),
    ({"tools": ["f"]}, "tools[0]", "invalid_type"),
    ({"tools": [{"function": WEATHER["function"]}]}, "tools[0].type", "missing"),
    ({"tools": [{**WEATHER, "type": "retrieval"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "missing"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0].function.name", "missing"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters", "invalid_type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools[0].function.description", "invalid_type"),
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "unsupported_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     "tool_choice", "unsupported_value"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": 1}, "tool_choice", "invalid_type"),
    ({"tool_choice": "auto"}, "tool_choice", "invalid_value"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_type"),
    ({"n": 5}, "n", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"n": 1.5}, "n", "invalid_type"),
])
def test_each_bad_tool_parameter_is_a_400_naming_its_field(body, param, code):
    err = error(**body)
    assert (err.status, err.param, err.code) == (400, param, code), err.message
    assert err.message.startswith(f"{param}: ")


def test_required_tool_choice_says_decoding_is_not_constrained():
    assert "does not constrain decoding" in error(tools=[WEATHER], tool_choice="required").message


def test_messages_with_tool_calls_and_tool_results_parse():
    req = chat(tools=[WEATHER], messages=[
        USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"},
    ])
    assert req.messages == [
        ChatMessage("user", USER["content"]),
        ChatMessage("assistant", "", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        ChatMessage("tool", "sunny", tool_call_id="call_1", name="get_weather"),
    ]
    # a tool_call_id on another role is ignored (named), not an error
    req = chat(messages=[{**USER, "tool_call_id": "x"}])
    assert req.messages == [ChatMessage("user", USER["content"])] and req.ignored == ["messages[0].tool_call_id"]


def _fn(**fn):
    return {"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "function": fn}]}]}


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "missing"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 3}]}, "messages[0].tool_call_id",
     "invalid_type"),
    ({"messages": [{**USER, "name": 3}]}, "messages[0].name", "invalid_type"),
    ({"messages": [{**USER, "tool_calls": [CALL]}]}, "messages[0].tool_calls", "invalid_value"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": CALL}]}, "messages[1].tool_calls", "invalid_type"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": ["x"]}]}, "messages[1].tool_calls[0]",
     "invalid_type"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "id": None}]}]},
     "messages[1].tool_calls[0].id", "missing"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]}]},
     "messages[1].tool_calls[0].type", "invalid_value"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
     "messages[1].tool_calls[0].function", "missing"),
    (_fn(arguments='{"city": "Paris"}'), "messages[1].tool_calls[0].function.name", "missing"),
    (_fn(name="f", arguments={"city": "Paris"}), "messages[1].tool_calls[0].function.arguments", "invalid_type"),
    (_fn(name="f", arguments="{city: Paris"), "messages[1].tool_calls[0].function.arguments", "invalid_value"),
    (_fn(name="f", arguments="[1]"), "messages[1].tool_calls[0].function.arguments", "invalid_value"),
])
def test_each_bad_message_field_is_a_400_naming_it(body, param, code):
    err = error(**body)
    assert (err.status, err.param, err.code) == (400, param, code), err.message


def test_completions_take_n_but_not_best_of(tok):
    base = {"model": "fleetrl", "prompt": "x"}
    assert completion_request({**base, "n": 3}, CONFIG, tok).common.n == 3
    for body, code in (({"n": 2, "best_of": 1}, "invalid_value"), ({"best_of": 2}, "unsupported_value")):
        with pytest.raises(ApiError) as info:
            completion_request({**base, **body}, CONFIG, tok)
        assert (info.value.param, info.value.code) == ("best_of", code)


# --------------------------------------------------------------------------- responses


async def _recorded(tok, replies, *, parse_tool_calls=True, max_tokens=200, stops=()):
    """Record one chat call per reply (the choices of one request) and return them."""
    registry = AttemptRegistry(tok)
    recorder = registry.recorder(registry.open_attempt("a1", "t1"))
    model = FakeModel(tok, replies=replies)
    messages = [ChatMessage("user", "hi")]
    plan = recorder.plan_chat(messages, [WEATHER])
    recs = []
    for _ in replies:
        gen = await model.generate(plan.ids, SamplingParams(max_tokens=max_tokens, stop_ids=(tok.eos_id,)))
        recs.append(recorder.record_chat(messages, plan, gen, tools=[WEATHER], parse_tool_calls=parse_tool_calls,
                                         ignored_params=["x"], stops=stops))
    return recs


TOOL_ANSWER = 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TWO_CALLS = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
             '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')


async def test_chat_body_has_tool_calls_finish_reasons_and_n_choices(tok):
    recs = await _recorded(tok, [TOOL_ANSWER, TWO_CALLS, "plain answer", "<tool_call>{broken</tool_call>"])
    body = chat_body(REPLY, recs, [None] * 4)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["finish_reason"] for c in body["choices"]] == ["tool_calls", "tool_calls", "stop", "stop"]
    m0, m1, m2, m3 = (c["message"] for c in body["choices"])
    assert m0["content"] == "Let me look." and m0["tool_calls"] == [
        {"id": recs[0].tool_calls[0].id, "type": "function",
         "function": {"name": "get_weather", "arguments": recs[0].tool_calls[0].arguments}}]
    assert json.loads(m0["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert m0["tool_calls"][0]["id"].startswith("call_")
    assert m1["content"] is None and [json.loads(c["function"]["arguments"])["city"] for c in m1["tool_calls"]] == [
        "Paris", "Rome"]
    assert len({c["id"] for c in m1["tool_calls"]}) == 2
    assert m2 == {"role": "assistant", "content": "plain answer"}
    # a block that does not parse comes back as the plain text, and is marked in the record
    assert m3 == {"role": "assistant", "content": "<tool_call>{broken</tool_call>"}
    assert recs[3].tool_call_parse_failure is not None and recs[0].tool_call_parse_failure is None
    # usage: the shared prompt once, every choice's tokens
    gen_total = sum(len(r.token_ids) for r in recs)
    assert body["usage"] == {"prompt_tokens": len(recs[0].prompt_ids), "completion_tokens": gen_total,
                             "total_tokens": len(recs[0].prompt_ids) + gen_total}
    assert usage(recs[:1])["completion_tokens"] == len(recs[0].token_ids)
    assert response_headers(recs) == {"X-Fleetrl-Call": "0,1,2,3", "X-Fleetrl-Ignored-Params": "x"}


async def test_without_parsing_tool_call_text_is_content_and_length_stays_length(tok):
    (rec,) = await _recorded(tok, [TOOL_ANSWER], parse_tool_calls=False)
    body = chat_body(REPLY, [rec], [None])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": TOOL_ANSWER}
    assert body["choices"][0]["finish_reason"] == "stop"
    (rec,) = await _recorded(tok, ["a long answer that runs out"], max_tokens=5)
    assert chat_body(REPLY, [rec], [None])["choices"][0]["finish_reason"] == "length"


async def test_final_chunks_are_one_per_tool_call_then_the_finish(tok):
    (rec,) = await _recorded(tok, [TOOL_ANSWER])
    *calls, finish = chat_final_chunks(REPLY, 0, rec, {"content": []})
    assert [c["choices"][0]["delta"]["tool_calls"] for c in calls] == [
        [{"index": k, "id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}]
        for k, tc in enumerate(rec.tool_calls)] and calls
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": {"content": []}, "finish_reason": "tool_calls"}


async def test_completion_body_with_n_choices(tok):
    recs = await _recorded(tok, ["first answer here", "second"], parse_tool_calls=False)
    reply = Reply(id="cmpl-1", created=7, model="fleetrl")
    body = completion_body(reply, recs, [None, None])
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, recs[0].text), (1, recs[1].text)]
    assert body["usage"] == usage(recs)
    with pytest.raises(ValueError):
        completion_body(reply, recs, [None])


async def test_stop_strings_and_max_tokens_apply_before_tool_calls_are_parsed(tok):
    # a stop string before the block: the client gets the text before it, no tool call
    (rec,) = await _recorded(tok, [TOOL_ANSWER], stops=["<tool_call>"])
    choice = chat_body(REPLY, [rec], [None])["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Let me look.\n"}
    assert choice["finish_reason"] == "stop" and rec.tool_call_parse_failure is None
    # a stop string after the block: the call stands
    (rec,) = await _recorded(tok, [TOOL_ANSWER + " trailing words"], stops=[" trailing"])
    assert chat_body(REPLY, [rec], [None])["choices"][0]["finish_reason"] == "tool_calls"
    # a block cut by max_tokens: plain content, finish length, a parse failure recorded
    (rec,) = await _recorded(tok, [TOOL_ANSWER], max_tokens=30)
    choice = chat_body(REPLY, [rec], [None])["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == rec.text
    assert "tool_calls" not in choice["message"] and rec.tool_call_parse_failure is not None

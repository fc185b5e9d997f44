"""The endpoint's pure parts on their own: who a request is for (attempts), request
checking (openai_request) and response bodies and events (openai_response)."""

from __future__ import annotations


import pytest
from fakes import FakeModel

from fleetrl.daemon.messages import SamplingParams
from fleetrl.harness.attempts import ATTEMPT_HEADER, AttemptRegistry, resolve_attempt
from fleetrl.harness.chat import ChatMessage
from fleetrl.harness.errors import ApiError
from fleetrl.harness.openai_request import (
    EndpointConfig,
    chat_request,
    completion_request,
    parse_body,
    sampling_params,
)
from fleetrl.harness.openai_response import (
    Reply,
    chat_body,
    completion_body,
    response_headers,
)

CONFIG = EndpointConfig(context_length=64, default_max_tokens=16)


def api_error(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


def test_resolve_attempt_reads_the_bearer_key_then_the_header(tok):
    registry = AttemptRegistry(tok)
    key = registry.open_attempt("a1", "t1")
    assert resolve_attempt(registry, {"authorization": f"Bearer {key}"})[0] == key
    assert resolve_attempt(registry, {"authorization": "Bearer fixed", ATTEMPT_HEADER: key})[1].attempt_id == "a1"
    assert api_error(resolve_attempt, registry, {}).code == "invalid_api_key"
    assert api_error(resolve_attempt, registry, {"authorization": "Bearer nope"}).code == "invalid_api_key"
    registry.close_attempt(key)
    err = api_error(resolve_attempt, registry, {"authorization": f"Bearer {key}"})
    assert (err.status, err.code, err.type) == (401, "attempt_closed", "authentication_error")


def test_parse_body_wants_a_json_object():
    assert parse_body(b'{"a": 1}') == {"a": 1}
    for raw in (b"{", b"[1]"):
        err = api_error(parse_body, raw)
        assert (err.status, err.code) == (400, "invalid_json")


def test_chat_request_collects_what_it_ignores():
    body = {"model": "fleetrl", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}],
                                               "name": "u"}],
            "max_tokens": 5, "logprobs": True, "top_logprobs": 2, "frequency_penalty": 0.5}
    req = chat_request(body, CONFIG)
    assert req.messages == [ChatMessage("user", "hi", name="u")]
    assert (req.max_tokens, req.logprobs, req.top_logprobs) == (5, True, 2)
    assert req.ignored == ["frequency_penalty"]
    assert (req.tools, req.tool_choice, req.parse_tool_calls, req.common.n) == (None, "none", False, 1)
    err = api_error(chat_request, {**body, "logprobs": False}, CONFIG)
    assert (err.status, err.param) == (400, "top_logprobs")
    err = api_error(chat_request, {**body, "model": "other"}, CONFIG)
    assert (err.status, err.code) == (404, "model_not_found")


def test_completion_request_takes_text_or_ids(tok):
    base = {"model": "fleetrl", "logprobs": 1}
    req = completion_request({**base, "prompt": ["ab"]}, CONFIG, tok)
    assert req.prompt_ids == [tok.bos_id, *b"ab"] and req.logprobs == 1
    assert completion_request({**base, "prompt": [5, 6]}, CONFIG, tok).prompt_ids == [5, 6]
    err = api_error(completion_request, {**base, "prompt": [5, tok.vocab_size]}, CONFIG, tok)
    assert (err.param, err.code) == ("prompt[1]", "invalid_value")
    err = api_error(completion_request, {**base, "prompt": "x", "echo": True}, CONFIG, tok)
    assert (err.param, err.code) == ("echo", "unsupported_value")


def test_sampling_params_fit_the_room_in_the_context(tok):
    c = chat_request({"model": "fleetrl", "messages": [{"role": "user", "content": "x"}]}, CONFIG).common
    assert sampling_params(c, None, 10, CONFIG, tok.eos_id, "messages").max_tokens == 16
    assert sampling_params(c, 40, 60, CONFIG, tok.eos_id, "messages").max_tokens == 4
    assert sampling_params(c, 40, 60, CONFIG, tok.eos_id, "messages").stop_ids == (tok.eos_id,)
    err = api_error(sampling_params, c, None, 64, CONFIG, tok.eos_id, "prompt")
    assert (err.status, err.param, err.code) == (400, "prompt", "context_length_exceeded")


async def test_response_bodies_and_events_carry_the_recorded_call(tok):
    registry = AttemptRegistry(tok)
    recorder = registry.recorder(registry.open_attempt("a1", "t1"))
    assert recorder is not None
    model = FakeModel(tok, replies=["hello there, a longer answer"])
    messages = [ChatMessage("user", "hi")]
    plan = recorder.plan_chat(messages)
    gen = await model.generate(plan.ids, SamplingParams(max_tokens=40, stop_ids=(tok.eos_id,)))
    rec = recorder.record_chat(messages, plan, gen, ignored_params=["seed_x"])
    reply = Reply(id="chatcmpl-1", created=7, model="fleetrl")

    body = chat_body(reply, [rec], [None])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": rec.text}
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == len(rec.token_ids)
    assert response_headers([rec]) == {"X-Fleetrl-Call": "0", "X-Fleetrl-Ignored-Params": "seed_x"}

    text = completion_body(Reply(id="cmpl-1", created=7, model="fleetrl"), [rec], [None])
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == rec.text

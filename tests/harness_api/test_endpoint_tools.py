"""Tool calling and ``n`` choices through the served endpoint (hypercorn's Trio worker
on 127.0.0.1), called with the official `openai` client (sync, in a worker thread) and
with httpx for what the client checks itself."""

from __future__ import annotations

import json

import httpx
import openai
import trio
from fakes import FakeModel, serving

from fleetrl.harness.errors import ModelUnavailable
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
PLAIN = "It is sunny."
USER = {"role": "user", "content": "weather in Paris?"}


class BySeed:
    """A model client answering each generation by its seed (``replies[seed]``, a
    `FakeModel` scripted with that text; other seeds sample at random), keeping the
    seeds asked for and the most generations it ran at once."""

    def __init__(self, tok, replies: dict[int, str], *, delay: float = 0.0, fail_seeds: tuple[int, ...] = ()):
        self._tok, self.replies, self.delay, self.fail_seeds = tok, replies, delay, fail_seeds
        self.seeds: list[int | None] = []
        self.running = self.most_running = 0

    @property
    def tokenizer(self):
        return self._tok

    async def generate(self, prompt_ids, params):
        self.seeds.append(params.seed)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await trio.sleep(self.delay)
            if params.seed in self.fail_seeds:
                raise ModelUnavailable("sampler lost")
            text = self.replies.get(params.seed)
            model = FakeModel(self._tok, replies=None if text is None else [text], seed=params.seed or 0)
            return await model.generate(prompt_ids, params)
        finally:
            self.running -= 1


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


async def test_openai_client_gets_parsed_tool_calls_and_n_choices(tok):
    model = BySeed(tok, {10: "Let me check.\n" + CALL_TEXT, 11: PLAIN, 20: "Paris is sunny."})
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig())
    key = registry.open_attempt("att", "task")
    with trio.fail_after(60):
        async with serving(app) as base:
            def talk():
                with client(base, key) as c:
                    first = c.chat.completions.create(model="fleetrl", messages=[USER], tools=[WEATHER], n=2, seed=10,
                                                      max_tokens=100, logprobs=True, top_logprobs=2)
                    # the conversation goes on from the second choice (plain text)
                    second = c.chat.completions.create(
                        model="fleetrl", seed=20, max_tokens=100, tools=[WEATHER],
                        messages=[USER, {"role": "assistant", "content": first.choices[1].message.content},
                                  {"role": "user", "content": "and tomorrow?"}])
                    return first, second
            first, second = await trio.to_thread.run_sync(talk)
    record = registry.close_attempt(key)
    assert sorted(model.seeds[:2]) == [10, 11] and model.seeds[2] == 20  # choice i samples with seed + i
    c0, c1, c2 = record.calls
    assert [ch.index for ch in first.choices] == [0, 1]
    tool_choice, plain = first.choices
    assert tool_choice.finish_reason == "tool_calls" and tool_choice.message.content == "Let me check."
    (call,) = tool_choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id == c0.tool_calls[0].id and c0.tool_calls[0].name == "get_weather"
    assert plain.finish_reason == "stop" and plain.message.content == PLAIN and not plain.message.tool_calls
    # each choice is its own recorded call with the same prompt; usage counts the prompt once
    assert c0.prompt_ids == c1.prompt_ids and c0.index == 0 and c1.index == 1
    assert first.usage.prompt_tokens == len(c0.prompt_ids)
    assert first.usage.completion_tokens == len(c0.token_ids) + len(c1.token_ids)
    assert first.usage.total_tokens == first.usage.prompt_tokens + first.usage.completion_tokens
    for choice, rec in zip(first.choices, (c0, c1)):
        lps = [round(t.logprob, 5) for t in choice.logprobs.content]
        assert lps == [round(x, 5) for x in rec.segment.logprobs.to_numpy().tolist()]
    # the next call extends the choice the client sent back
    assert c2.extends == 1 and c2.prompt_ids[: len(c1.prompt_ids) + len(c1.token_ids)] == c1.prompt_ids + c1.token_ids
    assert second.choices[0].message.content == "Paris is sunny." and second.choices[0].finish_reason == "stop"
    stats = app.state.tool_calls.statistics()
    assert (stats.answers_parsed, stats.answers_with_tool_calls, stats.tool_calls, stats.parse_failures) == (
        3, 1, 1, 0)


async def test_streamed_tool_calls_and_n_choices_with_the_openai_client(tok):
    model = BySeed(tok, {5: CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome"), 6: PLAIN})
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig())
    key = registry.open_attempt("att", "task")
    with trio.fail_after(60):
        async with serving(app) as base:
            def talk():
                with client(base, key) as c:
                    return list(c.chat.completions.create(model="fleetrl", messages=[USER], tools=[WEATHER], n=2,
                                                          seed=5, max_tokens=200, stream=True,
                                                          stream_options={"include_usage": True}))
            chunks = await trio.to_thread.run_sync(talk)
    record = registry.close_attempt(key)
    content: dict[int, str] = {0: "", 1: ""}
    calls: dict[int, dict[int, dict]] = {0: {}, 1: {}}
    finish: dict[int, list[str]] = {0: [], 1: []}
    for ch in chunks:
        for choice in ch.choices:
            content[choice.index] += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                got = calls[choice.index].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                got["id"] = tc.id or got["id"]
                got["name"] += tc.function.name or ""
                got["arguments"] += tc.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index].append(choice.finish_reason)
    assert finish == {0: ["tool_calls"], 1: ["stop"]}
    assert content == {0: "", 1: PLAIN}
    c0, c1 = record.calls
    assert [calls[0][k] for k in sorted(calls[0])] == [
        {"id": tc.id, "name": tc.name, "arguments": tc.arguments} for tc in c0.tool_calls]
    assert [json.loads(calls[0][k]["arguments"])["city"] for k in (0, 1)] == ["Paris", "Rome"]
    assert calls[1] == {}
    assert chunks[-1].usage.completion_tokens == len(c0.token_ids) + len(c1.token_ids)


async def test_parse_failures_come_back_as_content_and_are_counted(tok):
    broken = '<tool_call>{"name": "get_weather", "arguments": </tool_call>'
    model = BySeed(tok, {1: broken, 2: CALL_TEXT})
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig())
    key = registry.open_attempt("att", "task")
    auth = {"Authorization": f"Bearer {key}"}
    with trio.fail_after(60):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            r1 = await http.post("/v1/chat/completions", headers=auth, json={
                "model": "fleetrl", "messages": [USER], "tools": [WEATHER], "seed": 1, "max_tokens": 100})
            # tool_choice "none": the tools reach the template, the answer is not parsed
            r2 = await http.post("/v1/chat/completions", headers=auth, json={
                "model": "fleetrl", "messages": [USER], "tools": [WEATHER], "tool_choice": "none", "seed": 2,
                "max_tokens": 100})
    record = registry.close_attempt(key)
    assert r1.status_code == 200 and r2.status_code == 200
    assert r1.json()["choices"][0]["message"] == {"role": "assistant", "content": broken}
    assert r1.json()["choices"][0]["finish_reason"] == "stop"
    assert r2.json()["choices"][0]["message"] == {"role": "assistant", "content": CALL_TEXT}
    assert record.calls[0].tool_call_parse_failure is not None and record.calls[1].tool_call_parse_failure is None
    assert record.tool_call_parse_failures == 1
    stats = app.state.tool_calls.statistics()
    assert (stats.answers_parsed, stats.parse_failures) == (1, 1)


async def test_n_choices_run_concurrently_and_seed_each_choice(tok):
    model = BySeed(tok, {}, delay=0.2)
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig(max_n=4))
    key = registry.open_attempt("att", "task")
    with trio.fail_after(60):
        async with serving(app) as base:
            def talk():
                with client(base, key) as c:
                    chat = c.chat.completions.create(model="fleetrl", messages=[USER], n=4, seed=7, max_tokens=8)
                    comp = c.completions.create(model="fleetrl", prompt="abc", n=3, max_tokens=8, logprobs=1)
                    return chat, comp
            chat, comp = await trio.to_thread.run_sync(talk)
    record = registry.close_attempt(key)
    assert model.most_running == 4
    assert sorted(model.seeds[:4]) == [7, 8, 9, 10] and model.seeds[4:] == [None] * 3
    assert len(record.calls) == 7 and [c.kind for c in record.calls] == ["chat"] * 4 + ["completion"] * 3
    assert [c.message.content for c in chat.choices] == [c.text for c in record.calls[:4]]
    assert len({c.text for c in record.calls[:4]}) > 1  # four different answers
    assert [c.index for c in comp.choices] == [0, 1, 2]
    assert [c.text for c in comp.choices] == [c.text for c in record.calls[4:]]
    assert all(len(c.logprobs.tokens) == len(r.token_ids) for c, r in zip(comp.choices, record.calls[4:]))
    assert comp.usage.prompt_tokens == len(record.calls[4].prompt_ids)
    assert comp.usage.completion_tokens == sum(len(r.token_ids) for r in record.calls[4:])


async def test_a_failing_choice_fails_the_request_and_nothing_is_recorded(tok):
    model = BySeed(tok, {}, fail_seeds=(3,))
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig(max_waiting_calls=3))
    key = registry.open_attempt("att", "task")
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "fleetrl", "messages": [USER], "max_tokens": 5}
    with trio.fail_after(60):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            failed = await http.post("/v1/chat/completions", headers=auth, json={**body, "n": 3, "seed": 1})
            busy = await http.post("/v1/chat/completions", headers=auth, json={**body, "n": 4})
            ok = await http.post("/v1/chat/completions", headers=auth, json={**body, "n": 3})
    record = registry.close_attempt(key)
    assert (failed.status_code, failed.json()["error"]["code"]) == (503, "model_unavailable")
    assert (busy.status_code, busy.json()["error"]["code"]) == (429, "endpoint_busy")
    assert ok.status_code == 200 and ok.headers["X-Fleetrl-Call"] == "0,1,2"
    assert len(record.calls) == 3 and app.state.limits.statistics().waiting == 0

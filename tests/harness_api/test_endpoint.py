"""The OpenAI-compatible endpoint, served for real (hypercorn's Trio worker on
127.0.0.1) and called with the official `openai` client (sync, in a worker thread)
and with httpx for the malformed requests the client would never send."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
import structlog
import structlog.testing
import trio
from fakes import ASCII, FakeModel, serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.harness.chat import ChatMessage
from fleetrl.harness.openai_api import (
    ATTEMPT_HEADER,
    IGNORED_HEADER,
    AttemptRegistry,
    EndpointConfig,
    create_app,
)


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30)


def setup(tok, config: EndpointConfig = EndpointConfig(), **fake):
    model = FakeModel(tok, **fake)
    registry = AttemptRegistry(tok)
    return model, registry, create_app(model, registry, config)


async def test_openai_client_chat_streamed_and_not_completions_and_models(tok):
    model, registry, app = setup(tok, seed=3)
    key = registry.open_attempt("att-1", "task-1")
    with trio.fail_after(60):
        async with serving(app) as base:
            def talk():
                with client(base, key) as c:
                    return _talk(c)

            def _talk(c):
                models = [m.id for m in c.models.list()]
                chat = c.chat.completions.create(model="fleetrl", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=30, temperature=0.7, seed=4)
                stream = c.chat.completions.create(
                    model="fleetrl", stream=True, stream_options={"include_usage": True}, max_tokens=30,
                    messages=[{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": chat.choices[0].message.content},
                              {"role": "user", "content": "more"}])
                chunks = list(stream)
                comp = c.completions.create(model="fleetrl", prompt="def f(x):\n", max_tokens=20)
                comp_stream = list(c.completions.create(model="fleetrl", prompt="abc", max_tokens=20, stream=True))
                return models, chat, chunks, comp, comp_stream

            models, chat, chunks, comp, comp_stream = await trio.to_thread.run_sync(talk)
    record = registry.close_attempt(key)
    assert models == ["fleetrl"]
    assert len(record.calls) == 4 and [c.kind for c in record.calls] == ["chat", "chat", "completion", "completion"]
    c0, c1, c2, c3 = record.calls
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == c0.text == tok.decode(c0.token_ids)
    assert chat.choices[0].finish_reason == c0.segment.finish_reason
    assert chat.usage.prompt_tokens == len(c0.prompt_ids) and chat.usage.completion_tokens == len(c0.token_ids)
    assert model.params[0].temperature == 0.7 and model.params[0].seed == 4 and model.params[0].max_tokens == 30
    # the stream: role first, deltas that join to the answer, a finish reason, usage, [DONE]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c1.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c1.segment.finish_reason
    assert chunks[-1].usage.completion_tokens == len(c1.token_ids)
    assert c1.extends == 0 and c1.prompt_ids[: len(c0.prompt_ids) + len(c0.token_ids)] == c0.prompt_ids + c0.token_ids
    assert comp.object == "text_completion" and comp.choices[0].text == c2.text
    assert c2.prompt_ids == [tok.bos_id, *b"def f(x):\n"] and c2.new_segment_reason is not None
    assert "".join(ch.choices[0].text for ch in comp_stream) == c3.text


async def test_twenty_turn_conversation_is_recorded_token_exactly_end_to_end(tok):
    model, registry, app = setup(tok, seed=11, alphabet=ASCII)
    key = registry.open_attempt("att-20", "task")
    with trio.fail_after(120):
        async with serving(app) as base:
            def converse():
                with client(base, key) as c:
                    return _converse(c)

            def _converse(c):
                msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "go"}]
                for i in range(20):
                    r = c.chat.completions.create(model="fleetrl", messages=msgs, max_tokens=10,
                                                  stream=(i % 2 == 1))
                    if i % 2:
                        answer = "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices)
                    else:
                        answer = r.choices[0].message.content
                    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"next {i}"}]
                return msgs[:-1]

            final = await trio.to_thread.run_sync(converse)
    record = registry.close_attempt(key)
    assert len(record.calls) == 20 and record.n_new_segments == 1
    for i, call in enumerate(record.calls[1:], start=1):
        prev = record.calls[i - 1]
        assert call.extends == i - 1
        assert call.prompt_ids[: len(prev.prompt_ids) + len(prev.token_ids)] == prev.prompt_ids + prev.token_ids
    whole = tok.encode(tok.render([ChatMessage(m["role"], m["content"]) for m in final], None, False))
    last = record.calls[-1]
    tail = last.token_ids if last.token_ids[-1] == tok.eos_id else [*last.token_ids, tok.eos_id]
    assert whole == [*last.prompt_ids, *tail, *tok.encode("\n")]
    assert model.prompts == [c.prompt_ids for c in record.calls]


async def test_attempt_header_fallback_and_separate_attempts(tok):
    model, registry, app = setup(tok, seed=1)
    k1 = registry.open_attempt("a1", "t")
    k2 = registry.open_attempt("a2", "t")
    with trio.fail_after(60):
        async with serving(app) as base:
            def calls():
                with openai.OpenAI(base_url=f"{base}/v1", api_key="sk-fixed-key", max_retries=0, timeout=30,
                                   default_headers={ATTEMPT_HEADER: k1}) as fixed:
                    fixed.chat.completions.create(model="fleetrl", messages=[{"role": "user", "content": "a"}],
                                                  max_tokens=5)
                with client(base, k2) as c:
                    for text in ("b", "c"):
                        c.chat.completions.create(model="fleetrl", messages=[{"role": "user", "content": text}],
                                                  max_tokens=5)
            await trio.to_thread.run_sync(calls)
    r1, r2 = registry.close_attempt(k1), registry.close_attempt(k2)
    assert (r1.attempt_id, len(r1.calls)) == ("a1", 1) and (r2.attempt_id, len(r2.calls)) == ("a2", 2)
    assert r2.calls[1].extends is None and r2.n_new_segments == 2


async def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(tok):
    config = EndpointConfig(context_length=64, default_max_tokens=8, max_body_bytes=4096)
    model, registry, app = setup(tok, config, seed=2)
    key = registry.open_attempt("a", "t")
    closed = registry.open_attempt("b", "t")
    registry.close_attempt(closed)
    good = {"model": "fleetrl", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        # (body or raw bytes, key, status, code, param)
        ({**good, "temperature": "hot"}, key, 400, "invalid_type", "temperature"),
        ({**good, "temperature": 7}, key, 400, "invalid_value", "temperature"),
        ({**good, "max_tokens": True}, key, 400, "invalid_type", "max_tokens"),
        ({**good, "max_tokens": 0}, key, 400, "invalid_value", "max_tokens"),
        ({**good, "top_p": 0}, key, 400, "invalid_value", "top_p"),
        ({**good, "stop": ["a", 3]}, key, 400, "invalid_type", "stop"),
        ({**good, "n": 17}, key, 400, "invalid_value", "n"),
        ({**good, "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}, key,
         400, "unsupported_value", "tool_choice"),
        ({**good, "messages": [{"role": "tool", "content": "x"}]}, key, 400, "missing", "messages[0].tool_call_id"),
        ({**good, "seed": -1}, key, 400, "invalid_value", "seed"),
        ({**good, "messages": "hi"}, key, 400, "invalid_type", "messages"),
        ({**good, "messages": []}, key, 400, "invalid_value", "messages"),
        ({**good, "messages": [{"role": "wizard", "content": "x"}]}, key, 400, "invalid_value", "messages[0].role"),
        ({**good, "messages": [{"role": "user", "content": 5}]}, key, 400, "invalid_type", "messages[0].content"),
        ({**good, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, key, 400,
         "unsupported_value", "messages[0].content[0]"),
        ({"messages": good["messages"]}, key, 400, "missing", "model"),
        ({**good, "model": "gpt-4o"}, key, 404, "model_not_found", "model"),
        (good, "not-a-key", 401, "invalid_api_key", None),
        (good, None, 401, "invalid_api_key", None),
        (good, closed, 401, "attempt_closed", None),
        ({**good, "messages": [{"role": "user", "content": "x" * 100}]}, key, 400, "context_length_exceeded",
         "messages"),
        (b'{"model": "fleetrl", "messages": [', key, 400, "invalid_json", None),
        ({**good, "messages": [{"role": "user", "content": "x" * 5000}]}, key, 413, "body_too_large", None),
        (b"[" * 100_000, key, 413, "body_too_large", None),
        (b"[" * 4000, key, 400, "invalid_json", None),
        (b'[1, 2]', key, 400, "invalid_json", None),
        (b'\xff\xfe', key, 400, "invalid_json", None),
    ]
    with trio.fail_after(60):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=20) as http:
            for body, k, status, code, param in cases:
                headers = {"Authorization": f"Bearer {k}"} if k else {}
                if isinstance(body, bytes):
                    r = await http.post("/v1/chat/completions", content=body,
                                        headers={**headers, "Content-Type": "application/json"})
                else:
                    r = await http.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == status, (body, r.text)
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                assert (err["code"], err["param"]) == (code, param), (body, err)
            auth = {"Authorization": f"Bearer {key}"}
            r = await http.post("/v1/completions", json={"model": "fleetrl", "prompt": [1, 2, 999]}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[2]"
            r = await http.post("/v1/completions", json={"model": "fleetrl", "prompt": ["a", "b"]}, headers=auth)
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_value"
            r = await http.get("/v1/nothing")
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            r = await http.get("/v1/chat/completions")
            assert r.status_code == 405 and "error" in r.json()
            # unknown parameters are ignored, with a warning and a header
            with structlog.testing.capture_logs() as logs:
                r = await http.post("/v1/chat/completions", headers=auth,
                                    json={**good, "frobnicate": 1, "presence_penalty": 0.5, "max_tokens": 1000,
                                          "messages": [{"role": "user", "content": "hi", "weight": 1}]})
            (warning,) = [e for e in logs if e["event"] == "openai request parameters ignored"]
            assert warning["log_level"] == "warning" and warning["attempt_id"] == "a"
            assert warning["ignored"] == ["frobnicate", "presence_penalty", "messages[0].weight"]
            assert r.status_code == 200, r.text
            assert r.headers[IGNORED_HEADER] == "frobnicate,presence_penalty,messages[0].weight"
            assert r.json()["usage"]["total_tokens"] <= 64  # max_tokens capped at the room left
            # the server still serves, chat and completions (token-id prompts too)
            r = await http.post("/v1/chat/completions", json=good, headers=auth)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
            r = await http.post("/v1/completions", json={"model": "fleetrl", "prompt": [tok.bos_id, 97]},
                                headers={ATTEMPT_HEADER: key})
            assert r.status_code == 200 and r.json()["object"] == "text_completion"
    record = registry.close_attempt(key)
    assert [c.ignored_params for c in record.calls] == [("frobnicate", "presence_penalty", "messages[0].weight"), (), ()]
    assert record.calls[2].prompt_ids == [tok.bos_id, 97]
    assert len(model.prompts) == 3  # no bad request reached the model


async def test_model_failure_is_a_503_and_the_openai_client_sees_an_error(tok):
    model, registry, app = setup(tok, fail=True)
    key = registry.open_attempt("a", "t")
    with trio.fail_after(60):
        async with serving(app) as base:
            def call():
                with pytest.raises(openai.InternalServerError) as info, client(base, key) as c:
                    c.chat.completions.create(model="fleetrl", messages=[{"role": "user", "content": "x"}])
                return info.value
            err = await trio.to_thread.run_sync(call)
    assert err.status_code == 503 and err.body["code"] == "model_unavailable"
    assert registry.close_attempt(key).calls == ()


async def test_closing_an_attempt_during_a_call_drops_the_late_answer(tok):
    model, registry, app = setup(tok, delay=1.0)
    key = registry.open_attempt("a", "t")
    with trio.fail_after(60):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=20) as http:
            async with trio.open_nursery() as nursery:
                got = {}

                async def call():
                    got["r"] = await http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                               json={"model": "fleetrl", "messages": [{"role": "user", "content": "x"}]})
                nursery.start_soon(call)
                await trio.sleep(0.3)
                record = registry.close_attempt(key)
    assert got["r"].status_code == 401 and got["r"].json()["error"]["code"] == "attempt_closed"
    assert record.calls == ()


async def test_logprobs_are_reported_from_the_record(tok):
    model, registry, app = setup(tok, seed=8, k=4)
    key = registry.open_attempt("a", "t")
    with trio.fail_after(60):
        async with serving(app) as base:
            def call():
                with client(base, key) as c:
                    return _call(c)

            def _call(c):
                chat = c.chat.completions.create(model="fleetrl", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=6, logprobs=True, top_logprobs=2)
                comp = c.completions.create(model="fleetrl", prompt="y", max_tokens=6, logprobs=3)
                return chat, comp
            chat, comp = await trio.to_thread.run_sync(call)
    rec = registry.close_attempt(key)
    seg = rec.calls[0].segment
    content = chat.choices[0].logprobs.content
    assert [round(t.logprob, 5) for t in content] == [round(x, 5) for x in seg.logprobs.to_numpy().tolist()]
    for t, entry in enumerate(content):
        ids, lps = seg.support.row(t)
        assert [round(e.logprob, 5) for e in entry.top_logprobs] == [round(float(x), 5) for x in lps[:2]]
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(rec.calls[1].token_ids)
    assert all(len(d) <= 3 for d in lp.top_logprobs)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
fields = st.sampled_from(["model", "messages", "temperature", "top_p", "max_tokens", "stop", "seed", "n",
                          "stream", "logprobs", "top_logprobs", "prompt", "stream_options", "echo", "extra", "tools",
                          "tool_choice", "parallel_tool_calls", "best_of"])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(fields, json_values, max_size=6), path=st.sampled_from(["chat/completions", "completions"]),
       keep_model=st.booleans())
def test_fuzzed_requests_never_crash_the_app(tok, body, path, keep_model):
    model, registry, app = setup(tok, seed=0, config=EndpointConfig(context_length=256))
    key = registry.open_attempt("a", "t")
    if keep_model:
        body = {**body, "model": "fleetrl"}

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            with trio.fail_after(20):
                return await http.post(f"/v1/{path}", content=json.dumps(body),
                                       headers={"Authorization": f"Bearer {key}"})

    r = trio.run(go)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n")
    else:
        assert math.isfinite(r.json()["usage"]["total_tokens"])


def test_the_documented_error_codes_are_the_ones_the_app_uses():
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    doc = (root / "docs" / "reference" / "openai-endpoint.md").read_text()
    table = doc[doc.index("## Errors"):doc.index("Unknown parameters")]
    rows = [line.split("|") for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    documented = {code for row in rows[1:] for code in re.findall(r"`([a-z_]+)`", row[3])}
    used = {"invalid_value"}  # _bad's default
    modules = ("openai_api.py", "openai_request.py", "openai_response.py", "attempts.py", "openai_limits.py",
               "sampling_policy.py")
    nodes = [n for m in modules for n in ast.walk(ast.parse((root / "harness" / m).read_text()))]
    for node in nodes:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "_bad" and len(node.args) == 3:
                arg = node.args[2]
                options = [arg.body, arg.orelse] if isinstance(arg, ast.IfExp) else [arg]
                used |= {o.value for o in options if isinstance(o, ast.Constant)}
            if node.func.id == "ApiError":
                used |= {k.value.value for k in node.keywords if k.arg == "code" and isinstance(k.value, ast.Constant)}
        if isinstance(node, ast.Dict):  # the route errors' table
            used |= {v.value for v in node.values if isinstance(v, ast.Constant) and str(v.value).endswith(
                ("not_found", "not_allowed"))}
    assert used == documented, used ^ documented


class _PerAttempt:
    """A client offering ``for_attempt``, as the sampler pool's does: records which
    attempt each call came through."""

    def __init__(self, inner: FakeModel, attempt_id: str = "", calls: list | None = None) -> None:
        self.inner, self.attempt_id = inner, attempt_id
        self.calls = [] if calls is None else calls

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    def for_attempt(self, attempt_id: str) -> _PerAttempt:
        return _PerAttempt(self.inner, attempt_id, self.calls)

    async def generate(self, prompt_ids, params):
        self.calls.append(self.attempt_id)
        return await self.inner.generate(prompt_ids, params)


async def test_each_call_goes_through_the_clients_view_of_its_attempt(tok):
    """Chat and completion calls reach the model through ``for_attempt(attempt_id)`` of
    the key they carry (the pool logs, routes and paces by attempt)."""
    model = _PerAttempt(FakeModel(tok, seed=1))
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig())
    k1, k2 = registry.open_attempt("g/0.1", "t"), registry.open_attempt("g/1.1", "t")
    with trio.fail_after(30):
        async with serving(app) as base:
            def talk():
                with client(base, k1) as c1, client(base, k2) as c2:
                    c1.chat.completions.create(model="fleetrl", messages=[{"role": "user", "content": "a"}],
                                               max_tokens=3)
                    c2.completions.create(model="fleetrl", prompt="b", max_tokens=3)
                    c1.completions.create(model="fleetrl", prompt="c", max_tokens=3)
            await trio.to_thread.run_sync(talk)
    assert model.calls == ["g/0.1", "g/1.1", "g/0.1"]

"""Floods and malformed requests at the OpenAI-compatible endpoint, served for real
(hypercorn's Trio worker on 127.0.0.1) and called with httpx and the official client.

A flood is refused with 429 (the right code, ``Retry-After``), never queued; the calls
admitted run and are all recorded. Random bodies get 2xx or 4xx in OpenAI's shape,
never 5xx, and the endpoint answers a good request afterwards. No timing is asserted:
the model is held by a `trio.Event` the test sets, and progress is followed by events.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import msgspec
import openai
import pytest
import trio
from fakes import FakeModel, serving
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.actors.endpoint.actor import EndpointHandle
from fleetrl.harness.errors import ApiError
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, ToolCallCounts, create_app
from fleetrl.harness.openai_limits import RETRY_AFTER_S, CallLimits


class HeldModel:
    """A FakeModel whose calls wait for ``release``; ``arrived`` is set once
    ``expect`` calls are waiting in it. ``most`` is the most calls it held at once."""

    def __init__(self, tok, expect: int) -> None:
        self.inner = FakeModel(tok, seed=5)
        self.expect = expect
        self.release = trio.Event()
        self.arrived = trio.Event()
        self.running = self.most = 0

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    async def generate(self, prompt_ids, params):
        self.running += 1
        self.most = max(self.most, self.running)
        if self.running == self.expect:
            self.arrived.set()
        try:
            await self.release.wait()
            return await self.inner.generate(prompt_ids, params)
        finally:
            self.running -= 1


def chat(text: str) -> dict:
    return {"model": "fleetrl", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


async def flood(http: httpx.AsyncClient, calls: list[tuple[str, str]], model: HeldModel, n_refused: int,
                while_held=None) -> dict[str, httpx.Response]:
    """Send every (key, text) call at once; once ``n_refused`` are answered and the
    model holds its ``expect`` calls, run ``while_held()``, then release the model.
    Returns each text's response."""
    got: dict[str, httpx.Response] = {}
    refused = trio.Event()

    async def call(key: str, text: str) -> None:
        got[text] = r = await http.post("/v1/chat/completions", json=chat(text),
                                        headers={"Authorization": f"Bearer {key}"})
        if r.status_code == 429 and sum(x.status_code == 429 for x in got.values()) == n_refused:
            refused.set()

    async with trio.open_nursery() as nursery:
        for key, text in calls:
            nursery.start_soon(call, key, text)
        await refused.wait()
        await model.arrived.wait()
        if while_held is not None:
            await while_held()
        model.release.set()
    return got


async def test_a_flood_from_one_attempt_runs_the_limit_and_refuses_the_rest(tok):
    limit = 4
    model = HeldModel(tok, expect=limit)
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig(max_concurrent_calls_per_attempt=limit))
    handle = EndpointHandle(registry=registry, base_url="", model_name="fleetrl", limits=app.state.limits)
    key = registry.open_attempt("a", "t")
    other = registry.open_attempt("b", "t")
    seen = {}

    with trio.fail_after(60):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            async def while_held():
                seen["stats"] = handle.statistics()
                assert model.running == limit and app.state.limits.in_flight(key) == limit

                def one_more():  # the official client sees a RateLimitError it could retry
                    with pytest.raises(openai.RateLimitError) as info, openai.OpenAI(
                            base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30) as c:
                        c.chat.completions.create(**chat("one more"))
                    return info.value
                seen["client"] = await trio.to_thread.run_sync(one_more)

            got = await flood(http, [(key, f"call {i}") for i in range(40)], model, 40 - limit, while_held)
            # another attempt is not held back by this one's flood, and the endpoint still serves
            r = await http.post("/v1/chat/completions", json=chat("after"), headers={"Authorization": f"Bearer {other}"})
            assert r.status_code == 200, r.text
            r = await http.post("/v1/chat/completions", json=chat("again"), headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text

    ok = {t: r for t, r in got.items() if r.status_code == 200}
    refused = {t: r for t, r in got.items() if r.status_code != 200}
    assert len(ok) == limit and model.most == limit
    for r in refused.values():
        assert r.status_code == 429 and r.headers["Retry-After"] == str(RETRY_AFTER_S)
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("rate_limit_error", "too_many_concurrent_calls", None)
        assert err["message"]
    assert seen["client"].status_code == 429 and seen["client"].body["code"] == "too_many_concurrent_calls"
    # every admitted call is recorded, with the answer its caller got; nothing refused is
    record = registry.close_attempt(key)
    by_text = {c.messages[0].content: c for c in record.calls}
    assert set(by_text) == {*ok, "again"}
    for text, r in ok.items():
        body = r.json()
        assert body["choices"][0]["message"]["content"] == by_text[text].text
        assert int(r.headers["X-Fleetrl-Call"]) == by_text[text].index
    assert len(registry.close_attempt(other).calls) == 1
    during, after = seen["stats"], handle.statistics()
    assert (during.calls_in_flight, during.calls_waiting) == (limit, limit)
    assert during.rejected_too_many_concurrent_calls == 40 - limit
    assert (after.calls_in_flight, after.calls_waiting, app.state.limits.statistics().admitted) == (0, 0, limit + 2)
    assert after.rejected_too_many_concurrent_calls == 40 - limit + 1 and after.rejected_endpoint_busy == 0


async def test_the_total_of_calls_waiting_for_the_model_is_capped_across_attempts(tok):
    waiting = 3
    model = HeldModel(tok, expect=waiting)
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig(max_concurrent_calls_per_attempt=8, max_waiting_calls=waiting))
    keys = [registry.open_attempt(f"a{i}", "t") for i in range(10)]
    calls = [(k, f"{i} {j}") for i, k in enumerate(keys) for j in range(2)]
    with trio.fail_after(60):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            got = await flood(http, calls, model, len(calls) - waiting)
            r = await http.post("/v1/completions", json={"model": "fleetrl", "prompt": "x", "max_tokens": 3},
                                headers={"Authorization": f"Bearer {keys[0]}"})
            assert r.status_code == 200, r.text
    ok = {t for t, r in got.items() if r.status_code == 200}
    assert len(ok) == waiting and model.most == waiting
    for t, r in got.items():
        if t not in ok:
            assert r.status_code == 429 and r.headers["Retry-After"] == str(RETRY_AFTER_S)
            assert r.json()["error"]["code"] == "endpoint_busy"
    recorded = [c for k in keys for c in registry.close_attempt(k).calls]
    assert {c.messages[0].content for c in recorded if c.kind == "chat"} == ok
    assert len(recorded) == waiting + 1
    s = app.state.limits.statistics()
    assert (s.rejected_busy, s.rejected_per_attempt, s.waiting, s.in_flight) == (len(calls) - waiting, 0, 0, 0)


def test_call_limits_free_their_slots_whatever_happens():
    limits = CallLimits(per_attempt=1, waiting=1)
    with pytest.raises(RuntimeError), limits.attempt_slot("k"), limits.model_slot():
        with pytest.raises(ApiError) as a:
            with limits.attempt_slot("k"):
                pass
        with pytest.raises(ApiError) as b:
            with limits.model_slot():
                pass
        raise RuntimeError("the call failed")
    assert (a.value.status, a.value.code, b.value.code) == (429, "too_many_concurrent_calls", "endpoint_busy")
    assert a.value.retry_after_s == RETRY_AFTER_S
    s = limits.statistics()
    assert (s.in_flight, s.waiting, s.admitted, s.rejected_per_attempt, s.rejected_busy) == (0, 0, 1, 1, 1)
    assert limits.in_flight("k") == 0 and not limits._by_key
    with pytest.raises(ValueError):
        CallLimits(per_attempt=0, waiting=1)
    with pytest.raises(ValueError):
        EndpointConfig(max_waiting_calls=0)


@contextmanager
def served_in_a_thread(app) -> Iterator[str]:
    """Serve ``app`` from a Trio loop of its own thread (so a synchronous Hypothesis
    test can call it many times over one server); yields the base URL."""
    ready = threading.Event()
    box: dict = {}

    def main() -> None:
        async def go() -> None:
            box["stop"] = trio.Event()
            box["token"] = trio.lowlevel.current_trio_token()
            async with serving(app) as base:
                box["base"] = base
                ready.set()
                await box["stop"].wait()
        trio.run(go)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(30), "the server did not start"
    try:
        yield box["base"]
    finally:
        trio.from_thread.run_sync(box["stop"].set, trio_token=box["token"])
        thread.join(30)


odd_text = st.text(max_size=8) | st.sampled_from(["\ud800", "a\udfff", "\u65e5\u672c", " x ", "\x7f", "\n", ""])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | odd_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=4),
    max_leaves=16,
)
fields = st.sampled_from(["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop",
                          "seed", "n", "stream", "stream_options", "logprobs", "top_logprobs", "echo", "suffix"])
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": odd_text})


def valid(path_body: tuple[str, str]) -> dict:
    kind, text = path_body
    if kind == "chat":
        return {"model": "fleetrl", "messages": [{"role": "user", "content": text}], "max_tokens": 3}
    return {"model": "fleetrl", "prompt": text, "max_tokens": 3}


# a valid request with up to two fields changed or added (known ones or odd names),
# and its messages' fields too: most of them are answered, so their headers are made
good_ish = st.builds(
    lambda base, extra, msg_extra, msgs: {**base, **extra, **({"messages": [
        {**m, **msg_extra} for m in msgs]} if msgs else {})},
    st.tuples(st.sampled_from(["chat", "completion"]), odd_text).map(valid),
    st.dictionaries(fields | odd_text, json_values, max_size=2),
    st.dictionaries(odd_text | st.sampled_from(["role", "content", "name"]), json_values, max_size=2),
    st.lists(message, max_size=3),
)


def encoded(value) -> bytes:
    return json.dumps(value, allow_nan=True).encode()  # lone surrogates travel as \ud800 escapes


bodies = st.one_of(
    good_ish.map(encoded),
    json_values.map(encoded),
    st.binary(max_size=40),
    st.sampled_from([b"", b"{", b"[" * 5000, b'{"model": "fleetrl"' * 3, b"model=fleetrl&prompt=hi",
                     b'\xef\xbb\xbf{"model": 1}', b'{"model": "fleetrl", "prompt": "\\ud800"}',
                     b'{"a": NaN, "b": -Infinity, "c": 1e999}', "{\"\u65e5\": 1}".encode("utf-16")]),
)
content_types = st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                 "multipart/form-data; boundary=x", None])


def test_random_bodies_get_2xx_or_openai_4xx_and_the_endpoint_keeps_serving(tok):
    registry = AttemptRegistry(tok)
    app = create_app(FakeModel(tok, seed=2), registry, EndpointConfig(context_length=128, max_body_bytes=4096))
    key = registry.open_attempt("a", "t")
    auth = {"Authorization": f"Bearer {key}"}
    with served_in_a_thread(app) as base, httpx.Client(base_url=base, timeout=30) as http:

        @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(body=bodies, path=st.sampled_from(["chat/completions", "completions"]), ctype=content_types)
        def throw(body: bytes, path: str, ctype: str | None) -> None:
            headers = {**auth, **({"Content-Type": ctype} if ctype else {})}
            r = http.post(f"/v1/{path}", content=body, headers=headers)
            assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, (body, r.status_code, r.text)
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
                assert all(isinstance(err[f], str) and err[f] for f in ("message", "type", "code")), err
            elif r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.endswith("data: [DONE]\n\n")
            else:
                assert r.json()["usage"]["total_tokens"] >= 1

        throw()
        for path, good in (("chat/completions", chat("hi")), ("completions", {"model": "fleetrl", "prompt": "a"})):
            r = http.post(f"/v1/{path}", json=good, headers=auth)
            assert r.status_code == 200, r.text
    assert registry.close_attempt(key).calls  # the good ones, at least, were recorded


async def test_malformed_requests_found_by_the_random_test_get_named_400s(tok):
    registry = AttemptRegistry(tok)
    app = create_app(FakeModel(tok, seed=1), registry, EndpointConfig(context_length=128))
    key = registry.open_attempt("a", "t")
    auth = {"Authorization": f"Bearer {key}"}
    msgs = [{"role": "user", "content": "hi"}]
    cases = [  # (path, raw body, content type, code, param, in the message)
        ("chat/completions", encoded({"model": "fleetrl", "messages": [{"role": ["user"]}]}), "application/json",
         "invalid_type", "messages[0].role", "must be a string, got array"),
        ("chat/completions", encoded({"model": "fleetrl", "messages": [{"content": "x"}]}), "application/json",
         "invalid_type", "messages[0].role", "is required"),
        ("completions", b'{"model": "fleetrl", "prompt": "\\ud800"}', "application/json", "invalid_json", None,
         "surrogate"),
        ("completions", b"model=fleetrl&prompt=hi", "application/x-www-form-urlencoded", "invalid_json", None,
         "send application/json"),
        ("completions", '{"prompt": "x"}'.encode("utf-16"), "application/json", "invalid_json", None, "not UTF-8"),
    ]
    with trio.fail_after(60):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=20) as http:
            for path, body, ctype, code, param, says in cases:
                r = await http.post(f"/v1/{path}", content=body, headers={**auth, "Content-Type": ctype})
                err = r.json()["error"]
                assert (r.status_code, err["code"], err["param"]) == (400, code, param), (body, err)
                assert says in err["message"], err
            # a JSON body is read whatever its declared type; odd unknown names are escaped in the header
            r = await http.post("/v1/chat/completions", content=encoded(
                {"model": "fleetrl", "messages": msgs, "\u65e5": 1, " a\n": 2, "x\x7f": 3}),
                headers={**auth, "Content-Type": "text/plain"})
            assert r.status_code == 200, r.text
            assert r.headers["X-Fleetrl-Ignored-Params"] == "\\x20a\\n,x\\x7f,\\u65e5"
    (call,) = registry.close_attempt(key).calls
    assert call.ignored_params == (" a\n", "x\x7f", "\u65e5")  # the record keeps the names as sent


def test_the_endpoint_statistics_count_calls_and_refusals(tok):
    registry = AttemptRegistry(tok)
    limits = CallLimits(per_attempt=1, waiting=1)
    counts = ToolCallCounts()
    handle = EndpointHandle(registry=registry, base_url="", model_name="m", limits=limits, tool_counts=counts)
    zero = {"open_attempts": 0, "calls_in_flight": 0, "calls_waiting": 0,
            "rejected_too_many_concurrent_calls": 0, "rejected_endpoint_busy": 0, "answers_with_tool_calls": 0,
            "tool_calls": 0, "tool_call_parse_failures": 0, "sampling_overridden_requests": 0,
            "sampling_refused_requests": 0, "sampling_overridden": {}, "sampling_refused": {}}
    assert msgspec.to_builtins(handle.statistics()) == zero
    with limits.attempt_slot("k"):
        with pytest.raises(ApiError), limits.attempt_slot("k"):
            pass
        assert msgspec.to_builtins(handle.statistics()) == {**zero, "calls_in_flight": 1,
                                                           "rejected_too_many_concurrent_calls": 1}
    assert msgspec.to_builtins(handle.statistics()) == {**zero, "rejected_too_many_concurrent_calls": 1}
    counts.answers_with_tool_calls, counts.tool_calls, counts.parse_failures = 2, 3, 1
    assert msgspec.to_builtins(handle.statistics()) == {
        **zero, "rejected_too_many_concurrent_calls": 1, "answers_with_tool_calls": 2, "tool_calls": 3,
        "tool_call_parse_failures": 1}

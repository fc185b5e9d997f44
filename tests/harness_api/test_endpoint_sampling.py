"""The sampling policy through the served endpoint (hypercorn's Trio worker on 127.0.0.1,
a scripted model that keeps the `SamplingParams` it was given): ``honour`` passes a
harness's settings to the model, ``override`` samples at the run's settings and says
so in a header and a counter (streamed or not, ``n`` > 1, both routes), ``refuse``
answers OpenAI's 400 naming the parameter before anything is generated or recorded.
The remote worker's local endpoint serves the same app, with the same behaviour."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import trio
from fakes import FakeModel, serving

from fleetrl.actors.endpoint.actor import EndpointHandle, sampling_counters
from fleetrl.daemon.metrics import ActorMetrics, MetricsRegistry
from fleetrl.harness.openai_api import (
    OVERRIDDEN_HEADER,
    AttemptRegistry,
    EndpointConfig,
    SamplingCounts,
    create_app,
)
from fleetrl.harness.sampling_policy import SamplingPolicy

USER = [{"role": "user", "content": "hi"}]
WARM = {"temperature": 0.7, "top_p": 0.9}
GREEDY = {"temperature": 0}


def serve(tok, policy: SamplingPolicy, counts: SamplingCounts | None = None):
    model = FakeModel(tok, seed=5)
    registry = AttemptRegistry(tok)
    app = create_app(model, registry, EndpointConfig(sampling=policy), sampling_counts=counts)
    return model, registry, app


async def post(http: httpx.AsyncClient, key: str, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    defaults = {"model": "fleetrl", "max_tokens": 6}
    if path.endswith("chat/completions"):
        defaults["messages"] = USER
    else:
        defaults["prompt"] = "abc"
    return await http.post(path, json={**defaults, **body}, headers={"Authorization": f"Bearer {key}"})


def settings(params) -> tuple:
    return (params.temperature, params.top_p, params.top_k, params.seed)


def stream_events(r: httpx.Response) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in r.text.splitlines() if line.startswith("data: ")]


async def test_honour_passes_the_harness_settings_to_the_model(tok):
    model, registry, app = serve(tok, SamplingPolicy())
    key = registry.open_attempt("a1", "t1")
    with trio.fail_after(60):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            warm = await post(http, key, {**WARM, "top_k": 40, "seed": 7})
            greedy = await post(http, key, GREEDY)
            streamed = await post(http, key, {**WARM, "stream": True})
            comp = await post(http, key, {**WARM, "seed": 1}, "/v1/completions")
    assert [r.status_code for r in (warm, greedy, streamed, comp)] == [200] * 4
    assert all(OVERRIDDEN_HEADER not in r.headers for r in (warm, greedy, streamed, comp))
    assert [settings(p) for p in model.params] == [(0.7, 0.9, 40, 7), (0.0, 1.0, None, None), (0.7, 0.9, None, None),
                                                   (0.7, 0.9, None, 1)]
    assert len(registry.close_attempt(key).calls) == 4
    assert app.state.sampling.statistics().overridden_requests == 0


async def test_override_samples_at_the_runs_settings_and_says_so(tok):
    prometheus = MetricsRegistry()
    counts = sampling_counters(ActorMetrics(prometheus, "endpoint"))
    run = SamplingPolicy(policy="override")  # the run samples at temperature 1, top_p 1, no top_k cap
    model, registry, app = serve(tok, run, counts)
    key = registry.open_attempt("a1", "t1")
    with trio.fail_after(60):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            warm = await post(http, key, {**WARM, "seed": 7})
            greedy = await post(http, key, GREEDY)
            as_run = await post(http, key, {"temperature": 1.0})  # exactly the run's settings
            omitted = await post(http, key, {})  # the endpoint's defaults are the run's settings
            streamed = await post(http, key, {**WARM, "top_k": 40, "stream": True})
            choices = await post(http, key, {**WARM, "n": 3, "seed": 10})
            comp = await post(http, key, {"temperature": 0.5}, "/v1/completions")
            comp_stream = await post(http, key, {"top_p": 0.8, "stream": True}, "/v1/completions")
    responses = (warm, greedy, as_run, omitted, streamed, choices, comp, comp_stream)
    assert [r.status_code for r in responses] == [200] * len(responses)
    # every generation was sampled at the run's settings; the harness's seed is kept
    assert {(p.temperature, p.top_p, p.top_k) for p in model.params} == {(1.0, 1.0, None)}
    assert model.params[0].seed == 7 and sorted(p.seed for p in model.params[5:8]) == [10, 11, 12]
    # the header says what changed, on streamed responses too, and is absent when nothing did
    assert warm.headers[OVERRIDDEN_HEADER] == "temperature=0.7->1.0, top_p=0.9->1.0"
    assert greedy.headers[OVERRIDDEN_HEADER] == "temperature=0.0->1.0"
    assert OVERRIDDEN_HEADER not in as_run.headers and OVERRIDDEN_HEADER not in omitted.headers
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.headers[OVERRIDDEN_HEADER] == "temperature=0.7->1.0, top_p=0.9->1.0, top_k=40->none"
    assert stream_events(streamed)[-1] == "[DONE]"
    assert choices.headers[OVERRIDDEN_HEADER] == "temperature=0.7->1.0, top_p=0.9->1.0"
    assert len(choices.json()["choices"]) == 3
    assert comp.headers[OVERRIDDEN_HEADER] == "temperature=0.5->1.0"
    assert comp_stream.headers[OVERRIDDEN_HEADER] == "top_p=0.8->1.0"
    # the calls are recorded as usual (n = 3: three calls)
    assert len(registry.close_attempt(key).calls) == 10
    # counted once per request, per parameter changed: in the statistics and the Prometheus counters
    stats = app.state.sampling.statistics()
    assert stats.overridden_requests == 6 and stats.refused_requests == 0
    assert stats.overridden == {"temperature": 5, "top_p": 4, "top_k": 1} and stats.refused == {}
    text = prometheus.render().decode()
    assert 'fleetrl_endpoint_sampling_overridden_total{actor="endpoint",param="temperature"} 5.0' in text
    assert 'fleetrl_endpoint_sampling_overridden_total{actor="endpoint",param="top_p"} 4.0' in text
    assert 'fleetrl_endpoint_sampling_overridden_total{actor="endpoint",param="top_k"} 1.0' in text
    assert 'fleetrl_endpoint_sampling_refused_total{actor="endpoint",param="temperature"} 0.0' in text
    handle = EndpointHandle(registry=registry, base_url="", model_name="fleetrl", limits=app.state.limits,
                            tool_counts=app.state.tool_calls, sampling_counts=app.state.sampling)
    s = handle.statistics()
    assert (s.sampling_overridden_requests, s.sampling_overridden) == (6, {"temperature": 5, "top_p": 4, "top_k": 1})


async def test_override_to_a_run_temperature_other_than_the_default(tok):
    run = SamplingPolicy(policy="override", temperature=0.7, top_p=0.9)
    model, registry, app = serve(tok, run)
    key = registry.open_attempt("a1", "t1")
    with trio.fail_after(60):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            same = await post(http, key, WARM)
            omitted = await post(http, key, {})  # temperature and top_p default to 1: overridden
    assert OVERRIDDEN_HEADER not in same.headers
    assert omitted.headers[OVERRIDDEN_HEADER] == "temperature=1.0->0.7, top_p=1.0->0.9"
    assert [settings(p) for p in model.params] == [(0.7, 0.9, None, None)] * 2


@pytest.mark.parametrize(("body", "param"), [
    (GREEDY, "temperature"),
    ({"temperature": 2.0, "top_p": 0.3}, "top_p"),
    ({"top_k": 1}, "top_k"),
    ({"temperature": 0, "top_p": 0.3, "top_k": 1}, "temperature"),  # the first, in that order
])
async def test_refuse_answers_400_naming_the_parameter_and_generates_nothing(tok, body, param):
    model, registry, app = serve(tok, SamplingPolicy(policy="refuse"))
    key = registry.open_attempt("a1", "t1")
    with trio.fail_after(60):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            refused = [await post(http, key, body), await post(http, key, {**body, "stream": True}),
                       await post(http, key, {**body, "n": 3}), await post(http, key, body, "/v1/completions")]
            accepted = await post(http, key, WARM)

            def official() -> openai.BadRequestError:  # what the official client raises
                with openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=30) as c:
                    with pytest.raises(openai.BadRequestError) as info:
                        c.chat.completions.create(model="fleetrl", messages=USER, max_tokens=4, extra_body=body)
                    return info.value

            err = await trio.to_thread.run_sync(official)
    for r in refused:
        assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
        e = r.json()["error"]
        assert set(e) == {"message", "type", "param", "code"}
        assert (e["type"], e["param"], e["code"]) == ("invalid_request_error", param, "sampling_refused")
        assert e["message"].startswith(f"{param} ") and e["message"].endswith('(sampling policy "refuse")')
    assert err.body["param"] == param and err.code == "sampling_refused"
    # nothing refused reached the model or the record; the attempt keeps working
    assert accepted.status_code == 200 and [settings(p) for p in model.params] == [(0.7, 0.9, None, None)]
    record = registry.close_attempt(key)
    assert len(record.calls) == 1 and record.calls[0].index == 0
    stats = app.state.sampling.statistics()
    assert (stats.refused_requests, stats.refused, stats.overridden_requests) == (5, {param: 5}, 0)


async def test_refuse_names_the_range_and_the_policy(tok):
    model, registry, app = serve(tok, SamplingPolicy(policy="refuse", temperature_range=(0.2, 1.5)))
    key = registry.open_attempt("a1", "t1")
    with trio.fail_after(60):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as http:
            r = await post(http, key, {"temperature": 1.8})
    assert r.json()["error"]["message"] == (
        'temperature 1.8 is outside this endpoint\'s allowed range [0.2, 1.5] (sampling policy "refuse")')
    assert model.params == []


async def test_a_remote_workers_local_endpoint_applies_the_same_policy(tok):
    from fleetrl.actors.workers.client import _local_endpoint

    model = FakeModel(tok, seed=2)
    config = EndpointConfig(sampling=SamplingPolicy(policy="override"))
    with trio.fail_after(60):
        async with _local_endpoint(model, tok, config) as (registry, base_url):
            key = registry.open_attempt("a1", "t1")
            async with httpx.AsyncClient(base_url=base_url.removesuffix("/v1"), timeout=30) as http:
                r = await post(http, key, WARM)
    assert r.status_code == 200 and r.headers[OVERRIDDEN_HEADER] == "temperature=0.7->1.0, top_p=0.9->1.0"
    assert settings(model.params[0]) == (1.0, 1.0, None, None)

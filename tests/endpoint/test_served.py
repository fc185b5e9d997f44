"""The endpoint actor under an in-process Supervisor with its real http control plane:
the official `openai` client gets answers at ``http://127.0.0.1:PORT/v1`` with a
per-attempt key opened through the actor's in-process handle; bad keys and bad
requests get OpenAI-shaped 4xx answers while the daemon keeps serving; the rest of the
control plane stays behind its token; bad configs are refused with the key named."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest
import trio

from fleetrl.actors.endpoint import EndpointActorConfig, base_url_of
from fleetrl.actors.envworker import EnvWorkerConfig
from fleetrl.daemon.config import ConfigError, load_config_text
from fleetrl.harness.chat import ChatMessage
from fleetrl.harness.model import HFChatTokenizer

from .conftest import endpoint_toml, make_daemon


def chat(base_url: str, key: str, messages: list[dict], **kw):
    with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60) as client:
        return client.chat.completions.create(model="tiny", messages=messages, **kw)


async def test_openai_client_gets_answers_from_the_daemon_and_bad_keys_get_401(tmp_path, tiny_model_dir):
    sup, state = make_daemon(tmp_path, endpoint_toml(tiny_model_dir))
    with state, trio.fail_after(120):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            handle = await sup.wait_handle("endpoint")
            ctl = json.loads((state.path / "control.json").read_text())
            assert handle.base_url == f"http://127.0.0.1:{ctl['port']}/v1" and handle.model_name == "tiny"
            key = handle.registry.open_attempt("a1", "t1")
            msgs = [{"role": "user", "content": "hello there"}]
            first = await trio.to_thread.run_sync(partial(chat, handle.base_url, key, msgs, max_tokens=7))
            # a wrong key: 401 in OpenAI's shape, and the daemon keeps serving
            with pytest.raises(openai.AuthenticationError) as err:
                await trio.to_thread.run_sync(partial(chat, handle.base_url, "fleetrl-wrong", msgs))
            assert err.value.status_code == 401
            assert err.value.body["code"] == "invalid_api_key" and err.value.body["type"] == "authentication_error"
            # a bad request: 400 in OpenAI's shape, naming the parameter
            with pytest.raises(openai.BadRequestError) as bad:
                await trio.to_thread.run_sync(partial(chat, handle.base_url, key, msgs, temperature="hot"))
            assert bad.value.body["param"] == "temperature"
            msgs2 = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                            {"role": "user", "content": "more"}]
            second = await trio.to_thread.run_sync(partial(chat, handle.base_url, key, msgs2, max_tokens=5))
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{ctl['port']}") as client:
                status_no_token = await client.get("/status")
                models = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
                status = await client.get("/status", headers={"Authorization": f"Bearer {state.token}"})
                metrics = await client.get("/metrics", headers={"Authorization": f"Bearer {state.token}"})
            record = handle.registry.close_attempt(key)
            with pytest.raises(openai.AuthenticationError) as closed:
                await trio.to_thread.run_sync(partial(chat, handle.base_url, key, msgs))
            assert closed.value.body["code"] == "attempt_closed"
            sup.request_shutdown("test")
    assert first.object == "chat.completion" and first.model == "tiny"
    assert 1 <= first.usage.completion_tokens <= 7 and 1 <= second.usage.completion_tokens <= 5
    assert status_no_token.status_code == 401  # only /v1 is open without the control token
    assert models.json()["data"][0]["id"] == "tiny"
    assert status.json()["mounts"] == ["/v1"] and status.json()["actors"]["endpoint"]["state"] == "running"
    # the handle's statistics, live: one attempt was open when /status and /metrics were read
    assert status.json()["actors"]["endpoint"]["statistics"] == {
        "open_attempts": 1, "calls_in_flight": 0, "calls_waiting": 0,
        "rejected_too_many_concurrent_calls": 0, "rejected_endpoint_busy": 0, "answers_with_tool_calls": 0,
        "tool_calls": 0, "tool_call_parse_failures": 0, "sampling_overridden_requests": 0,
        "sampling_refused_requests": 0, "sampling_overridden": {}, "sampling_refused": {}}
    assert 'fleetrl_actor_statistic{actor="endpoint",name="open_attempts"} 1.0' in metrics.text
    # recorded token-exactly: the second call extends the first (no re-tokenisation)
    c0, c1 = record.calls
    assert (record.attempt_id, record.task_id) == ("a1", "t1")
    assert c0.text == first.choices[0].message.content and c1.text == second.choices[0].message.content
    assert c1.extends == 0 and c1.prompt_ids[: len(c0.prompt_ids) + len(c0.token_ids)] == c0.prompt_ids + c0.token_ids
    tok = HFChatTokenizer.from_pretrained(tiny_model_dir)
    assert c0.prompt_ids == tok.encode(tok.render([ChatMessage(role=m["role"], content=m["content"]) for m in msgs], None, True))


def test_the_base_url_is_the_control_planes_and_needs_one(tmp_path):
    with pytest.raises(ValueError, match=r"set \[http\] enabled = true"):
        base_url_of(tmp_path)
    (tmp_path / "control.json").write_text(json.dumps({"host": "0.0.0.0", "port": 8123}))
    assert base_url_of(tmp_path) == "http://127.0.0.1:8123/v1"
    (tmp_path / "control.json").write_text(json.dumps({"host": "::1", "port": 9}))
    assert base_url_of(tmp_path) == "http://[::1]:9/v1"


def load(body: str, factory: str = "fleetrl.actors.envworker:run"):
    return load_config_text(f'[actors.a]\nfactory = "{factory}"\n[actors.a.config]\n' + body, source="run.toml")


@pytest.mark.parametrize("body, message", [
    ('harness = "external"\nharness_config = {argv = ["x"]}',
     r'run.toml:3: actors.a.config: harness = "external" needs endpoint'),
    ('harness = "external"\nendpoint = "e"\nharness_config = {argv = []}', r"argv must be a non-empty list"),
    ('harness = "external"\nendpoint = "e"\nharness_config = {argv = ["x"], timout_s = 3}', r"timout_s"),
    ('harness = "external"\nendpoint = "e"\nharness_config = {argv = ["x"]}\nmodel = {kind = "local", model_dir = "m"}',
     r"model is not used"),
    ('model = {kind = "local", model_dir = "m"}\nendpoint = "e"', r"only used with harness = \"external\""),
    ('harness = "extern"\nmodel = {kind = "local", model_dir = "m"}', r"actors.a.config.harness"),
])
def test_worker_config_for_an_external_harness_is_checked(body, message):
    with pytest.raises(ConfigError, match=message):
        load(body)


def test_external_worker_config_loads():
    cfg = load('harness = "external"\nendpoint = "e"\n'
               'harness_config = {argv = ["agent", "{prompt}"], timeout_s = 30, env = {A = "1"}}').actors[0].config
    assert isinstance(cfg, EnvWorkerConfig) and cfg.model is None
    cmd = cfg.external_command()
    assert cmd.argv == ("agent", "{prompt}") and cmd.timeout_s == 30 and cmd.env == {"A": "1"}


@pytest.mark.parametrize("body, message", [
    ("", r"missing required key 'model'"),
    ('model = {kind = "local", model_dir = "m"}\ncontext_length = 0', r"actors.a.config.context_length"),
    ('model = {kind = "local", model_dir = "m"}\nmodel_name = ""', r"model_name must not be empty"),
    ('model = {kind = "local", model_dir = "m"}\nport = 3', r"actors.a.config.port: unknown key"),
])
def test_endpoint_config_is_checked(body, message):
    with pytest.raises(ConfigError, match=message):
        load(body, "fleetrl.actors.endpoint:run")
    assert isinstance(load('model = {kind = "pool", tokenizer_dir = "t"}', "fleetrl.actors.endpoint:run")
                      .actors[0].config, EndpointActorConfig)


def test_the_guides_config_examples_load_and_match_the_mini_swe_agent_helpers():
    import re
    import tomllib

    import msgspec

    from fleetrl.harness.mswea_env import mini_swe_agent_command, mini_swe_agent_env

    guide = (Path(__file__).parents[2] / "docs" / "reference" / "openai-endpoint.md").read_text()
    section = guide.split("## Serving it from the daemon", 1)[1].split("\n## ", 1)[0]
    blocks = [tomllib.loads(b) for b in re.findall(r"```toml\n(.*?)```", section, re.S)]
    endpoint = msgspec.convert(blocks[0]["actors"]["endpoint"]["config"], EndpointActorConfig)
    assert endpoint.model_name == "fleetrl"
    env = msgspec.convert(blocks[1]["actors"]["env"]["config"], EnvWorkerConfig)
    cmd = env.external_command()
    assert cmd.argv[1:] == mini_swe_agent_command(step_limit=20, max_tokens=1024)[1:]
    assert cmd.env == mini_swe_agent_env("/var/lib/fleetrl/mswea")
    # every actor the examples name exists: in the examples themselves or in the embedded default
    root = Path(__file__).parents[2]
    known = set(tomllib.loads((root / "configs" / "tiny.toml").read_text())["actors"])
    known |= {name for b in blocks for name in b["actors"]}
    for b in blocks:
        for name, actor in b["actors"].items():
            named = [*actor.get("after", []), actor["config"].get("target", "trainer"),
                     actor["config"].get("endpoint", "endpoint"), actor["config"].get("model", {}).get("pool", "pool")]
            assert set(named) <= known, (name, sorted(set(named) - known))

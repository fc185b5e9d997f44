"""Streaming through the served endpoint (hypercorn's Trio worker on 127.0.0.1): each
token goes out as the sampler produces it. With the real torch backend held after its
first decode step (`gated.GatedBackend`), the first content chunk arrives while the
generation has not ended; the streamed text is the recorded answer; a client that
disconnects gives its generation up, nothing is recorded and its slots come back. With
a scripted streaming model: tool calls and stop strings are never streamed as content."""

from __future__ import annotations

import json

import httpx
import trio
from fakes import FakeModel, serving
from gated import GatedBackend

from fleetrl.actors.envworker import LocalModelClient
from fleetrl.daemon import messages as m
from fleetrl.harness.chat import ChatMessage
from fleetrl.harness.openai_api import AttemptRegistry, EndpointConfig, create_app

USER = [{"role": "user", "content": "hi"}]


def events(lines: list[str]) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def ascii_first_seed(backend, tok, prompt: list[int]) -> int:
    """A seed whose first sampled token is a printable ASCII character (so it is content
    the moment it is decoded: no partial character, no stop-string prefix)."""
    for seed in range(200):
        (g,) = backend.generate([prompt], m.SamplingParams(max_tokens=1, temperature=1.0, seed=seed))
        text = tok.decode(g.token_ids.to_numpy().tolist())
        if len(text) == 1 and text.isalnum() and text.isascii():
            return seed
    raise AssertionError("no seed in 200 starts with an ASCII letter or digit")


async def test_first_chunk_arrives_before_the_generation_ends(tiny_torch_backend, tiny_chat_tok):
    backend = GatedBackend(tiny_torch_backend)
    client = LocalModelClient(backend, tiny_chat_tok)
    registry = AttemptRegistry(tiny_chat_tok)
    app = create_app(client, registry, EndpointConfig(model_name="tiny", context_length=1024))
    key = registry.open_attempt("a1", "t1")
    plan_ids = registry.recorder(key).plan_chat([ChatMessage(**d) for d in USER]).ids
    seed = ascii_first_seed(tiny_torch_backend, tiny_chat_tok, plan_ids)
    body = {"model": "tiny", "messages": USER, "stream": True, "max_tokens": 12, "seed": seed,
            "stream_options": {"include_usage": True}}
    lines: list[str] = []
    with trio.fail_after(120):
        async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
            async with http.stream("POST", "/v1/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                async for line in r.aiter_lines():
                    lines.append(line)
                    if line.startswith("data: {") and json.loads(line[6:])["choices"] and \
                            json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        if not backend.gate.is_set():
                            assert not backend.finished.is_set()  # the generation is still running
                            backend.gate.set()
    assert backend.finished.is_set()
    ev = events(lines)
    assert ev[-1] == "[DONE]" and ev[-2]["usage"]["completion_tokens"] >= 1
    chunks = [e for e in ev[:-2] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    (call,) = registry.close_attempt(key).calls
    assert text == call.text and call.token_ids  # streamed text is the recorded answer
    content_chunks = [e for e in chunks if e["choices"][0]["delta"].get("content")]
    assert len(content_chunks) >= 2  # the first token alone, then the rest as decoded


async def test_a_client_that_leaves_mid_stream_records_nothing_and_frees_its_slots(tiny_torch_backend, tiny_chat_tok):
    backend = GatedBackend(tiny_torch_backend)
    client = LocalModelClient(backend, tiny_chat_tok)
    registry = AttemptRegistry(tiny_chat_tok)
    app = create_app(client, registry, EndpointConfig(model_name="tiny", context_length=1024))
    key = registry.open_attempt("a1", "t1")
    body = {"model": "tiny", "messages": USER, "stream": True, "max_tokens": 12, "n": 2}
    with trio.fail_after(120):
        async with serving(app) as base:
            # a raw HTTP/1.1 client: it reads the head and the first event, then closes its socket
            host, port = base.removeprefix("http://").split(":")
            payload = json.dumps(body).encode()
            conn = await trio.open_tcp_stream(host, int(port))
            await conn.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                + f"Authorization: Bearer {key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                                + payload)
            got = b""
            while b"data: " not in got:
                got += await conn.receive_some(65536)
            assert got.startswith(b"HTTP/1.1 200")
            await conn.aclose()  # the client goes away mid-stream
            while app.state.limits.statistics().waiting:  # the server sees the disconnect
                await trio.sleep(0.05)
            backend.gate.set()
            stats = app.state.limits.statistics()
    assert stats.waiting == 0
    assert registry.close_attempt(key).calls == ()


class ScriptedStream:
    """A model client streaming a `FakeModel`'s scripted answers token by token."""

    def __init__(self, tok, replies: list[str]) -> None:
        self.inner = FakeModel(tok, replies=replies)

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    async def generate(self, prompt_ids, params):
        return await self.inner.generate(prompt_ids, params)

    async def stream(self, prompt_ids, params):
        gen = await self.inner.generate(prompt_ids, params)
        for t in gen.token_ids.to_numpy().tolist():
            await trio.lowlevel.checkpoint()
            yield m.TokenChunk(request_id=gen.request_id, token_ids=[t])
        yield gen


TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}


async def stream_chat(app, registry, body, attempt_id: str) -> list[dict | str]:
    key = registry.open_attempt(attempt_id, "t")
    async with serving(app) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        r = await http.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return events(r.text.splitlines())


async def test_tool_calls_and_stop_strings_are_never_streamed_as_content(tok):
    answer = 'Let me read it.\n<tool_call>{"name": "read_file", "arguments": {"path": "a.txt"}}</tool_call>'
    registry = AttemptRegistry(tok)
    app = create_app(ScriptedStream(tok, [answer, "one two STOP three"]), registry, EndpointConfig(model_name="m"))
    with trio.fail_after(60):
        ev = await stream_chat(app, registry, {"model": "m", "messages": USER, "stream": True, "tools": [TOOL]}, "a1")
        chunks = [e for e in ev[:-1] if e["choices"]]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert content == "Let me read it."
        calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("read_file", {"path": "a.txt"})]
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" and ev[-1] == "[DONE]"
        ev = await stream_chat(app, registry, {"model": "m", "messages": USER, "stream": True, "stop": ["STOP"]}, "a2")
        chunks = [e for e in ev[:-1] if e["choices"]]
        pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
        assert "".join(pieces) == "one two " and len([p for p in pieces if p]) > 1
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

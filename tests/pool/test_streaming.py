"""Streaming: tokens reach the caller while the sampler still decodes (issue 18 item 3).

A real torch backend on the tiny model, behind `GatedBackend`: its generation stops after
the first decode step until the test opens the gate, so a first chunk that arrives
while the gate is shut arrived before the generation ended (no wall-clock assertions:
without streaming the test would wait at the gate until `fail_after`).
"""

from __future__ import annotations

from contextlib import aclosing

import msgspec
import numpy as np
import pytest
import trio
from gated import GatedBackend

from fleetrl.actors.envworker import LocalModelClient, PoolModelClient
from fleetrl.actors.model import BOS_ID
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.pool.local import LocalSampler
from fleetrl.actors.pool.remote_client import RemoteClientConfig, serve_once
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor
from fleetrl.harness.model import ModelUnavailable, StreamingModelClient, stream_generation

from .test_remote import TOKEN, _serve


PROMPT = [BOS_ID, 104, 105]


def params(max_tokens: int = 8, *, seed: int | None = 3, stop_ids=(), temperature: float = 1.0) -> m.SamplingParams:
    return m.SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, stop_ids=tuple(stop_ids))


async def read_gated(client, backend: GatedBackend, prompt, p) -> tuple[list[m.TokenChunk], m.Generation]:
    """Stream through `client`; the gate opens only once the first chunk is in."""
    chunks: list[m.TokenChunk] = []
    final = None
    async with aclosing(client.stream(prompt, p)) as items:
        async for item in items:
            if isinstance(item, m.TokenChunk):
                if not chunks:
                    assert not backend.finished.is_set()  # the generation has not ended ...
                    assert item.token_ids  # ... and its first token is here
                    backend.gate.set()
                chunks.append(item)
            else:
                assert final is None
                final = item
    assert isinstance(final, m.Generation)
    return chunks, final


def joined(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def same_generation(a: m.Generation, b: m.Generation) -> None:
    """Every field equal but the request id."""
    assert msgspec.structs.replace(a, request_id="") == msgspec.structs.replace(b, request_id="")


# --------------------------------------------------------------------------- the local client


async def test_local_client_streams_the_first_token_before_the_generation_ends(tiny_torch_backend, tiny_chat_tok):
    backend = GatedBackend(tiny_torch_backend)
    client = LocalModelClient(backend, tiny_chat_tok, sampler_id="s0")
    assert isinstance(client, StreamingModelClient)
    with trio.fail_after(60):
        chunks, gen = await read_gated(client, backend, PROMPT, params(8))
    assert backend.finished.is_set()
    assert joined(chunks) == gen.token_ids.to_numpy().tolist()
    assert len(chunks) >= 2  # the first step's token alone, the rest as decoded
    assert {c.request_id for c in chunks} == {gen.request_id}
    (ref,) = tiny_torch_backend.generate([PROMPT], params(8))
    same_generation(gen, msgspec.structs.replace(ref, sampler=client.identity))
    assert client.calls == 1


async def test_local_client_stream_ends_with_the_right_finish_reason(tiny_torch_backend, tiny_chat_tok):
    client = LocalModelClient(tiny_torch_backend, tiny_chat_tok)
    with trio.fail_after(60):
        items = [x async for x in client.stream(PROMPT, params(6))]
        *chunks, gen = items
        assert gen.finish_reason == "length" and gen.num_tokens == 6
        assert chunks and joined(chunks) == gen.token_ids.to_numpy().tolist()  # coalesced when the reader lags
        stop = gen.token_ids.to_numpy().tolist()[2]
        first = gen.token_ids.to_numpy().tolist().index(stop)
        *chunks, cut = [x async for x in client.stream(PROMPT, params(6, stop_ids=[stop]))]
    assert cut.finish_reason == "stop"
    assert joined(chunks) == cut.token_ids.to_numpy().tolist() == gen.token_ids.to_numpy().tolist()[:first + 1]


async def test_local_client_stream_closed_early_frees_its_slot(tiny_torch_backend, tiny_chat_tok):
    backend = GatedBackend(tiny_torch_backend)
    client = LocalModelClient(backend, tiny_chat_tok, concurrency=1)
    with trio.fail_after(60):
        async with aclosing(client.stream(PROMPT, params(8))) as items:
            first = await items.__anext__()
            assert isinstance(first, m.TokenChunk)
        backend.gate.set()  # the abandoned generation stops at a step boundary; its slot comes back
        gen = await client.generate(PROMPT, params(4))
    assert gen.num_tokens == 4 and client.calls == 1
    [(_, reason, n)] = backend.finishes[:1]
    assert reason == "abort" and n <= 2


async def test_local_client_stream_turns_bad_requests_into_model_unavailable(tiny_torch_backend, tiny_chat_tok):
    client = LocalModelClient(tiny_torch_backend, tiny_chat_tok)
    with trio.fail_after(60), pytest.raises(ModelUnavailable, match="not a token id") as info:
        async for _ in client.stream([BOS_ID, 10**6], params()):
            pass
    assert info.value.retryable is False


# --------------------------------------------------------------------------- through the pool


def pool_with(backend, *, capacity: int = 1) -> SamplerPool:
    pool = SamplerPool(max_tries=2)
    sampler = LocalSampler("p0", backend, capacity=capacity)
    pool.add(sampler, sampler.identity, price_per_hour=0.0, capacity=capacity, remote=False)
    return pool


async def test_pool_client_streams_from_a_local_sampler_before_the_generation_ends(tiny_torch_backend, tiny_chat_tok):
    backend = GatedBackend(tiny_torch_backend)
    pool = pool_with(backend)
    client = PoolModelClient(pool, tiny_chat_tok).for_attempt("g/0.1")
    with trio.fail_after(60):
        chunks, gen = await read_gated(client, backend, PROMPT, params(8))
        direct = await PoolModelClient(pool_with(tiny_torch_backend), tiny_chat_tok).for_attempt("g/0.1").generate(PROMPT, params(8))
    assert joined(chunks) == gen.token_ids.to_numpy().tolist()
    same_generation(gen, direct)  # the final Generation is what generate answers: versions, sampler, seed, cost
    assert gen.sampler.sampler_id == "p0" and gen.versions.to_numpy().tolist() == [0] * gen.num_tokens
    assert pool.answered == 1 and pool.failed == 0 and pool.rerouted == 0


async def test_pool_stream_without_streaming_backend_sends_the_answer_alone(tiny_torch_backend, tiny_chat_tok):
    class Plain:  # a backend that cannot stream: no `streams_tokens`
        identity = tiny_torch_backend.identity
        weight_version = tiny_torch_backend.weight_version

        def generate(self, prompts, p):
            return tiny_torch_backend.generate(prompts, p)

        def health(self):
            return tiny_torch_backend.health()

    client = PoolModelClient(pool_with(Plain()), tiny_chat_tok)
    with trio.fail_after(60):
        items = [x async for x in client.stream(PROMPT, params(5))]
    assert len(items) == 1 and isinstance(items[0], m.Generation) and items[0].num_tokens == 5


async def test_pool_stream_with_stop_ids_and_failures(tiny_torch_backend, tiny_chat_tok):
    client = PoolModelClient(pool_with(tiny_torch_backend), tiny_chat_tok)
    with trio.fail_after(60):
        *_, ref = [x async for x in client.stream(PROMPT, params(6))]
        stop = ref.token_ids.to_numpy().tolist()[1]
        *chunks, gen = [x async for x in client.stream(PROMPT, params(6, stop_ids=[stop]))]
        assert gen.finish_reason == "stop" and joined(chunks) == gen.token_ids.to_numpy().tolist()
        assert gen.token_ids.to_numpy().tolist()[-1] == stop
        with pytest.raises(ModelUnavailable, match="sampler pool: .*not a token id"):
            async for _ in client.stream([BOS_ID, 10**6], params()):
                pass


async def test_a_closed_stream_leaks_nothing_and_its_batch_goes_on(tiny_torch_backend, tiny_chat_tok):
    """Two requests in one batch (capacity 2); the first one's reader gives up after its
    first chunk: its row stops decoding at the next step, the other is answered, the
    sampler's slots come back."""
    backend = GatedBackend(tiny_torch_backend)
    pool = pool_with(backend, capacity=2)
    client = PoolModelClient(pool, tiny_chat_tok)
    other: list[m.Generation] = []

    async def generate_other():
        other.append(await client.generate(PROMPT, params(6, seed=None)))

    async def stream_and_give_up():
        async with aclosing(client.stream(PROMPT, params(6, seed=None))) as items:
            first = await items.__anext__()
            assert isinstance(first, m.TokenChunk) and not backend.finished.is_set()
        backend.gate.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as n:  # both arrive in one scheduling round: one batch
            n.start_soon(stream_and_give_up)
            n.start_soon(generate_other)
        assert other[0].num_tokens == 6
        sampler = pool.handles["p0"]
        while sampler.statistics().running:  # the abandoned row finishes with its batch
            await trio.sleep(0.01)
        stats = sampler.statistics()
        assert stats.calls == 1 and stats.largest == 2 and stats.queued == 0  # they shared one batch
        # the abandoned row was aborted at a step boundary, by the step that waited at the gate
        (aborted, n_aborted), (length, n_length) = sorted((reason, n) for _, reason, n in backend.finishes)
        assert (aborted, length, n_length) == ("abort", "length", 6) and n_aborted <= 2
        record = pool.registry.get("p0")
        assert record.assigned == 0 and record.running == 0
        again = await client.generate(PROMPT, params(3))
    assert again.num_tokens == 3 and pool.answered == 2


async def test_stream_generation_adapts_clients_without_stream(tiny_torch_backend, tiny_chat_tok):
    class GenerateOnly:
        tokenizer = tiny_chat_tok

        async def generate(self, prompt_ids, p):
            return await LocalModelClient(tiny_torch_backend, tiny_chat_tok).generate(prompt_ids, p)

    with trio.fail_after(60):
        items = [x async for x in stream_generation(GenerateOnly(), PROMPT, params(4))]
        assert len(items) == 1 and items[0].num_tokens == 4
        *chunks, gen = [x async for x in stream_generation(LocalModelClient(tiny_torch_backend, tiny_chat_tok), PROMPT, params(4))]
    assert joined(chunks) == gen.token_ids.to_numpy().tolist()


# --------------------------------------------------------------------------- a remote sampler


async def test_remote_sampler_streams_over_its_websocket(tiny_torch_backend, tiny_chat_tok):
    backend = GatedBackend(tiny_torch_backend)
    pool = SamplerPool()
    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            url, stop = await _serve(n, pool, heartbeat_s=0.5)
            cfg = RemoteClientConfig(join_url=url, token=TOKEN, name="box")
            n.start_soon(lambda: serve_once(cfg, backend))
            while not pool.handles:
                await trio.sleep(0.02)
            [sid] = pool.handles
            client = PoolModelClient(pool, tiny_chat_tok).for_attempt("g/1.0")
            chunks, gen = await read_gated(client, backend, PROMPT, params(8))
            *more, cut = [x async for x in client.stream(PROMPT, params(8, stop_ids=[int(gen.token_ids.to_numpy()[0])]))]
            plain = await client.generate(PROMPT, params(8))
            stop.set()
            n.cancel_scope.cancel()
    assert gen.sampler.sampler_id == sid and joined(chunks) == gen.token_ids.to_numpy().tolist()
    assert len(chunks) >= 2
    same_generation(gen, plain)  # same seed: the streamed answer is the generate answer
    assert cut.finish_reason == "stop" and joined(more) == cut.token_ids.to_numpy().tolist() == [
        int(gen.token_ids.to_numpy()[0])]
    np.testing.assert_array_equal(gen.logprobs.to_numpy(), plain.logprobs.to_numpy())


# --------------------------------------------------------------------------- a lost stream


class BreaksMidStream:
    """An in-memory fake sampler: streams two tokens, then its connection drops."""

    def __init__(self, sampler_id: str) -> None:
        self.sampler_id = sampler_id
        self.identity = m.SamplerIdentity(sampler_id=sampler_id, backend="fake", device_kind="cpu", dtype="float32")
        self.calls = 0

    async def generate(self, request, started):
        raise AssertionError("a streamed request goes through stream()")

    async def stream(self, request, started):
        from fleetrl.actors.pool.errors import SamplerLost

        self.calls += 1
        started()
        yield [7, 8]
        await trio.sleep(1)
        raise SamplerLost(f"{self.sampler_id}: connection dropped")

    async def health(self):
        return True

    async def aclose(self):
        pass


async def test_a_stream_whose_sampler_is_lost_is_not_rerouted(autojump_clock):
    pool = SamplerPool(max_tries=3)
    samplers = [BreaksMidStream("a"), BreaksMidStream("b")]
    for s in samplers:
        pool.add(s, s.identity, price_per_hour=0.0, capacity=1, remote=False)
    request = m.GenerateRequest(request_id="r", attempt_id="a", prompt_ids=Tensor.from_numpy(
        np.asarray(PROMPT, dtype=np.int64)), params=params(4))
    with trio.fail_after(60):
        items = [x async for x in pool.stream(request)]
    assert [type(x) for x in items] == [m.TokenChunk, m.GenerateFailed]
    assert items[0].token_ids == [7, 8]
    failed = items[1]
    assert failed.retryable and "after streaming 2 tokens" in failed.reason and "connection dropped" in failed.reason
    assert sum(s.calls for s in samplers) == 1 and pool.rerouted == 0 and pool.failed == 1
    assert len(pool.handles) == 1  # the lost sampler is taken out, as for generate


# --------------------------------------------------------------------------- tokens that arrive while the reader holds a chunk


async def test_remote_handle_sends_tokens_that_came_while_the_reader_held_a_chunk():
    """The last chunk and the answer may both arrive while the reader is busy with the
    previous chunk: the chunk still goes out, before the answer (the race behind an
    intermittent miss of the last token over the websocket)."""
    from fleetrl.actors.pool.remote_server import RemoteSampler

    sent: list[m.GenerateRequest] = []

    async def send(msg):
        sent.append(msg)

    handle = RemoteSampler("r", send, capacity=1, heartbeat_timeout_s=60.0)
    req = m.GenerateRequest(request_id="q", attempt_id="a", prompt_ids=Tensor.from_numpy(np.asarray(PROMPT)),
                            params=params(3), stream=True)
    answer = m.GenerateFailed(request_id="q", retryable=False, reason="the answer (its kind does not matter here)")
    items = []
    with trio.fail_after(10):
        async with aclosing(handle.stream(req, lambda: None)) as stream:
            async def feed():
                while not sent:
                    await trio.sleep(0)
                assert handle.resolve(m.TokenChunk(request_id="q", token_ids=[5, 6]))

            async with trio.open_nursery() as n:
                n.start_soon(feed)
                async for item in stream:
                    items.append(item)
                    if item == [5, 6]:  # the reader is busy: the rest and the answer come in now
                        assert handle.resolve(m.TokenChunk(request_id="q", token_ids=[7]))
                        assert handle.resolve(answer)
    assert items == [[5, 6], [7], answer]

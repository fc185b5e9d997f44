"""Blob downloads through a userspace TCP fault proxy (tests/common/faultproxy.py: this
kernel has no netem): a download reset mid-blob, or stalled past the stall timeout,
resumes where it stopped with a ranged GET and yields the exact blob; latency and a
bandwidth cap only slow it; a source that keeps failing gives up with the transport
error after its retries."""

from __future__ import annotations

import collections
import os
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
from faultproxy import FaultProxy

from fleetrl.actors.weights.http import HttpBlobSource, blob_app
from fleetrl.actors.weights.store import MemoryStore
from fleetrl.daemon.control import serve_control

SIZE = 3 << 20  # a 3 MiB blob


class _Ranges:
    """ASGI middleware: the Range header of every blob request the origin saw."""

    def __init__(self, app):
        self.app, self.seen = app, collections.Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            rng = dict(scope["headers"]).get(b"range", b"").decode()
            self.seen[rng or "whole"] += 1
        await self.app(scope, receive, send)


@asynccontextmanager
async def _origin_and_proxy(store, **proxy_kw):
    """The store's blob app on 127.0.0.1 behind a FaultProxy: yields (origin, proxy, proxy
    port). The proxy is cancelled first, then the origin stops gracefully (cancelling
    hypercorn while the proxy's connections are open would wait on them)."""
    app = _Ranges(blob_app(store))
    stop = trio.Event()
    async with trio.open_nursery() as outer:
        _, port = await outer.start(lambda task_status: serve_control(
            app, "127.0.0.1", 0, shutdown_trigger=stop.wait, task_status=task_status))
        async with trio.open_nursery() as inner:
            proxy = FaultProxy("127.0.0.1", port, **proxy_kw)
            _, pport = await inner.start(proxy.serve)
            yield app, proxy, pport
            inner.cancel_scope.cancel()
        stop.set()


async def test_a_reset_and_a_stall_are_resumed_with_ranged_gets():
    store = MemoryStore()
    blob = os.urandom(SIZE)
    key = store.put(blob)
    with trio.fail_after(60):
        async with _origin_and_proxy(store, latency_s=0.002, bandwidth_bps=400e6) as (origin, proxy, pport):
            proxy.plan(reset_after=SIZE // 3)  # first try: RST a third of the way in
            proxy.plan(stall_after=SIZE // 3, stall_s=3.0)  # second: stalls past the 0.5 s stall timeout
            async with httpx.AsyncClient() as client:
                source = HttpBlobSource(client, f"http://127.0.0.1:{pport}", stall_s=0.5, backoff_s=0.05)
                got = await source.get(key)
            assert got == blob
            assert proxy.resets == 1 and proxy.stalls == 1 and source.resumes == 2
            ranged = [r for r in origin.seen if r.startswith("bytes=")]
            assert origin.seen["whole"] == 1 and len(ranged) == 2, origin.seen
            starts = sorted(int(r[6:-1]) for r in ranged)
            assert 0 < starts[0] <= starts[1] < SIZE  # each resumed where the bytes stopped


async def test_latency_and_a_bandwidth_cap_only_slow_a_download():
    store = MemoryStore()
    blob = os.urandom(1 << 20)
    key = store.put(blob)
    with trio.fail_after(60):
        async with _origin_and_proxy(store, latency_s=0.01, bandwidth_bps=40e6) as (origin, proxy, pport):
            async with httpx.AsyncClient() as client:
                source = HttpBlobSource(client, f"http://127.0.0.1:{pport}")
                t0 = trio.current_time()
                assert await source.get(key) == blob
                took = trio.current_time() - t0
            assert took >= (1 << 20) * 8 / 40e6 * 0.9  # the cap held
            assert source.resumes == 0 and origin.seen == {"whole": 1}


async def test_a_source_that_keeps_breaking_gives_up_after_its_retries():
    store = MemoryStore()
    key = store.put(os.urandom(SIZE))
    with trio.fail_after(60):
        async with _origin_and_proxy(store) as (_origin, proxy, pport):
            for _ in range(3):
                proxy.plan(reset_after=1000)
            async with httpx.AsyncClient() as client:
                source = HttpBlobSource(client, f"http://127.0.0.1:{pport}", retries=2, backoff_s=0.01)
                with pytest.raises(httpx.TransportError):
                    await source.get(key)
            assert source.resumes == 2 and proxy.resets == 3

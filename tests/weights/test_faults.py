"""Blob downloads through a userspace TCP fault proxy (tests/common/faultproxy.py: this
kernel has no netem): latency and a bandwidth cap only slow a download. (Resuming a
reset or stalled download with a ranged GET was tried on 2026-12-06 and reverted: it
made tests/e2e/test_vllm_fleet.py fail; see the issue 23 note.)"""

from __future__ import annotations

import collections
import os
from contextlib import asynccontextmanager

import httpx
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
            assert origin.seen == {"whole": 1}

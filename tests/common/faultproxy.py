"""A userspace TCP fault proxy (this kernel has no netem): it forwards connections to an
upstream address and injects latency, a bandwidth cap, resets and stalls.

    proxy = FaultProxy("127.0.0.1", upstream_port, latency_s=0.02, bandwidth_bps=50e6)
    host, port = await nursery.start(proxy.serve)
    proxy.plan(reset_after=1 << 20)          # the next connection: RST after 1 MiB downstream
    proxy.plan(stall_after=1 << 20, stall_s=5.0)

Faults are planned per connection, in the order connections arrive; a connection with
no plan is forwarded cleanly (with the latency and cap). ``reset_all()`` resets every
open connection at once (a network blip). Counters: ``connections``,
``resets``, ``stalls``, ``downstream_bytes``.

``latency_s`` is slept before forwarding each read of up to 16 KiB, one read at a time, so
it also throttles a connection to 16 KiB per ``latency_s``. A link, for measuring
transfers against a model (``bench/fleet_validate.py``), is the optional link mode:

    uplink = Uplink(50e6)                   # shared by every proxy given it
    proxy = FaultProxy("127.0.0.1", port, delay_s=0.01, bandwidth_bps=20e6, uplink=uplink)

``delay_s`` is a one-way propagation delay in each direction (a round trip of
``2 * delay_s``), pipelined: data is delivered ``delay_s`` after it was read, however much
is in flight. ``bandwidth_bps`` then caps each connection with a token bucket (it refills
while the connection waits for the uplink, so the two caps do not add up), and ``uplink``
caps the downstream of all connections of all proxies that share it (a trainer's uplink),
handed out one read at a time in turn, so connections share it max-min fairly. Link mode
forwards cleanly: it takes no plans. ``handshake=True`` (link mode) also charges a new
connection its TCP handshake over the link: one round trip (``2 * delay_s``) before its
first byte goes through (the proxy itself accepts at once, so without it a connection
opened per request, as nginx opens to its upstream, would cost no round trip).
"""

from __future__ import annotations

import math
import socket
import struct
from collections import deque
from dataclasses import dataclass

import trio

__all__ = ["FaultProxy", "Plan", "Uplink"]


@dataclass(frozen=True)
class Plan:
    reset_after: int | None = None
    """Reset (RST) both sides once this many bytes went downstream."""
    stall_after: int | None = None
    """Stop forwarding downstream after this many bytes, for ``stall_s`` seconds."""
    stall_s: float = 0.0


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, *, latency_s: float = 0.0,
                 bandwidth_bps: float | None = None, listen_host: str = "127.0.0.1",
                 delay_s: float = 0.0, uplink: Uplink | None = None, handshake: bool = False) -> None:
        if (delay_s or uplink) and latency_s:
            raise ValueError("latency_s is not a link-mode option: give delay_s instead")
        if handshake and not delay_s:
            raise ValueError("handshake is a link-mode option: it needs delay_s")
        self.upstream = (upstream_host, upstream_port)
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self.delay_s = delay_s
        self.uplink = uplink
        self.handshake = handshake
        self._link_mode = bool(delay_s or uplink)
        self.listen_host = listen_host
        self._plans: deque[Plan] = deque()
        self.connections = self.resets = self.stalls = 0
        self.downstream_bytes = 0
        self._open: dict[trio.Nursery, tuple[trio.SocketStream, trio.SocketStream]] = {}

    def reset_all(self) -> int:
        """Reset every open connection now (a network blip); returns how many."""
        n = len(self._open)
        for nursery, streams in list(self._open.items()):
            for stream in streams:
                _linger0(stream)  # their close (below) sends an RST
            nursery.cancel_scope.cancel()
        self.resets += n
        return n

    def plan(self, **kw: float) -> None:
        """Queue the faults of the next connection (`Plan`'s fields)."""
        if self._link_mode:
            raise ValueError("a link-mode proxy (delay_s, uplink) takes no plans")
        self._plans.append(Plan(**kw))  # type: ignore[arg-type]

    async def serve(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=self.listen_host)
        host, port = listeners[0].socket.getsockname()[:2]
        task_status.started((host, port))
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        plan = self._plans.popleft() if self._plans else Plan()
        if self.handshake:  # SYN, SYN-ACK over the link; the client's first bytes wait in its socket
            await trio.sleep(2 * self.delay_s)
        try:
            upstream = await trio.open_tcp_stream(*self.upstream)
        except OSError:
            await _reset(client)
            return
        try:
            async with trio.open_nursery() as nursery:
                self._open[nursery] = (client, upstream)
                if self._link_mode:
                    nursery.start_soon(self._link, client, upstream, False, nursery)
                    nursery.start_soon(self._link, upstream, client, True, nursery)
                else:
                    nursery.start_soon(self._pump, client, upstream, None, nursery)
                    nursery.start_soon(self._pump, upstream, client, plan, nursery)
        finally:
            self._open.pop(nursery, None)
            with trio.CancelScope(shield=True):
                await upstream.aclose()
                await client.aclose()

    async def _pump(self, src: trio.SocketStream, dst: trio.SocketStream, plan: Plan | None,
                    nursery: trio.Nursery) -> None:
        sent = 0
        stalled = False
        try:
            while True:
                data = await src.receive_some(16384)
                if not data:
                    await dst.send_eof()
                    return
                if self.latency_s:
                    await trio.sleep(self.latency_s)
                if plan is not None and plan.reset_after is not None and sent + len(data) > plan.reset_after:
                    data = data[: plan.reset_after - sent]
                    if data:
                        await dst.send_all(data)
                        self.downstream_bytes += len(data)
                    self.resets += 1
                    await _reset(dst)
                    await _reset(src)
                    nursery.cancel_scope.cancel()
                    return
                if plan is not None and plan.stall_after is not None and not stalled and \
                        sent + len(data) > plan.stall_after:
                    stalled = True
                    self.stalls += 1
                    await trio.sleep(plan.stall_s)
                if self.bandwidth_bps:
                    await trio.sleep(len(data) * 8 / self.bandwidth_bps)
                await dst.send_all(data)
                sent += len(data)
                if plan is not None:
                    self.downstream_bytes += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            nursery.cancel_scope.cancel()


    async def _link(self, src: trio.SocketStream, dst: trio.SocketStream, downstream: bool,
                    nursery: trio.Nursery) -> None:
        """Link mode, one direction: read, wait for this connection's link (and, downstream,
        for the shared uplink), deliver ``delay_s`` later (a reader and a writer task)."""
        own = _Bucket(self.bandwidth_bps) if self.bandwidth_bps else None
        shared = self.uplink if downstream else None
        send, recv = trio.open_memory_channel[tuple[float, bytes]](math.inf)

        async def writer() -> None:
            try:
                async for due, data in recv:
                    await trio.sleep_until(due)
                    await dst.send_all(data)
                    if downstream:
                        self.downstream_bytes += len(data)
                await dst.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                nursery.cancel_scope.cancel()

        async with trio.open_nursery() as inner:
            inner.start_soon(writer)
            async with send:
                while True:
                    try:
                        data = await src.receive_some(16384)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        nursery.cancel_scope.cancel()
                        return
                    if not data:
                        return
                    if own is not None:
                        await own.take(len(data))
                    at = trio.current_time()
                    if shared is not None:
                        at = await shared.take(len(data))
                    send.send_nowait((at + self.delay_s, data))


class _Bucket:
    """One connection's cap of `bps`: a token bucket of two reads (it refills while the
    connection waits for the shared uplink, so the two caps do not add up)."""

    def __init__(self, bps: float, burst: int = 2 * 16384) -> None:
        self.bps, self.burst = bps, burst
        self._tokens = float(burst)
        self._at = trio.current_time()

    async def take(self, n: int) -> None:
        now = trio.current_time()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.bps / 8)
        self._at = now
        self._tokens -= n
        if self._tokens < 0:
            await trio.sleep(-self._tokens * 8 / self.bps)


class Uplink:
    """A link of `bps` shared by proxies (link mode): ``take(n)`` lets one read through
    at a time, in the order they came, once the link has had time to send it (a token
    bucket of four reads, so the scheduler's wake-up delays are not lost bandwidth)."""

    def __init__(self, bps: float, burst: int = 4 * 16384) -> None:
        self.bps, self.burst = bps, burst
        self._tokens = float(burst)
        self._at: float | None = None
        self._lock = trio.Lock()

    async def take(self, n: int) -> float:
        """Wait for `n` bytes' turn; returns when they have gone through the link."""
        async with self._lock:  # FIFO: waiting connections get the link in turn
            now = trio.current_time()
            if self._at is not None:
                self._tokens = min(self.burst, self._tokens + (now - self._at) * self.bps / 8)
            self._at = now
            self._tokens -= n
            if self._tokens < 0:
                await trio.sleep(-self._tokens * 8 / self.bps)
            return trio.current_time()


def _linger0(stream: trio.SocketStream) -> None:
    """Make the stream's close send an RST, not a FIN (SO_LINGER 0)."""
    try:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


async def _reset(stream: trio.SocketStream) -> None:
    """Close with an RST."""
    _linger0(stream)
    await stream.aclose()

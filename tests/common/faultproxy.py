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
"""

from __future__ import annotations

import socket
import struct
from collections import deque
from dataclasses import dataclass

import trio

__all__ = ["FaultProxy", "Plan"]


@dataclass(frozen=True)
class Plan:
    reset_after: int | None = None
    """Reset (RST) both sides once this many bytes went downstream."""
    stall_after: int | None = None
    """Stop forwarding downstream after this many bytes, for ``stall_s`` seconds."""
    stall_s: float = 0.0


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int, *, latency_s: float = 0.0,
                 bandwidth_bps: float | None = None, listen_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
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
        self._plans.append(Plan(**kw))  # type: ignore[arg-type]

    async def serve(self, *, task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=self.listen_host)
        host, port = listeners[0].socket.getsockname()[:2]
        task_status.started((host, port))
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        self.connections += 1
        plan = self._plans.popleft() if self._plans else Plan()
        try:
            upstream = await trio.open_tcp_stream(*self.upstream)
        except OSError:
            await _reset(client)
            return
        try:
            async with trio.open_nursery() as nursery:
                self._open[nursery] = (client, upstream)
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

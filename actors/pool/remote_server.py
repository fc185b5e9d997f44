"""The join endpoint: remote samplers connect over a WebSocket and serve the pool.

Mounted on the daemon's control plane (``ctx.mount("/fleet", fleet_app(...), auth=False)``;
the endpoint authenticates itself, so that a wrong token gets a `Refused` message that
says why instead of a bare failed handshake). The route is ``<prefix>/join``. The
sampler's device price travels in `Join.price_per_hour`; samplers of earlier releases
put it in the query parameter ``price_per_hour``, which is still read when the `Join`
carries no price.

One binary WebSocket message = one msgpack message of the `FLEET` conversation:

1. sampler -> daemon: `Join` (token, identity, protocol, capacity, price per hour). A bad token, a
   first message that is not a `Join`, an undecodable frame or an old protocol is
   answered by `Refused(reason)`; the daemon then sends nothing more and waits for the
   sampler to hang up (`remote_client` does at once), closing the connection itself
   (code 1008) only after ``refuse_linger_s``. Closing at once would race the peer's
   close inside hypercorn (`close_after_peer`).
2. daemon -> sampler: `Welcome` (assigned sampler id, run id, protocol, heartbeat
   interval, newest weight version). A sampler that joined with the fleet token gets a
   fresh id ``remote-N``. The pool's own child processes (`children`) join with a token
   of their own instead, one per process start, which `Reservations` maps to the
   sampler id configured for them: that is how a child serves under its configured id.
   A reserved id held by another live sampler is refused (``sampler id ... is already
   held``); the same child reconnecting replaces its own earlier connection.
3. sampler -> daemon: `SamplerStatus` once its weights are current; only then does it
   get requests. It sends another after every version switch.
4. both ways: `Heartbeat` at least every ``heartbeat_s``. The daemon sends
   `GenerateRequest` and `WeightVersionAvailable`; the sampler answers each request
   with `Generation` or `GenerateFailed`, and, for a request with ``stream=True``,
   sends `TokenChunk`s of its tokens before that answer, as its backend decodes them (a
   sampler of an earlier release ignores ``stream`` and sends the answer alone). A
   frame that does not decode is answered with `Rejected` and the conversation goes on.
5. `Leave`, a closed connection, or ``heartbeat_timeout_s`` of silence: the sampler is
   taken out and the requests it held are routed to others (`SamplerPool.mark_dead`).
   A sampler the pool takes out for another reason (a failed health check, a request
   held past ``request_timeout_s``) has its connection closed at its next message, so a
   sampler that is still alive reconnects and joins afresh instead of lingering unused.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import msgspec
import trio
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from fleetrl.daemon import messages as m
from fleetrl.daemon.errors import BadMessage
from fleetrl.daemon.protocol import PROTOCOL_VERSION, Rejected

from .auth import token_matches
from .core import SamplerPool
from .errors import SamplerLost

__all__ = ["CLOSE_POLICY", "RemoteSampler", "Reservation", "Reservations", "close_after_peer", "fleet_app", "read_hello",
           "receive_frame"]

T = TypeVar("T")

CLOSE_POLICY = 1008
"""WebSocket close code of a refused join."""


class Reservation:
    """A sampler id reserved for one start of one child process: the token that claims
    it, and the connection that holds it now (``handle``, None while none does)."""

    def __init__(self, sampler_id: str, token: str) -> None:
        self.sampler_id = sampler_id
        self.token = token
        self.handle: RemoteSampler | None = None
        self.joins = 0
        """Connections that joined the pool with this reservation."""
        self._changed = trio.Event()

    def __repr__(self) -> str:  # never print the credential
        return f"Reservation(sampler_id={self.sampler_id!r}, joins={self.joins})"

    def connected(self, handle: RemoteSampler) -> None:
        self.handle = handle
        self.joins += 1
        self._notify()

    def disconnected(self, handle: RemoteSampler) -> None:
        if self.handle is handle:
            self.handle = None
            self._notify()

    async def wait_joined(self) -> RemoteSampler:
        """Wait until a connection holds the id; that connection's handle."""
        while self.handle is None:
            await self._changed.wait()
        return self.handle

    async def wait_left(self, handle: RemoteSampler) -> None:
        """Wait until `handle` no longer holds the id."""
        while self.handle is handle:
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


class Reservations:
    """The sampler ids reserved for the pool's child processes (`children`), by token."""

    def __init__(self) -> None:
        self._held: list[Reservation] = []

    def reserve(self, sampler_id: str) -> Reservation:
        """A new reservation of `sampler_id` with a fresh random token (an earlier
        reservation of the same id should be released first)."""
        r = Reservation(sampler_id, secrets.token_urlsafe(32))
        self._held.append(r)
        return r

    def release(self, reservation: Reservation) -> None:
        """The token stops being accepted (a connection that holds the id keeps it)."""
        self._held = [r for r in self._held if r is not reservation]

    def claim(self, token: str) -> Reservation | None:
        """The reservation whose token `token` is (compared in constant time), or None."""
        found = None
        for r in self._held:
            if token_matches(token, r.token):
                found = r
        return found


class RemoteSampler:
    """The pool's handle on one connected remote sampler."""

    def __init__(self, sampler_id: str, send: Any, *, capacity: int, heartbeat_timeout_s: float) -> None:
        self.sampler_id = sampler_id
        self._send = send
        self.capacity = capacity
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._slots = trio.Semaphore(capacity)
        self._pending: dict[str, _Pending] = {}
        self.lost: str | None = None
        self.last_heard = trio.current_time()

    async def generate(self, request: m.GenerateRequest, started: Any) -> m.Generation | m.GenerateFailed:
        answer: m.Generation | m.GenerateFailed | None = None
        if request.stream:  # nobody reads the chunks: do not ask for them
            request = msgspec.structs.replace(request, stream=False)
        async with aclosing(self.stream(request, started)) as items:
            async for item in items:
                if not isinstance(item, list):
                    answer = item
        assert answer is not None
        return answer

    async def stream(self, request: m.GenerateRequest, started: Any
                     ) -> AsyncIterator[list[int] | m.Generation | m.GenerateFailed]:
        """Send `request`; yield the ids of each `TokenChunk` the sampler sends for it
        (``request.stream``), then its answer. Raises SamplerLost."""
        async with self._slots:
            if self.lost is not None:
                raise SamplerLost(f"remote {self.sampler_id}: {self.lost}")
            if request.request_id in self._pending:
                raise SamplerLost(f"remote {self.sampler_id} already holds request {request.request_id}")
            pending = _Pending()
            self._pending[request.request_id] = pending
            try:
                started()
                try:
                    await self._send(request)
                except Exception as exc:
                    raise SamplerLost(f"remote {self.sampler_id}: send failed: {exc}") from exc
                while True:  # tokens that came in while the reader held a chunk go out before the answer
                    if pending.tokens:
                        ids, pending.tokens = pending.tokens, []
                        yield ids
                        continue
                    if pending.answer is not None:
                        yield pending.answer
                        return
                    if pending.lost:
                        raise SamplerLost(f"remote {self.sampler_id}: {self.lost}")
                    await pending.wake.wait()
                    pending.wake = trio.Event()
            finally:
                if self._pending.get(request.request_id) is pending:
                    del self._pending[request.request_id]

    def resolve(self, msg: m.Generation | m.GenerateFailed | m.TokenChunk) -> bool:
        """Hand an answer (or a chunk of tokens) to the waiting request; False if nobody
        waits for it."""
        pending = self._pending.get(msg.request_id)
        if pending is None or pending.answer is not None or pending.lost:
            return False
        if isinstance(msg, m.TokenChunk):
            pending.tokens.extend(msg.token_ids)
        else:
            pending.answer = msg
        pending.wake.set()
        return True

    def lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
        for pending in self._pending.values():
            pending.lost = True
            pending.wake.set()

    async def health(self) -> bool:
        return self.lost is None and trio.current_time() - self.last_heard <= self.heartbeat_timeout_s

    async def aclose(self) -> None:
        self.lose("closed")


class _Pending:
    """One request sent to a remote sampler: what has come back for it so far."""

    __slots__ = ("answer", "lost", "tokens", "wake")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.answer: m.Generation | m.GenerateFailed | None = None
        self.lost = False
        self.wake = trio.Event()


def fleet_app(pool: SamplerPool, *, token: str | None, run_id: str, heartbeat_s: float = 2.0,
              heartbeat_timeout_s: float = 10.0, refuse_linger_s: float = 2.0,
              reservations: Reservations | None = None,
              credentials: Callable[[str], bool] | None = None) -> Starlette:
    """The ASGI app with the ``/join`` WebSocket route (see the module docstring).
    `token`: the fleet token (None: only the `reservations`' and `credentials`' tokens
    are accepted). `credentials`: whether a token is a live issued credential that may
    join (the daemon's `CredentialStore`, role ``sampler`` or ``admin``); it is asked
    again at every heartbeat, and a sampler whose token was revoked gets `Refused` and
    leaves the pool. `refuse_linger_s`: how long a refused peer is given to hang up
    before the daemon closes the connection itself (`close_after_peer`)."""
    codec = m.FLEET
    if token is None and reservations is None and credentials is None:
        raise ValueError("fleet_app: no fleet token, reservations or credentials: nobody could join")

    async def join(ws: WebSocket) -> None:
        await ws.accept()
        lock = trio.Lock()

        async def send(msg: Any) -> None:
            data = codec.encode(msg)
            async with lock:
                await ws.send_bytes(data)

        async def refuse(reason: str) -> None:
            pool._emit("remote refused", reason=reason, client=str(ws.client), level="warning")
            try:
                await send(m.Refused(reason=reason))
                await close_after_peer(ws, refuse_linger_s, code=CLOSE_POLICY, reason=reason[:100])
            except Exception:
                pass

        try:
            legacy_price = float(ws.query_params.get("price_per_hour", "0"))
            if not (math.isfinite(legacy_price) and legacy_price >= 0):
                raise ValueError
        except ValueError:
            await refuse(f"query parameter price_per_hour={ws.query_params.get('price_per_hour')!r} "
                         "must be a finite number >= 0")
            return
        hello, problem = await read_hello(ws, codec, m.Join, heartbeat_timeout_s)
        if problem is not None:
            await refuse(problem)
            return
        reservation = reservations.claim(hello.token) if reservations is not None else None
        issued = False  # joined with an issued credential: checked again at every heartbeat
        if reservation is None and (token is None or not token_matches(hello.token, token)):
            issued = credentials is not None and credentials(hello.token)
            if not issued:
                await refuse("wrong fleet token")
                return
        if hello.protocol < 1 or hello.protocol > PROTOCOL_VERSION:
            await refuse(f"protocol {hello.protocol} not supported (this daemon speaks 1..{PROTOCOL_VERSION})")
            return
        price = hello.price_per_hour or legacy_price
        if reservation is None:
            sid = pool.new_sampler_id("remote")
        else:
            sid = reservation.sampler_id
            held = pool.handles.get(sid)
            if held is not None and held is reservation.handle:  # our own earlier connection
                pool.mark_dead(sid, "the same process joined again")
            elif held is not None:
                await refuse(f"sampler id {sid!r} is already held by another live sampler")
                return
        identity = m.SamplerIdentity(sampler_id=sid, backend=hello.identity.backend,
                                     device_kind=hello.identity.device_kind, dtype=hello.identity.dtype)
        handle = RemoteSampler(sid, send, capacity=hello.capacity, heartbeat_timeout_s=heartbeat_timeout_s)
        why = "connection closed"
        joined = False
        peer_gone = False
        try:
            await send(m.Welcome(sampler_id=sid, run_id=run_id, protocol=PROTOCOL_VERSION,
                                 heartbeat_s=heartbeat_s, version=pool.trainer_version))
            latest = pool.latest
            if latest is not None:
                await send(latest)

            async def forward_versions(msg: m.WeightVersionAvailable) -> None:
                if handle.lost is None:
                    try:
                        await send(msg)
                    except Exception:
                        handle.lose("send failed")

            revoked = False
            async with trio.open_nursery() as nursery:
                async def beat() -> None:
                    nonlocal revoked
                    while True:
                        await trio.sleep(heartbeat_s)
                        if issued and credentials is not None and not credentials(hello.token):
                            revoked = True
                            nursery.cancel_scope.cancel()
                            return
                        await send(m.Heartbeat(sampler_id=sid, sent_at=trio.current_time()))

                nursery.start_soon(beat)
                pool.on_version(forward_versions)
                try:
                    while True:
                        data = await receive_frame(ws, heartbeat_timeout_s)
                        if data is None:
                            why = f"silent for {heartbeat_timeout_s} s (or disconnected)"
                            peer_gone = True  # or silent: then nothing is waited for
                            break
                        if joined and pool.handles.get(sid) is not handle:
                            # taken out (health check, request timeout, the same child joining
                            # again): end the conversation, so a live sampler joins afresh
                            why = "taken out of the pool"
                            break
                        handle.last_heard = trio.current_time()
                        try:
                            msg = codec.decode(data)
                        except BadMessage as exc:
                            pool._emit("message rejected", sampler=sid, kind=exc.kind, detail=exc.detail,
                                       level="warning")
                            await send(Rejected(kind=exc.kind, detail=str(exc.detail)[:1024]))
                            continue
                        pool.heard_from(sid)
                        if isinstance(msg, (m.Generation, m.GenerateFailed, m.TokenChunk)):
                            handle.resolve(msg)
                        elif isinstance(msg, m.SamplerStatus):
                            if not joined:
                                pool.add(handle, identity, price_per_hour=price, capacity=hello.capacity,
                                         remote=True, version=msg.version, digest=msg.digest)
                                joined = True
                                if reservation is not None:
                                    reservation.connected(handle)
                            else:
                                pool.set_sampler_version(sid, msg.version, msg.digest)
                        elif isinstance(msg, m.Leave):
                            why = f"left: {msg.reason}"
                            break
                        elif isinstance(msg, (m.Heartbeat, Rejected)):
                            pass
                        else:
                            await send(Rejected(kind="unexpected",
                                                detail=f"{type(msg).__name__} is not sent by samplers"))
                finally:
                    pool._listeners = [f for f in pool._listeners if f is not forward_versions]
                    nursery.cancel_scope.cancel()
            if revoked:
                why = "token revoked"
                pool._emit("remote refused", reason=why, sampler=sid, client=str(ws.client), level="warning")
                await send(m.Refused(reason="token revoked"))
        except Exception as exc:  # the connection broke while sending
            why = f"{type(exc).__name__}: {exc}"
        finally:
            handle.lose(why)
            if pool.handles.get(sid) is handle:  # a reserved id may be held by a newer connection by now
                pool.mark_dead(sid, why)
            if reservation is not None:
                reservation.disconnected(handle)
            with trio.CancelScope(shield=True):
                try:
                    if peer_gone:
                        await ws.close()
                    else:  # a Leave: the sampler hangs up next
                        await close_after_peer(ws, refuse_linger_s)
                except Exception:
                    pass

    return Starlette(routes=[WebSocketRoute("/join", join)])


async def close_after_peer(ws: WebSocket, linger_s: float, *, code: int = 1000, reason: str = "") -> None:
    """End a conversation whose last word was ours: wait up to `linger_s` for the peer
    to hang up (frames it still sends are dropped), and close only if it has not.

    Closing at once would race the peer's own close: hypercorn 0.18 then answers the
    peer's close frame and ends the stream from its reading task while our close frame
    is being sent from this one, and the stream's ``send_all`` raises
    ``trio.BusyResourceError``, which takes down the whole server (every other
    connection with it). A well-behaved peer (`remote_client`) hangs up as soon as it
    reads a `Refused`, so the daemon never sends after that; a peer that does not is
    closed after `linger_s` with `code`."""
    with trio.move_on_after(linger_s):
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
    await ws.close(code=code, reason=reason)


async def read_hello(ws: WebSocket, codec: Any, kind: type[T], timeout_s: float) -> tuple[T, None] | tuple[None, str]:
    """The first message of a conversation, which must be a `kind` (a join): ``(msg,
    None)``, or ``(None, why not)`` to refuse it with (silence, a frame that does not
    decode, another message)."""
    first = await receive_frame(ws, timeout_s)
    if first is None:
        return None, f"no {kind.__name__} within {timeout_s} s"
    try:
        hello = codec.decode(first)
    except BadMessage as exc:
        return None, f"first message does not decode: {exc}"
    if not isinstance(hello, kind):
        return None, f"first message must be {kind.__name__}, got {type(hello).__name__}"
    return hello, None


async def receive_frame(ws: WebSocket, timeout_s: float) -> bytes | None:
    """The next binary frame, or None on disconnect or `timeout_s` of silence."""
    with trio.move_on_after(timeout_s):
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return None
            data = msg.get("bytes")
            if data is None and msg.get("text") is not None:
                data = msg["text"].encode()
            if data is not None:
                return data
    return None

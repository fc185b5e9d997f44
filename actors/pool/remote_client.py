"""A remote sampler: a backend in another process or host that joins the daemon's pool.

`run_remote` connects to the join endpoint (actors/pool/remote_server.py describes the
conversation), sends `Join`, and on `Welcome` catches up with the trainer's weights
(when a delta store URL is given: actors/weights' `HttpBlobSource` + `Follower`), reports
`SamplerStatus`, then serves `GenerateRequest`s with its backend (at most ``capacity``
at once; concurrent ones decoded as batches of at most ``max_batch`` through the same
`batcher.Batcher` as local samplers; a request with ``stream=True`` gets `TokenChunk`s
of its tokens as they are decoded, before its answer, coalesced while a send is under
way) and follows every `WeightVersionAvailable`.
Heartbeats go out every ``heartbeat_s``; a daemon silent for ``5 x heartbeat_s`` counts
as lost.

A lost connection is retried with exponential backoff (``backoff_base_s`` doubling up to
``backoff_max_s``, reset after a connection that served); a `Refused` join (for example
a wrong token) is not retried: `run_remote` raises `JoinRefused`; so is a `Refused` in
the middle of a session (the token revoked).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec
import trio
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection, wrap_client_stream

from fleetrl.actors.samplers.base import served_identity
from fleetrl.actors.samplers.vllm_setup import VllmEngineConfig
from fleetrl.daemon import messages as m
from fleetrl.daemon.errors import BadMessage
from fleetrl.daemon.protocol import MAX_WEBSOCKET_MESSAGE, DTypeName, Rejected
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT

from .batcher import Batcher
from .local import WeightSync
from .errors import JoinRefused, PoolError, SamplerLost

__all__ = ["JoinRefused", "RemoteClientConfig", "build_backend", "connect", "converse", "ended_by", "keep_connected", "run_remote",
           "serve_once", "ssl_context_of", "weights_bearer"]


@asynccontextmanager
async def connect(url: str, *, connect_timeout_s: float = 30.0,
                  ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[WebSocketConnection]:
    """A client WebSocket to `url` (ws:// or wss://) whose TCP stream is always closed on exit.
    A wss:// server's certificate is verified (`ssl_context`; default: the system's CAs);
    one that does not verify raises `JoinRefused` (a setting to fix, not retried).

    trio-websocket's `open_websocket_url` leaves the socket open when the *server* closes
    the connection (its client waits for a TCP close it then never performs), which would
    leak one descriptor per reconnect; owning the stream here avoids that.
    """
    parts = urlsplit(url)
    secure = parts.scheme == "wss"
    port = parts.port or (443 if secure else 80)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    with trio.fail_after(connect_timeout_s):
        if secure:
            tls = await trio.open_ssl_over_tcp_stream(parts.hostname, port,
                                                      ssl_context=ssl_context or ssl.create_default_context())
            try:  # here, not lazily inside the WebSocket handshake, which would wait out the timeout
                await tls.do_handshake()  # on a certificate it cannot verify: raises at once
            except BaseException as exc:
                await tls.transport_stream.aclose()
                if isinstance(exc.__cause__, ssl.SSLCertVerificationError):  # not retried: a setting is wrong
                    raise JoinRefused(f"cannot verify the TLS certificate of {parts.hostname}:{port}: "
                                      f"{exc.__cause__.verify_message} (give the CA that signs it: --ca-file)") from exc
                raise
            stream: trio.abc.Stream = tls
        else:
            stream = await trio.open_tcp_stream(parts.hostname, port)
    body_error: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:  # runs the reader task only
            with trio.fail_after(connect_timeout_s):
                ws = await wrap_client_stream(nursery, stream, parts.hostname, resource,
                                              max_message_size=MAX_WEBSOCKET_MESSAGE)
            try:
                yield ws
            except BaseException as exc:  # re-raised below, not wrapped in a group
                body_error = exc
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await ws.aclose()
                await stream.aclose()
                nursery.cancel_scope.cancel()
    finally:
        await stream.aclose()
    if body_error is not None:
        raise body_error



class RemoteClientConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    join_url: str
    """``ws://host:port/fleet/join`` (``wss://`` behind a TLS proxy)."""
    token: str
    backend: Literal["torch", "vllm"] = "torch"
    dtype: DTypeName = "bf16"
    model_dir: str = ""
    device: str = "cpu"
    fp8_scheme: Literal["tensor", "row", "block128"] = "block128"
    """Scale granularity of an fp8 torch backend (`TorchBackendConfig.fp8_scheme`)."""
    matmul: Literal["auto", "native", "fp32", "fp16_accumulate"] = "auto"
    """How a low-precision torch backend multiplies (`TorchBackendConfig.matmul`)."""
    price_per_hour: float = 0.0
    capacity: int = 1
    """Requests served at once (sent in `Join`: the daemon never sends more)."""
    max_batch: int = 64
    """Most requests in one backend call."""
    name: str = ""
    """Shown in logs; the daemon assigns the sampler id (a child process of the pool gets
    the id configured for it: its token claims it, `remote_server.Reservations`)."""
    weights_url: str | None = None
    """Where the weights come from: the daemon's delta store over HTTP (its ``/weights``
    mount: ``https://HOST:PORT/weights``) or an S3-compatible bucket (``s3://BUCKET/PREFIX``,
    endpoint and credentials from boto3's configuration, e.g. ``AWS_ENDPOINT_URL``);
    None: no following."""
    weights_mirror: str | None = None
    """A cache or mirror to read through first (an HTTP cache in front of the delta store,
    or an ``s3://`` mirror); what it lacks, serves stale (a manifest older than the
    announced version) or cannot deliver comes from `weights_url` (`MirrorSource`)."""
    weights_token: str | None = None
    """Bearer token for the delta store when it is behind the control plane's auth
    (None: the join token when it is an issued one, `daemon.credentials`, which a
    ``sampler`` token is: it joins and reads weights)."""
    ca_file: str | None = None
    """PEM file of the CAs that sign the daemon's certificate (wss:// and https://);
    None: the system's CAs. Verification is never off."""
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    max_support: int = DEFAULT_MAX_SUPPORT
    """The most tokens one token is drawn from (the backend's ``max_support``): the bound
    on every token's record; the daemon's pool may ask for fewer per request."""
    vllm: VllmEngineConfig = VllmEngineConfig()
    """The vLLM backend's engine settings (``--vllm JSON``)."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.join_url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError(f"join URL {self.join_url!r} must look like ws://HOST:PORT/fleet/join")
        if not self.token:
            raise ValueError("the fleet token must not be empty")
        if self.ca_file is not None and not Path(self.ca_file).is_file():
            raise ValueError(f"ca_file {self.ca_file!r} is not a file")
        for name, url in (("weights_url", self.weights_url), ("weights_mirror", self.weights_mirror)):
            if url is not None and urlsplit(url).scheme not in ("http", "https", "s3"):
                raise ValueError(f"{name} {url!r} must be an http://, https:// or s3:// location")
        if self.weights_mirror is not None and self.weights_url is None:
            raise ValueError("weights_mirror needs weights_url (the origin it falls back to)")
        if not (self.price_per_hour >= 0 and self.price_per_hour != float("inf")):
            raise ValueError(f"price_per_hour must be a finite number >= 0, got {self.price_per_hour}")
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.max_support < 1:
            raise ValueError(f"max_support must be >= 1, got {self.max_support}")
        if not (0 < self.backoff_base_s <= self.backoff_max_s):
            raise ValueError("backoff_base_s must be > 0 and <= backoff_max_s")
        if self.fp8_scheme not in ("tensor", "row", "block128"):
            raise ValueError(f"fp8_scheme must be tensor, row or block128, got {self.fp8_scheme!r}")
        if self.matmul not in ("auto", "native", "fp32", "fp16_accumulate"):
            raise ValueError(f"matmul must be auto, native, fp32 or fp16_accumulate, got {self.matmul!r}")
        if self.backend != "torch" and (self.fp8_scheme != "block128" or self.matmul != "auto"):
            raise ValueError(f"fp8_scheme and matmul are settings of the torch backend, not of {self.backend}")
        if self.backend != "vllm" and self.vllm != VllmEngineConfig():
            raise ValueError(f"--vllm holds settings of the vllm backend, not of {self.backend}")


def build_backend(cfg: RemoteClientConfig) -> Any:
    """The sampler backend named by `cfg` (loads the model; takes seconds)."""
    if not cfg.model_dir:
        raise ValueError("a model directory is needed (--model DIR)")
    if cfg.backend == "torch":
        from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig
        return TorchBackend(TorchBackendConfig(model_dir=cfg.model_dir, dtype=cfg.dtype, device=cfg.device,
                                               fp8_scheme=cfg.fp8_scheme, matmul=cfg.matmul,
                                               max_support=cfg.max_support))
    from fleetrl.actors.samplers.vllm_backend import VllmBackend, VllmBackendConfig
    return VllmBackend(VllmBackendConfig.of(cfg.model_dir, cfg.dtype, cfg.max_support, cfg.vllm))


def vllm_engine(text: str) -> VllmEngineConfig:
    """``--vllm``'s JSON object as engine settings; ValueError naming what is wrong."""
    try:
        return msgspec.json.decode(text.encode(), type=VllmEngineConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(f"--vllm: {exc}") from None


async def run_remote(cfg: RemoteClientConfig, backend: Any, *, log: Any = None,
                     max_connections: int | None = None) -> None:
    """Join and serve, reconnecting with backoff, until cancelled (or `max_connections`
    connections have ended). Raises JoinRefused when the daemon refuses us."""
    sync, clients = _weight_sync(cfg, backend)
    try:
        await keep_connected(lambda: serve_once(cfg, backend, sync=sync, log=log), base_s=cfg.backoff_base_s,
                             max_s=cfg.backoff_max_s, log=log, max_connections=max_connections,
                             lost=(_Lost,))
    finally:
        with trio.CancelScope(shield=True):
            for client in clients:
                await client.aclose()


async def keep_connected(connect_once: Callable[[], Awaitable[bool]], *, base_s: float, max_s: float, log: Any,
                         max_connections: int | None = None, lost: tuple[type[BaseException], ...] = ()) -> None:
    """Run `connect_once` (one connection; returns whether it was welcomed) again and
    again: after a lost connection (an OSError, a closed or failed WebSocket, a timeout,
    or one of `lost`) wait ``base_s``, doubling up to ``max_s``, reset after a connection
    that was welcomed. Ends after `max_connections` connections; anything else raised
    (a `JoinRefused`) ends it too."""
    delay = base_s
    n = 0
    while max_connections is None or n < max_connections:
        n += 1
        served = False
        try:
            served = await connect_once()
            why = "daemon closed the connection"
        except (OSError, ConnectionClosed, HandshakeError, trio.TooSlowError, *lost) as exc:
            why = f"{type(exc).__name__}: {exc}"
        if served:
            delay = base_s
        if log is not None:
            log.warning("connection lost; reconnecting", why=why, in_s=delay)
        if max_connections is not None and n >= max_connections:
            return
        await trio.sleep(delay)
        delay = min(delay * 2, max_s)


def ended_by(group: BaseExceptionGroup, lost: tuple[type[BaseException], ...]) -> None:
    """A connection's task group ended with `group`: raise the first `JoinRefused` in it
    (a refusal mid-session, such as a revoked token: not retried), return when the rest
    is only the connection's loss (`lost`, closed, OSError), else raise the group."""
    refused, _ = group.split(JoinRefused)
    if refused is not None:
        first: BaseException = refused
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    _, rest = group.split((ConnectionClosed, OSError, *lost))
    if rest is not None:
        raise group


class _Lost(PoolError):
    """The daemon went silent."""


def ssl_context_of(cfg: RemoteClientConfig) -> ssl.SSLContext:
    """The context that verifies the daemon's certificate: `cfg.ca_file`'s CAs, or the
    system's. A certificate in `ca_file` is trusted by itself (a pinned self-signed or
    leaf certificate: ``VERIFY_X509_PARTIAL_CHAIN``); the host name is always checked."""
    ctx = ssl.create_default_context(cafile=cfg.ca_file)
    if cfg.ca_file is not None:
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return ctx


def weights_bearer(cfg: RemoteClientConfig) -> str | None:
    """The bearer token for the delta store: the configured one, else an issued join token."""
    from fleetrl.daemon.credentials import parse_token

    if cfg.weights_token:
        return cfg.weights_token
    return cfg.token if parse_token(cfg.token) is not None else None


def _weight_sync(cfg: RemoteClientConfig, backend: Any) -> tuple[WeightSync | None, list[Any]]:
    """The backend's weight sync and the HTTP clients it uses (closed by the caller)."""
    if cfg.weights_url is None:
        return None, []
    import httpx

    bearer = weights_bearer(cfg)
    headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
    client = httpx.AsyncClient(headers=headers, timeout=60.0, verify=ssl_context_of(cfg))
    source = _weight_source(cfg.weights_url, client)
    if cfg.weights_mirror is not None:
        from fleetrl.actors.weights.mirror import MirrorSource

        # the mirror is a cache of the origin's blobs: it gets no credential of ours
        plain = httpx.AsyncClient(timeout=60.0, verify=ssl_context_of(cfg))
        return WeightSync(backend, MirrorSource(_weight_source(cfg.weights_mirror, plain), source)), [client, plain]
    return WeightSync(backend, source), [client]


def _weight_source(url: str, client: Any) -> Any:
    """The AsyncBlobSource at `url`: HTTP(S) through `client`, or an S3 bucket."""
    if url.startswith("s3://"):
        from fleetrl.actors.weights.follower import StoreSource
        from fleetrl.actors.weights.s3 import S3Store

        from .local import AsyncStoreSource

        return AsyncStoreSource(StoreSource(S3Store.from_url(url)))
    from fleetrl.actors.weights.http import HttpBlobSource

    return HttpBlobSource(client, url)


async def serve_once(cfg: RemoteClientConfig, backend: Any, *, sync: WeightSync | None = None,
                     log: Any = None) -> bool:
    """One connection: join, serve until it ends. Returns whether it was welcomed."""
    codec = m.FLEET
    async with connect(cfg.join_url, ssl_context=ssl_context_of(cfg)) as ws:
        name = cfg.name or socket.gethostname()
        me = served_identity(backend, name)
        await ws.send_message(codec.encode(m.Join(token=cfg.token, identity=me, capacity=cfg.capacity,
                                                  price_per_hour=float(cfg.price_per_hour))))
        with trio.fail_after(60):
            reply = codec.decode(await ws.get_message())
        if isinstance(reply, m.Refused):
            raise JoinRefused(reply.reason)
        if not isinstance(reply, m.Welcome):
            raise JoinRefused(f"expected Welcome or Refused, got {type(reply).__name__}")
        sid = reply.sampler_id
        identity = served_identity(backend, sid)
        lock = trio.Lock()
        batcher = Batcher(backend, identity, capacity=cfg.capacity, max_batch=cfg.max_batch)

        async def send(msg: Any) -> None:
            async with lock:
                await ws.send_message(codec.encode(msg))

        async def status() -> None:
            v = backend.weight_version
            stats = batcher.statistics()
            await send(m.SamplerStatus(sampler_id=sid, version=v.version, digest=v.digest,
                                       queue_depth=stats.queued + stats.running, tokens_per_s=0.0))

        async def follow(version: int | None = None) -> None:
            if sync is not None:
                expect = getattr(sync.source, "expect", None)  # a mirror: older than this is stale
                if version is not None and expect is not None:
                    expect(version)
                try:
                    await sync.sync()
                except Exception as exc:
                    if log is not None:
                        log.warning("weight sync failed", error=f"{type(exc).__name__}: {exc}")
            await status()

        async def serve(req: m.GenerateRequest) -> None:
            answer: m.Generation | m.GenerateFailed | None = None
            try:
                if req.stream:  # tokens out as TokenChunks while decoding, the answer last
                    async with aclosing(batcher.stream(req, lambda: None)) as items:
                        async for item in items:
                            if isinstance(item, list):
                                await send(m.TokenChunk(request_id=req.request_id, token_ids=item))
                            else:
                                answer = item
                else:
                    answer = await batcher.submit(req, lambda: None)
            except SamplerLost as exc:
                answer = m.GenerateFailed(request_id=req.request_id, retryable=True, reason=str(exc))
            await send(answer)

        await follow()
        if log is not None:
            log.info("joined", sampler=sid, version=backend.weight_version.version)
        follow_lock = trio.Lock()

        async def follow_locked(version: int | None = None) -> None:
            async with follow_lock:
                await follow(version)

        try:
            await _serve_loop(ws, codec, sid, reply.heartbeat_s, send, serve, follow_locked, log)
        except (ConnectionClosed, _Lost, OSError) as exc:
            if log is not None:
                log.warning("connection ended", why=f"{type(exc).__name__}: {exc}")
        except BaseExceptionGroup as group:
            ended_by(group, (_Lost,))  # a refusal mid-session (its token revoked) is raised: not retried
        finally:
            batcher.close("disconnected")  # the daemon re-routes what this connection held
    return True


async def _serve_loop(ws: Any, codec: Any, sid: str, heartbeat_s: float, send: Any, serve: Any,
                      follow: Any, log: Any) -> None:
    """Heartbeats out; requests and versions in, until the connection ends."""
    def dispatch(msg: Any, nursery: trio.Nursery) -> None:
        if isinstance(msg, m.GenerateRequest):
            nursery.start_soon(serve, msg)
        elif isinstance(msg, m.WeightVersionAvailable):
            nursery.start_soon(follow, msg.version)

    await converse(ws, codec, sid, heartbeat_s, send, dispatch, log=log, lost=_Lost)


async def converse(ws: Any, codec: Any, member_id: str, heartbeat_s: float, send: Any,
                   dispatch: Callable[[Any, trio.Nursery], None], *, log: Any, lost: type[Exception],
                   ready: bool = False) -> None:
    """A remote member's side of its conversation with the daemon, until it ends: a
    `Heartbeat` every `heartbeat_s` (and one at once when `ready`); each message that
    decodes to ``dispatch(msg, nursery)`` (tasks it starts end with the conversation); a
    frame that does not decode answered with `Rejected`; a `Refused` raises `JoinRefused`;
    a `Rejected` is logged; five heartbeats of silence raise `lost`."""
    async with trio.open_nursery() as nursery:
        async def beat() -> None:
            while True:
                await trio.sleep(heartbeat_s)
                await send(m.Heartbeat(sampler_id=member_id, sent_at=trio.current_time()))

        if ready:
            await send(m.Heartbeat(sampler_id=member_id, sent_at=trio.current_time()))
        nursery.start_soon(beat)
        silence = 5 * heartbeat_s
        try:
            while True:
                with trio.move_on_after(silence) as timer:
                    data = await ws.get_message()
                if timer.cancelled_caught:
                    raise lost(f"no message from the daemon for {silence} s")
                try:
                    msg = codec.decode(data)
                except BadMessage as exc:
                    await send(Rejected(kind=exc.kind, detail=str(exc.detail)[:1024]))
                    continue
                if isinstance(msg, m.Refused):
                    raise JoinRefused(msg.reason)
                if isinstance(msg, Rejected):
                    if log is not None:
                        log.warning("daemon rejected a message", kind=msg.kind, detail=msg.detail)
                    continue
                dispatch(msg, nursery)
        finally:
            nursery.cancel_scope.cancel()

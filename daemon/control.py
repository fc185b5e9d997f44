"""HTTP control plane: a Starlette app served by hypercorn's Trio worker.

Endpoints (all but ``/healthz`` need ``Authorization: Bearer <token>``: the daemon's
token in ``<state>/token`` (role ``admin``) or an issued token of a role the route is
open to (`credentials`); an unknown or revoked token gets 401, a known one whose role
the route is not open to 403, each with a JSON error body):

- ``GET /healthz``   liveness, ``{"ok": true}``
- ``GET /status``    run id, instance id, uptime, paused, draining, actors (state,
  restarts, last error, versions they report), last checkpoint
- ``GET /metrics``   Prometheus text format
- ``POST /pause``, ``POST /resume``   pause/resume admission of new work
- ``POST /shutdown`` the same graceful path as SIGTERM
- ``GET /tokens``, ``POST /tokens`` (``{"role": R, "name": N}``: the new token, shown
  once), ``DELETE /tokens/ID`` (revoke): the issued tokens

Every core endpoint is for ``admin`` only. Actors add routes with
``ctx.mount(prefix, asgi_app, auth=True, roles=(...))``: the request goes to the
mounted app with ``root_path`` extended by the prefix (``path`` stays whole, as
Starlette's own ``Mount`` does), behind the same bearer check, open to ``admin`` and
the `roles` named, unless ``auth=False`` (the app authenticates by itself).

`serve_control` serves TLS when given a certificate and key: the listener then speaks
only TLS (a plain connection fails its handshake and is closed).
"""

from __future__ import annotations

import hmac
import logging
import os
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .credentials import ROLES, Credential, CredentialError, CredentialStore, UnknownCredential, permits
from .protocol import MAX_WEBSOCKET_MESSAGE

__all__ = ["BACKLOG", "KEEP_ALIVE_S", "ControlPlane", "MountTable", "build_app", "serve_control"]

KEEP_ALIVE_S = 120.0
"""Seconds a connection may stay idle (a new one: until its request is read)."""
BACKLOG = 2048
"""Connections the kernel queues before the server accepts them (hypercorn: 100)."""

ASGIApp = Callable[[dict[str, Any], Callable[..., Awaitable[Any]], Callable[..., Awaitable[Any]]],
                   Awaitable[None]]
_PREFIX = re.compile(r"^(/[A-Za-z0-9._~-]+)+$")
_RESERVED = ("/healthz", "/status", "/metrics", "/pause", "/resume", "/shutdown", "/tokens")


class ControlPlane(Protocol):
    """What the control app needs from the supervisor."""

    def status(self) -> dict[str, Any]: ...
    def metrics_text(self) -> bytes: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def request_shutdown(self, reason: str) -> None: ...


class _Mount:
    __slots__ = ("app", "auth", "owner", "prefix", "roles")

    def __init__(self, prefix: str, app: ASGIApp, auth: bool, owner: str, roles: frozenset[str]) -> None:
        self.prefix, self.app, self.auth, self.owner, self.roles = prefix, app, auth, owner, roles


class MountTable:
    """Extra ASGI apps mounted under path prefixes by actors."""

    def __init__(self) -> None:
        self._mounts: dict[str, _Mount] = {}

    def add(self, prefix: str, app: ASGIApp, *, auth: bool, owner: str, roles: tuple[str, ...] = ()) -> None:
        """Mount `app` at `prefix`, open to ``admin`` and `roles` (with `auth`); the same
        owner may replace its own mount (restart)."""
        unknown = [r for r in roles if r not in ROLES]
        if unknown:
            raise ValueError(f"mount {prefix!r}: unknown roles {unknown} (roles: {', '.join(ROLES)})")
        if not _PREFIX.match(prefix):
            raise ValueError(f"mount prefix {prefix!r} must look like '/name' or '/a/b' "
                             "(no trailing slash)")
        if any(prefix == r or prefix.startswith(r + "/") for r in _RESERVED):
            raise ValueError(f"mount prefix {prefix!r} collides with a control endpoint")
        held = self._mounts.get(prefix)
        if held is not None and held.owner != owner:
            raise ValueError(f"mount prefix {prefix!r} is already used by actor {held.owner!r}")
        self._mounts[prefix] = _Mount(prefix, app, auth, owner, frozenset(roles))

    def remove_owner(self, owner: str) -> None:
        for prefix in [p for p, m in self._mounts.items() if m.owner == owner]:
            del self._mounts[prefix]

    def match(self, path: str) -> _Mount | None:
        best = None
        for prefix, mount in self._mounts.items():
            if (path == prefix or path.startswith(prefix + "/")) and (
                    best is None or len(prefix) > len(best.prefix)):
                best = mount
        return best

    def prefixes(self) -> list[str]:
        return sorted(self._mounts)


def _unauthorized(detail: str) -> JSONResponse:
    return JSONResponse({"error": "unauthorized", "detail": detail}, status_code=401,
                        headers={"WWW-Authenticate": 'Bearer realm="fleetrl"'})


def _forbidden(role: str, path: str) -> JSONResponse:
    return JSONResponse({"error": "forbidden", "detail": f"a {role!r} token may not use {path}"}, status_code=403)


def bearer_of(headers: list[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """(the bearer token, None), or (None, why there is none)."""
    values = [v for k, v in headers if k.lower() == b"authorization"]
    if not values:
        return None, "missing Authorization: Bearer header"
    scheme, _, given = values[0].decode("latin-1").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return None, "Authorization header must be 'Bearer <token>'"
    return given.strip(), None


class _NewToken(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    name: str = ""


def build_app(plane: ControlPlane, token: str, mounts: MountTable,
              credentials: CredentialStore | None = None) -> ASGIApp:
    """The whole control ASGI app: auth gate, mounted apps, core endpoints.
    `credentials`: the issued tokens (None: only `token`, the admin's, and no token
    management)."""

    def identify(given: str) -> Credential | None:
        if credentials is not None:
            return credentials.identify(given)
        if hmac.compare_digest(given.encode(), token.encode()):
            return Credential(id="admin", role="admin", sha256="", created=0.0)
        return None

    def no_store() -> JSONResponse:
        return JSONResponse({"error": "not found", "detail": "this control plane has no token store"},
                            status_code=404)

    async def list_tokens(_: Request) -> Response:
        if credentials is None:
            return no_store()
        try:
            return JSONResponse({"tokens": [c.public() for c in credentials.list()]})
        except CredentialError as exc:
            return JSONResponse({"error": "token file unreadable", "detail": str(exc)}, status_code=500)

    async def create_token(request: Request) -> Response:
        if credentials is None:
            return no_store()
        try:
            req = msgspec.json.decode(await request.body(), type=_NewToken)
            cred, secret = credentials.create(req.role, req.name)
        except (msgspec.DecodeError, msgspec.ValidationError, CredentialError) as exc:
            return JSONResponse({"error": "bad request", "detail": f"POST /tokens: {exc}"}, status_code=400)
        return JSONResponse({**cred.public(), "token": secret}, status_code=201)

    async def revoke_token(request: Request) -> Response:
        if credentials is None:
            return no_store()
        try:
            done = credentials.revoke(request.path_params["key"])
        except UnknownCredential as exc:
            return JSONResponse({"error": "not found", "detail": str(exc)}, status_code=404)
        except CredentialError as exc:
            return JSONResponse({"error": "token file unreadable", "detail": str(exc)}, status_code=500)
        return JSONResponse({"revoked": [c.public() for c in done]})

    async def healthz(_: Request) -> Response:
        return JSONResponse({"ok": True})

    async def status(_: Request) -> Response:
        return JSONResponse(plane.status())

    async def metrics(_: Request) -> Response:
        return Response(plane.metrics_text(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def pause(_: Request) -> Response:
        plane.pause()
        return JSONResponse({"paused": True})

    async def resume(_: Request) -> Response:
        plane.resume()
        return JSONResponse({"paused": False})

    async def shutdown(_: Request) -> Response:
        plane.request_shutdown("POST /shutdown")
        return JSONResponse({"shutting_down": True}, status_code=202)

    async def not_found(request: Request, _exc: Exception) -> Response:
        return JSONResponse({"error": "not found", "path": request.url.path}, status_code=404)

    async def bad_method(request: Request, _exc: Exception) -> Response:
        return JSONResponse({"error": "method not allowed", "path": request.url.path},
                            status_code=405)

    core = Starlette(routes=[
        Route("/healthz", healthz, methods=["GET"]),
        Route("/status", status, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/pause", pause, methods=["POST"]),
        Route("/resume", resume, methods=["POST"]),
        Route("/shutdown", shutdown, methods=["POST"]),
        Route("/tokens", list_tokens, methods=["GET"]),
        Route("/tokens", create_token, methods=["POST"]),
        Route("/tokens/{key}", revoke_token, methods=["DELETE"]),
    ], exception_handlers={404: not_found, 405: bad_method})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope.get("path", "")
        mount = mounts.match(path)
        needs_auth = mount.auth if mount is not None else path != "/healthz"
        if needs_auth:
            given, problem = bearer_of(scope.get("headers", []))
            cred = identify(given) if given is not None else None
            if given is not None and cred is None:
                problem = "unknown or revoked bearer token"
            refusal: Response | None = None
            if cred is None:
                refusal = _unauthorized(problem or "unauthorized")
            elif not permits(cred.role, mount.roles if mount is not None else ()):
                refusal = _forbidden(cred.role, path)
            if refusal is not None:
                if scope["type"] == "http":
                    await refusal(scope, receive, send)
                else:  # websocket: refuse the handshake
                    await send({"type": "websocket.close", "code": 1008})
                return
        if mount is not None:
            sub = dict(scope)
            sub["root_path"] = scope.get("root_path", "") + mount.prefix
            await mount.app(sub, receive, send)
            return
        await core(scope, receive, send)

    return app


async def serve_control(app: ASGIApp, host: str, port: int, *,
                        shutdown_trigger: Callable[[], Awaitable[Any]],
                        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
                        max_restarts: int = 10, restart_window_s: float = 60.0,
                        serve_fn: Callable[..., Awaitable[Any]] = serve,
                        certfile: str | None = None, keyfile: str | None = None,
                        ) -> None:
    """Serve `app` on host:port (0 = any free port) until `shutdown_trigger` returns;
    ``task_status.started((host, bound_port))`` once listening. With `certfile` and
    `keyfile` (PEM) it serves only TLS (1.2 or newer).

    The listening socket is ours and outlives hypercorn: a crash inside hypercorn's
    connection handling (hypercorn 0.18 can raise ``trio.BusyResourceError`` from one
    connection when a peer goes away while a reply is being sent, which cancels its
    whole server) is logged and the server is started again on the same socket, so
    the port never changes and only open connections are lost (remote samplers
    reconnect). More than `max_restarts` crashes within `restart_window_s` seconds
    re-raise the last one. `serve_fn` is hypercorn's ``serve`` (replaceable in tests).
    """
    cfg = HypercornConfig()
    cfg.accesslog = None
    quiet = logging.getLogger("fleetrl.control.hypercorn")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    cfg.errorlog = quiet
    cfg.graceful_timeout = 2.0
    # hypercorn closes a connection that is idle for keep_alive_timeout, and a new one
    # counts as idle until its request has been read: with 5 s (its default) a burst of
    # requests to a busy process (256 at once while a decode holds the GIL) was partly
    # reset before being read (docs/results/peers.md). Idle keep-alive connections stay
    # open this long too, which costs a socket each.
    cfg.keep_alive_timeout = KEEP_ALIVE_S
    cfg.backlog = BACKLOG
    cfg.websocket_max_message_size = MAX_WEBSOCKET_MESSAGE  # a remote's long Generation or Trajectory
    if (certfile is None) != (keyfile is None):
        raise ValueError("serve_control: TLS needs both a certificate and a key file")
    if certfile is not None:
        cfg.certfile, cfg.keyfile = certfile, keyfile
        cfg.alpn_protocols = ["http/1.1"]
        cfg.create_ssl_context()  # a bad file fails here, before anything listens
    log = logging.getLogger("fleetrl.control")

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(cfg.backlog)
        bound_port = listener.getsockname()[1]
        stopped = trio.Event()

        async def watch_shutdown() -> None:
            await shutdown_trigger()
            stopped.set()

        async def keep_serving(*, task_status: trio.TaskStatus[Any]) -> None:
            once = _StartedOnce(task_status)
            crashes: list[float] = []
            while not stopped.is_set():
                # hypercorn closes the socket it is given: give it a duplicate of ours
                cfg.bind = [f"fd://{os.dup(listener.fileno())}"]
                try:
                    await serve_fn(app, cfg, shutdown_trigger=stopped.wait, task_status=once)
                except Exception as exc:
                    now = trio.current_time()
                    crashes = [t for t in crashes if now - t < restart_window_s] + [now]
                    if not once.done or len(crashes) > max_restarts:
                        raise
                    log.warning("control plane server crashed; serving again on the same socket: %s: %s",
                                type(exc).__name__, exc)
                    await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_shutdown)
            await nursery.start(keep_serving)
            task_status.started((host, bound_port))
    finally:
        listener.close()


class _StartedOnce:
    """A task status that forwards only the first ``started`` (a restarted server
    calls it again)."""

    def __init__(self, inner: trio.TaskStatus[Any]) -> None:
        self.inner = inner
        self.done = False

    def started(self, value: Any = None) -> None:
        if not self.done:
            self.done = True
            self.inner.started(value)

"""The dashboard's HTTP routes (an ASGI app mounted at the actor's ``prefix``).

* ``GET /``: the page (``static/index.html``): its script shows the log-in form until a
  session exists, then opens the event stream. The page itself holds no data.
* ``GET /static/NAME``: the page's script and style, from the package (no CDN, no build).
* ``POST /login`` (form field ``token``: the daemon's control token): a session cookie
  (``HttpOnly``, ``SameSite=Strict``, ``Secure`` over TLS), then 303 to the page; a wrong
  token: 401 with the form's error. ``POST /logout`` ends the session.
* ``GET /events``: server-sent events: a ``snapshot`` event (the JSON of
  `snapshot.snapshot`) first, then a ``tick`` per refresh, the same object with only the
  series' new steps (the page appends them), or a whole ``snapshot`` again when the stream
  missed a refresh; ``GET /snapshot``: the latest whole one as JSON. A tick keeps the
  bytes per page and refresh small however long the run's charts are.
* ``GET /rollouts?task=&reward_min=&reward_max=&failure=&limit=``: the rollout log's
  groups, newest first (`rollouts.list_groups`); ``GET /rollouts/{n}``: group ``n`` laid
  out for the rollout browser (`rollouts.group_view`; 404 once the log no longer keeps it).

Every data route answers 401 without a session: the page itself holds no data.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from .rollouts import RolloutSource
from .sessions import COOKIE, Sessions

__all__ = ["Feed", "dashboard_app"]

_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html; charset=utf-8"}


class Feed:
    """The latest snapshot (JSON bytes), the same as a tick (its series hold only the steps
    the snapshot before it did not: None when there is no such snapshot), and a wake-up
    for the streams waiting for the next."""

    def __init__(self) -> None:
        self.data = b"{}"
        self.tick: bytes | None = None
        self.seq = 0
        self._next = trio.Event()
        self.streams = 0

    def publish(self, data: bytes, tick: bytes | None = None) -> None:
        self.data = data
        self.tick = tick
        self.seq += 1
        self._next.set()
        self._next = trio.Event()

    async def wait_after(self, seq: int) -> None:
        while self.seq <= seq:
            await self._next.wait()


def _static(name: str) -> bytes | None:
    if "/" in name or name.startswith(".") or not any(name.endswith(s) for s in _TYPES):
        return None
    try:
        return resources.files("fleetrl.actors.dashboard").joinpath("static", name).read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None


def _float(request: Request, name: str) -> float | None:
    raw = request.query_params.get(name, "")
    if not raw:
        return None
    value = float(raw)  # ValueError: answered 400 by the caller
    if value != value:
        raise ValueError(f"{name} is not a number")
    return value


def dashboard_app(feed: Feed, sessions: Sessions, may_log_in: Any, rollouts: RolloutSource | None = None) -> Starlette:
    """The routes (see the module docstring); `may_log_in(token)`: whether a token opens
    it; `rollouts`: the rollout log (None: the browser lists nothing)."""
    reading = trio.CapacityLimiter(1)  # one file read at a time, however many pages ask

    def session(request: Request) -> bool:
        return sessions.valid(request.cookies.get(COOKIE))

    def unauthorized() -> JSONResponse:
        return JSONResponse({"error": "log in first (POST login with the daemon's control token)"}, status_code=401)

    async def page(request: Request) -> Response:
        body = _static("index.html")
        assert body is not None
        return Response(body, media_type=_TYPES[".html"], headers={"Cache-Control": "no-store"})

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        body = _static(name)
        if body is None:
            return JSONResponse({"error": f"no file {name!r}"}, status_code=404)
        return Response(body, media_type=_TYPES["." + name.rsplit(".", 1)[-1]])

    async def login(request: Request) -> Response:
        form = await request.form()
        token = form.get("token")
        if not isinstance(token, str) or not token or not may_log_in(token):
            return JSONResponse({"error": "wrong token"}, status_code=401)
        resp = RedirectResponse(request.url_for("page").path, status_code=303)
        resp.set_cookie(COOKIE, sessions.create(), max_age=int(sessions.ttl_s), httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path=request.scope.get("root_path") or "/")
        return resp

    async def logout(request: Request) -> Response:
        sessions.end(request.cookies.get(COOKIE))
        resp = RedirectResponse(request.url_for("page").path, status_code=303)
        resp.delete_cookie(COOKIE, path=request.scope.get("root_path") or "/")
        return resp

    async def current(request: Request) -> Response:
        if not session(request):
            return unauthorized()
        return Response(feed.data, media_type="application/json", headers={"Cache-Control": "no-store"})

    async def events(request: Request) -> Response:
        if not session(request):
            return unauthorized()
        key = request.cookies.get(COOKIE)

        async def stream():  # type: ignore[no-untyped-def]
            feed.streams += 1
            try:
                seq = feed.seq
                yield b"retry: 2000\nevent: snapshot\ndata: " + feed.data + b"\n\n"
                while sessions.valid(key):
                    with trio.move_on_after(15.0):
                        await feed.wait_after(seq)
                    if feed.seq == seq:
                        yield b": keep-alive\n\n"
                        continue
                    if feed.seq == seq + 1 and feed.tick is not None:
                        seq = feed.seq
                        yield b"event: tick\ndata: " + feed.tick + b"\n\n"
                    else:
                        seq = feed.seq
                        yield b"event: snapshot\ndata: " + feed.data + b"\n\n"
            finally:
                feed.streams -= 1

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def rollout_list(request: Request) -> Response:
        if not session(request):
            return unauthorized()
        q = request.query_params
        try:
            filters = dict(task=q.get("task", ""), failure=q.get("failure", ""),
                           reward_min=_float(request, "reward_min"), reward_max=_float(request, "reward_max"),
                           limit=int(q.get("limit", "200")))
        except ValueError as exc:
            return JSONResponse({"error": f"bad filter: {exc}"}, status_code=400)
        if not 1 <= filters["limit"] <= 5000:
            return JSONResponse({"error": "bad filter: limit must be in [1, 5000]"}, status_code=400)
        if rollouts is None:
            return JSONResponse({"groups": [], "matched": 0, "failure_kinds": []})
        body = await trio.to_thread.run_sync(lambda: rollouts.listing(**filters), limiter=reading)
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    async def rollout_group(request: Request) -> Response:
        if not session(request):
            return unauthorized()
        n = request.path_params["n"]
        view = None if rollouts is None else await trio.to_thread.run_sync(rollouts.group, n, limiter=reading)
        if view is None:
            return JSONResponse({"error": f"group {n} is not in the rollout log (it keeps the newest groups)"},
                                status_code=404)
        return JSONResponse(view, headers={"Cache-Control": "no-store"})

    return Starlette(routes=[
        Route("/", page, methods=["GET"], name="page"),
        Route("/static/{name}", static, methods=["GET"]),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/snapshot", current, methods=["GET"]),
        Route("/events", events, methods=["GET"]),
        Route("/rollouts", rollout_list, methods=["GET"]),
        Route("/rollouts/{n:int}", rollout_group, methods=["GET"]),
    ])

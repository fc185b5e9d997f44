"""The ingest actor (``fleetrl.actors.ingest:run``): traces in while the daemon runs.

``run(cfg: IngestConfig, ctx, *, task_status)`` opens the task store
(`store.TaskStore`, ``<state>/<store_dir>/tasks.jsonl``), loads the configured template
tasks, mounts ``POST /v1/traces`` on the control plane (behind the daemon's bearer
token) and, with ``watch_dir``, polls that directory for trace files. Each body or file
is parsed (`parse.parse`), its new tasks are appended to the store durably, and only
then is the request answered (or the file moved to ``done/``): a SIGKILL right after a
2xx loses nothing. Environment workers pick the tasks up from the store (the
``ingested`` task source, `fleetrl.actors.envworker.sources`).

The answer (JSON): ``accepted`` (ids now stored), ``duplicates`` (ids already stored:
same content), ``errors`` (one line per entry that made no task, naming its line or
field), ``problems`` (the same, structured), ``stored`` (tasks in the store). Status:
200 when every entry was usable, 207 when some were not, 422 when none was, 400 for a
bad request (unknown format, bad option, no template), 413 for a body over
``max_body_bytes``, 405 for another method, 503 when the store cannot be written (nothing
of the request is acknowledged; send it again).

It reads no messages; at shutdown it stops once its inbox ends. The store's lock is
released when the incarnation ends, so a restarted incarnation reopens it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Never

import msgspec
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse

from fleetrl.daemon.actor import ActorContext
from fleetrl.daemon.files import fsync_dir, write_atomic
from fleetrl.harness.tasks import Task

from .config import IngestConfig
from .parse import FORMATS, ParseOptions, Problem, load_template, parse
from .store import StoreError, TaskStore

__all__ = ["PREFIX", "IngestHandle", "IngestStatistics", "Inbox", "Ingested", "run"]

PREFIX = "/v1/traces"
"""Where the route is mounted on the control plane."""

Inbox = Never
"""The ingest actor takes no messages; it serves HTTP and watches a directory."""

_MEDIA = re.compile(r"^application/vnd\.fleetrl\.(?P<fmt>[a-z-]+)\+(json|jsonl|x-ndjson)$")
_EXTENSIONS = ((".fleetrl.jsonl", "fleetrl"), (".atif.json", "atif"), (".traj.json", "mini-swe-agent"),
               (".openai.jsonl", "openai-log"))


class IngestStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What the ingest actor has taken in (this incarnation, except ``stored``)."""

    stored: int
    """Tasks in the store."""
    requests: int = 0
    """POST bodies and watched files ingested."""
    accepted: int = 0
    duplicates: int = 0
    bad_entries: int = 0
    """Entries that made no task (malformed lines, sessions without a request, ...)."""
    files_done: int = 0
    files_failed: int = 0


class Ingested(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one body or file: what `IngestHandle.ingest` returns."""

    accepted: list[str]
    duplicates: list[str]
    problems: list[Problem]
    stored: int

    @property
    def status(self) -> int:
        if not self.problems:
            return 200
        return 207 if (self.accepted or self.duplicates) else 422

    def body(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "duplicates": self.duplicates,
                "errors": [str(p) for p in self.problems],
                "problems": msgspec.to_builtins(self.problems), "stored": self.stored}


class IngestHandle:
    """The store and how to add to it (``await ctx.handle(NAME)`` gives it to others)."""

    def __init__(self, store: TaskStore, cfg: IngestConfig, templates: dict[str, Task]) -> None:
        self.store = store
        self.cfg = cfg
        self.templates = templates
        self.lock = trio.Lock()
        self.requests = self.accepted = self.duplicates = self.bad_entries = 0
        self.files_done = self.files_failed = 0

    @property
    def store_dir(self) -> Path:
        return self.store.dir

    def statistics(self) -> IngestStatistics:
        return IngestStatistics(stored=len(self.store), requests=self.requests, accepted=self.accepted,
                                duplicates=self.duplicates, bad_entries=self.bad_entries,
                                files_done=self.files_done, files_failed=self.files_failed)

    def options(self, query: dict[str, str]) -> ParseOptions:
        """Parse options from query parameters over the config's defaults; ``ValueError``
        names a bad one."""
        unknown = set(query) - {"format", "template", "from_turn", "at", "only_failed", "fail_below", "name"}
        if unknown:
            raise ValueError(f"unknown query parameter(s): {', '.join(sorted(unknown))}")
        name = query.get("template", self.cfg.default_template)
        if name is not None and name not in self.templates:
            raise ValueError(f"template={name!r}: not one of this actor's templates "
                             f"({', '.join(sorted(self.templates)) or 'none configured'})")
        try:
            from_turn = int(query["from_turn"]) if "from_turn" in query else self.cfg.from_turn
            fail_below = float(query["fail_below"]) if "fail_below" in query else self.cfg.fail_below
        except ValueError as err:
            raise ValueError(f"from_turn / fail_below: {err}") from None
        if from_turn is not None and from_turn < 0:
            raise ValueError(f"from_turn must be >= 0, got {from_turn}")
        at = query.get("at", self.cfg.at)
        if at not in ("first", "last", "every"):
            raise ValueError(f"at must be first, last or every, got {at!r}")
        flag = query.get("only_failed")
        if flag is not None and flag not in ("true", "false", "1", "0"):
            raise ValueError(f"only_failed must be true or false, got {flag!r}")
        only_failed = self.cfg.only_failed if flag is None else flag in ("true", "1")
        return ParseOptions(template=self.templates.get(name) if name else None, template_name=name or "",
                            from_turn=from_turn, at=at, only_failed=only_failed, fail_below=fail_below)

    async def ingest(self, body: bytes, fmt: str, where: str, options: ParseOptions, origin: str) -> Ingested:
        """Parse ``body`` and store its new tasks durably; returns once they are on disk.
        ``ValueError``: the request itself is wrong (format, options, template)."""
        tasks, problems = await trio.to_thread.run_sync(parse, body, fmt, where, options)
        if not tasks and not problems:
            problems = [Problem(where=where, reason="no task in the input (it is empty, or every session was "
                                                    "left out by only_failed)")]
        async with self.lock:
            result = await trio.to_thread.run_sync(lambda: self.store.append(tasks, origin=origin))
        for i, seq in result.conflicts:
            t = tasks[i]
            ref = t.source.ref if t.source is not None and t.source.ref else where
            problems.append(Problem(where=ref, field="id", reason=f"task id {t.id!r} is already stored with other "
                                                                  f"content (store seq {seq}); give it a new id"))
        out = Ingested(accepted=[rec.task.id for _, rec in result.added],
                       duplicates=[tasks[i].id for i, _ in result.duplicates], problems=problems,
                       stored=len(self.store))
        self.requests += 1
        self.accepted += len(out.accepted)
        self.duplicates += len(out.duplicates)
        self.bad_entries += len(problems)
        return out


def format_of(query_fmt: str | None, content_type: str, default: str) -> str:
    """``?format=`` first, else a Content-Type ``application/vnd.fleetrl.FORMAT+json`` (or
    ``+jsonl``) or one with a ``format=`` parameter, else ``default``."""
    if query_fmt:
        return query_fmt
    media, _, params = content_type.partition(";")
    for param in params.split(";"):
        key, _, value = param.strip().partition("=")
        if key.lower() == "format" and value:
            return value.strip('"')
    m = _MEDIA.match(media.strip().lower())
    return m.group("fmt") if m else default


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def make_app(handle: IngestHandle) -> Any:
    """The ASGI app mounted at `PREFIX` (see the module docstring)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        if request.url.path.rstrip("/") != PREFIX:
            await _error(404, f"no route {request.url.path}; POST {PREFIX}")(scope, receive, send)
            return
        if request.method != "POST":
            await _error(405, f"{request.method} {PREFIX}: only POST")(scope, receive, send)
            return
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > handle.cfg.max_body_bytes:
                await _error(413, f"body over max_body_bytes={handle.cfg.max_body_bytes}")(scope, receive, send)
                return
            chunks.append(chunk)
        query = dict(request.query_params)
        fmt = format_of(query.get("format"), request.headers.get("content-type", ""), handle.cfg.default_format)
        where = query.get("name") or "body"
        try:
            if fmt not in FORMATS:
                raise ValueError(f"unknown trace format {fmt!r} (expected one of {', '.join(FORMATS)})")
            options = handle.options(query)
            result = await handle.ingest(b"".join(chunks), fmt, where, options, origin=f"POST {PREFIX}")
        except ValueError as err:
            await _error(400, str(err))(scope, receive, send)
            return
        except StoreError as err:
            await _error(503, f"the ingest actor is not running: {err}")(scope, receive, send)
            return
        except OSError as err:  # disk full, ...: nothing of this request is acknowledged
            await _error(503, f"could not store the tasks: {err}")(scope, receive, send)
            return
        await JSONResponse(result.body(), status_code=result.status)(scope, receive, send)

    return app


# -- the watched directory -----------------------------------------------------------------

def watch_format(name: str, default: str) -> str:
    for ext, fmt in _EXTENSIONS:
        if name.endswith(ext):
            return fmt
    return default


def _candidates(directory: Path) -> dict[str, tuple[int, int]]:
    """Regular files that may be taken: name -> (size, mtime_ns)."""
    out = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return out
    for e in entries:
        if e.name.startswith(".") or e.name.endswith(".tmp") or not e.is_file(follow_symlinks=False):
            continue
        st = e.stat(follow_symlinks=False)
        out[e.name] = (st.st_size, st.st_mtime_ns)
    return out


def _move(src: Path, dest_dir: Path, errors: list[str]) -> None:
    """Move ``src`` into ``dest_dir`` (an ``.errors.txt`` beside it when there are errors),
    durably."""
    dest_dir.mkdir(exist_ok=True)
    if errors:
        write_atomic(dest_dir / f"{src.name}.errors.txt", ("\n".join(errors) + "\n").encode())
    os.replace(src, dest_dir / src.name)
    fsync_dir(dest_dir)
    fsync_dir(src.parent)


async def watch(handle: IngestHandle, directory: Path, ctx: Any) -> None:
    """Poll ``directory`` forever: take each file once it is stable for one poll."""
    directory.mkdir(parents=True, exist_ok=True)
    seen: dict[str, tuple[int, int]] = {}
    while True:
        await ctx.wait_unpaused()
        now = await trio.to_thread.run_sync(_candidates, directory)
        for name, stat in sorted(now.items()):
            if seen.get(name) != stat:
                continue  # new or still changing: look again next poll
            await ingest_file(handle, directory / name, ctx)
        seen = now
        await trio.sleep(handle.cfg.poll_s)


async def ingest_file(handle: IngestHandle, path: Path, ctx: Any) -> None:
    """Ingest one watched file and move it to ``done/`` (some task in it is stored, errors
    of other entries beside it) or ``failed/`` (nothing usable, the reasons beside it)."""
    cfg = handle.cfg
    try:
        if path.stat().st_size > cfg.max_body_bytes:
            raise ValueError(f"file over max_body_bytes={cfg.max_body_bytes}")
        body = await trio.to_thread.run_sync(path.read_bytes)
        result = await handle.ingest(body, watch_format(path.name, cfg.default_format), path.name,
                                     handle.options({}), origin=f"watch:{path.name}")
        errors = [str(p) for p in result.problems]
        ok = bool(result.accepted or result.duplicates)
    except ValueError as err:
        errors, ok, result = [f"{path.name}: {err}"], False, None
    await trio.to_thread.run_sync(_move, path, path.parent / ("done" if ok else "failed"), errors)
    if ok:
        handle.files_done += 1
    else:
        handle.files_failed += 1
    ctx.log.info("trace file ingested" if ok else "trace file failed", file=path.name,
                 accepted=len(result.accepted) if result else 0,
                 duplicates=len(result.duplicates) if result else 0, errors=len(errors))


# -- the actor --------------------------------------------------------------------------------

def _open(cfg: IngestConfig, daemon_dir: Path) -> tuple[TaskStore, dict[str, Task]]:
    templates = {}
    for name, spec in cfg.templates.items():
        try:
            templates[name] = load_template(spec, cfg.image_map)
        except ValueError as err:
            raise ValueError(f"templates.{name}: {err}") from None
    return TaskStore(daemon_dir / cfg.store_dir).open(), templates


async def run(cfg: IngestConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[IngestHandle] = trio.TASK_STATUS_IGNORED) -> None:
    """The ingest actor (see the module docstring)."""
    store, templates = await trio.to_thread.run_sync(_open, cfg, ctx.daemon_dir)
    try:
        for problem in store.problems:
            ctx.log.warning("ingest store repaired", problem=problem)
        handle = IngestHandle(store, cfg, templates)
        ctx.mount(PREFIX, make_app(handle), auth=True)
        ctx.log.info("trace ingestion ready", store=str(store.path), stored=len(store), watch_dir=cfg.watch_dir,
                     templates=sorted(templates))
        task_status.started(handle)
        async with trio.open_nursery() as nursery:
            if cfg.watch_dir is not None:
                nursery.start_soon(watch, handle, Path(cfg.watch_dir), ctx)
            async for msg in ctx.inbox:  # ends at shutdown
                ctx.log.warning("message ignored", type=type(msg).__name__)
            nursery.cancel_scope.cancel()
    finally:
        store.close()  # an append in flight has finished: worker threads are not abandoned

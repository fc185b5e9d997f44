"""A remote environment worker: `fleetrl worker --join URL --token T` (the worker's side).

`run_worker` owns a state directory on the worker's host (its lock, like a daemon's: the
sandbox sweep spares the containers of a live owner), removes the sandboxes an earlier
worker of that directory left, starts the sandbox reaper (`sandboxes.reaper`: it removes
this process's containers if it dies), then joins and serves, reconnecting with backoff.

One connection (`serve_once`, the conversation is in daemon/worker_messages.py): send
`WorkerJoin`; get `WorkerWelcome` (settings, tokenizer, signing key) and the signed
harness (`shipping.open_harness`: a pickled one only over wss://); open a sandbox pool on
this host's Docker engine; then run each `TaskAssigned` as one group with the
environment worker's own machinery (`envworker.worker._Worker.group`: attempts, retries,
sandboxes, group scoring), its model calls sent to the daemon as `GenerateRequest`s
(`RemotePool`, behind the same `PoolModelClient` a local worker uses). The group goes back
as a `RolloutGroup` (its failures as `RolloutFailed`), then `TaskEnded`. When the
connection ends, the groups in flight are cancelled and their sandboxes removed; the
daemon hands their tasks to other workers.
"""

from __future__ import annotations

import os
import re
import socket
from contextlib import asynccontextmanager
from functools import partial
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import trio
from trio_websocket import ConnectionClosed

from fleetrl.actors.envworker.model import PoolModelClient
from fleetrl.actors.envworker.fleet_row import sandbox_counts
from fleetrl.actors.envworker.worker import _Worker
from fleetrl.actors.pool.errors import JoinRefused
from fleetrl.actors.pool.remote_client import connect, converse, ended_by, keep_connected
from fleetrl.daemon import messages as m
from fleetrl.daemon import worker_messages as w
from fleetrl.daemon.metrics import ActorMetrics, MetricsRegistry
from fleetrl.daemon.protocol import Rejected
from fleetrl.harness.tasks import Task

from .config import RemoteWorkersConfig
from .errors import DaemonSilent, UnsafeHarness, WorkerSetupError
from .shipping import open_harness
from .tokenizer_files import write_tokenizer_files

__all__ = ["RemotePool", "WorkerClientConfig", "WorkerSetupError", "run_worker", "serve_once"]


class WorkerClientConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    join_url: str
    """``wss://HOST:PORT/workers/join`` (``ws://`` only for harnesses given by import path)."""
    token: str
    state_dir: str = ".fleetrl-worker"
    """This worker's own directory (lock, tokenizer, sandbox labels)."""
    groups: int = 2
    """Groups (tasks) run at once."""
    name: str = ""
    ca_file: str | None = None
    """PEM file of the CAs that sign the daemon's certificate (None: the system's)."""
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(self.join_url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ValueError(f"join URL {self.join_url!r} must look like wss://HOST:PORT/workers/join")
        if not self.token:
            raise ValueError("the worker token must not be empty (fleetrl token create --role worker)")
        if not 1 <= self.groups <= 4096:
            raise ValueError(f"groups must be 1..4096, got {self.groups}")
        if self.ca_file is not None and not Path(self.ca_file).is_file():
            raise ValueError(f"ca_file {self.ca_file!r} is not a file")
        if not (0 < self.backoff_base_s <= self.backoff_max_s):
            raise ValueError("backoff_base_s must be > 0 and <= backoff_max_s")

    @property
    def secure(self) -> bool:
        return self.join_url.startswith("wss://")


class RemotePool:
    """The sampler pool as seen from a remote worker: each request goes to the daemon over
    the connection; `resolve` hands back what comes for it (the `SamplerPool` calls the
    worker's `PoolModelClient` makes: ``generate`` and ``stream``)."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self._pending: dict[str, _Pending] = {}
        self.lost: str | None = None

    async def generate(self, request: m.GenerateRequest) -> m.Generation | m.GenerateFailed:
        answer = None
        async for item in self.stream(msgspec.structs.replace(request, stream=False)):
            answer = item
        assert answer is not None and not isinstance(answer, m.TokenChunk)
        return answer

    async def stream(self, request: m.GenerateRequest) -> AsyncIterator[m.TokenChunk | m.Generation | m.GenerateFailed]:
        rid = request.request_id
        if self.lost is not None:
            yield m.GenerateFailed(request_id=rid, retryable=True, reason=f"connection to the daemon: {self.lost}")
            return
        if rid in self._pending:
            raise ValueError(f"request {rid!r} is already in flight")
        pending = self._pending[rid] = _Pending()
        try:
            await self._send(request)
            while True:
                if pending.tokens:
                    ids, pending.tokens = pending.tokens, []
                    yield m.TokenChunk(request_id=rid, token_ids=ids)
                    continue
                if pending.answer is not None:
                    yield pending.answer
                    return
                if self.lost is not None:
                    yield m.GenerateFailed(request_id=rid, retryable=True,
                                           reason=f"connection to the daemon: {self.lost}")
                    return
                await pending.wake.wait()
                pending.wake = trio.Event()
        finally:
            self._pending.pop(rid, None)

    def resolve(self, msg: m.Generation | m.GenerateFailed | m.TokenChunk) -> bool:
        pending = self._pending.get(msg.request_id)
        if pending is None or pending.answer is not None:
            return False
        if isinstance(msg, m.TokenChunk):
            pending.tokens.extend(msg.token_ids)
        else:
            pending.answer = msg
        pending.wake.set()
        return True

    def lose(self, reason: str) -> None:
        self.lost = self.lost or reason
        for pending in self._pending.values():
            pending.wake.set()


_PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


class _Pending:
    __slots__ = ("answer", "tokens", "wake")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.answer: m.Generation | m.GenerateFailed | None = None
        self.wake = trio.Event()


class _Context:
    """What the environment worker's machinery asks of its actor context, on a worker host."""

    def __init__(self, name: str, log: Any) -> None:
        self.name = name
        self.log = log
        self.metrics = ActorMetrics(MetricsRegistry(), name)
        self.draining = False
        self.daemon_dir = None

    async def wait_draining(self) -> None:
        await trio.sleep_forever()

    async def wait_unpaused(self) -> None:
        return


class _Outcomes:
    """The cursor the machinery reports each group's end to (`TaskEnded` follows)."""

    floor = 0

    def __init__(self) -> None:
        self.ended: dict[int, str] = {}

    def finish(self, i: int) -> None:
        self.ended[i] = "finished"

    def release(self, i: int) -> None:
        self.ended[i] = "abandoned"


class _Channel:
    """``send`` of a message over the connection (the machinery's ``out``)."""

    def __init__(self, send: Any) -> None:
        self.send = send


def _log(log: Any, level: str, event: str, **kw: Any) -> None:
    if log is not None:
        getattr(log, level)(event, **kw)


async def serve_once(cfg: WorkerClientConfig, *, instance_id: str, log: Any = None) -> bool:
    """One connection: join, run assigned groups until it ends. Whether it was welcomed."""
    from fleetrl.actors.pool.remote_client import ssl_context_of
    from fleetrl.harness.model import HFChatTokenizer
    from fleetrl.sandboxes import Ownership, WarmPolicy

    codec = w.WORKERS
    async with connect(cfg.join_url, ssl_context=ssl_context_of(cfg)) as ws:  # type: ignore[arg-type]
        await ws.send_message(codec.encode(w.WorkerJoin(token=cfg.token, name=cfg.name or socket.gethostname(),
                                                        groups=cfg.groups)))
        with trio.fail_after(60):
            reply = codec.decode(await ws.get_message())
            if isinstance(reply, m.Refused):
                raise JoinRefused(reply.reason)
            if not isinstance(reply, w.WorkerWelcome):
                raise JoinRefused(f"expected WorkerWelcome or Refused, got {type(reply).__name__}")
            shipped = codec.decode(await ws.get_message())
        if not isinstance(shipped, w.HarnessShipped):
            raise JoinRefused(f"expected HarnessShipped after the welcome, got {type(shipped).__name__}")
        try:  # what this host cannot use is said once, and not retried (exit 3)
            harness = open_harness(shipped, reply.harness_key, secure=cfg.secure)
            if not _PLAIN_NAME.fullmatch(reply.run_id) or reply.run_id in (".", ".."):
                raise ValueError(f"the daemon's run id {reply.run_id!r} is not a plain name")
            try:
                settings = msgspec.msgpack.decode(reply.settings, type=RemoteWorkersConfig)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise ValueError(f"the daemon's worker settings do not decode here ({exc}): is fleetrl on this "
                                 "host the daemon's release?") from None
        except (UnsafeHarness, ValueError) as exc:
            await ws.send_message(codec.encode(m.Leave(sampler_id=reply.worker_id, reason=str(exc)[:200])))
            raise JoinRefused(str(exc)) from None
        settings = msgspec.structs.replace(settings, atif=False)
        tok_dir = write_tokenizer_files(reply.tokenizer, Path(cfg.state_dir) / "tokenizer" / reply.run_id)
        tokenizer = await trio.to_thread.run_sync(HFChatTokenizer.from_pretrained, str(tok_dir))
        wid = reply.worker_id
        lock = trio.Lock()

        async def send(msg: Any) -> None:
            data = codec.encode(msg)
            async with lock:
                await ws.send_message(data)

        remote = RemotePool(send)
        model = PoolModelClient(remote, tokenizer, min_version=settings.model.min_version)
        ctx = _Context(reply.actor, log)
        s = settings.sandbox
        ownership = Ownership.for_state_dir(cfg.state_dir, owner=instance_id, run=reply.run_id)
        policy = WarmPolicy(min_warm=s.min_warm, max_warm=s.max_warm, max_containers=s.max_containers)
        _log(log, "info", "worker joined", worker=wid, run=reply.run_id, harness=shipped.ref, via=shipped.kind)
        try:
            async with _machinery(harness, settings, model, tokenizer, ownership, policy, log) as (run_with, sandboxes):
                outcomes = _Outcomes()
                channel = _Channel(send)
                external = run_with is not harness  # the command's calls reach the model through its endpoint
                worker = _Worker(settings, ctx, harness=run_with, model=None if external else model,
                                 pool=sandboxes, out=channel, failures_out=channel,
                                 cursor=outcomes)  # type: ignore[arg-type]

                async def run_task(msg: w.TaskAssigned) -> None:
                    try:
                        task = msgspec.msgpack.decode(msg.task, type=Task)
                    except (msgspec.ValidationError, msgspec.DecodeError, ValueError) as exc:
                        _log(log, "error", "assigned task does not decode", task_number=msg.index, error=str(exc))
                        await send(Rejected(kind="invalid", detail=f"task {msg.index}: {exc}"[:1024]))
                        await send(w.TaskEnded(index=msg.index, outcome="finished"))
                        return
                    await worker.group(msg.index, task, trio.Semaphore(0))
                    await send(w.TaskEnded(index=msg.index, outcome=outcomes.ended.pop(msg.index, "abandoned")))

                async def report_load() -> None:  # with each heartbeat: the dashboard's workers table
                    while True:
                        warm, leased = sandbox_counts(sandboxes)
                        await send(w.WorkerLoad(attempts_running=worker.metrics.running, sandboxes_warm=warm,
                                                sandboxes_leased=leased))
                        await trio.sleep(reply.heartbeat_s)

                async with trio.open_nursery() as load:
                    load.start_soon(report_load)
                    await _conversation(ws, codec, wid, reply.heartbeat_s, send, remote, run_task, log)
                    load.cancel_scope.cancel()
        except (ConnectionClosed, DaemonSilent, OSError) as exc:
            _log(log, "warning", "connection ended", why=f"{type(exc).__name__}: {exc}")
        except BaseExceptionGroup as group:
            ended_by(group, (DaemonSilent,))  # a refusal mid-session (its token revoked) is raised
        finally:
            remote.lose("disconnected")
    return True


@asynccontextmanager
async def _machinery(opened: Any, settings: RemoteWorkersConfig, model: PoolModelClient, tokenizer: Any,
                     ownership: Any, policy: Any, log: Any) -> AsyncIterator[tuple[Any, Any]]:
    """The harness attempts run with, and this host's sandbox pool (every container removed
    on exit). An external command (`ExternalCommand`) gets an OpenAI-compatible endpoint
    on 127.0.0.1 that answers through the connection (`model`), and runs as an
    `ExternalHarness` against it."""
    from fleetrl.harness.external import ExternalCommand, ExternalHarness
    from fleetrl.sandboxes import open_sandbox_pool

    async with open_sandbox_pool(ownership, policy=policy) as sandboxes:
        if not isinstance(opened, ExternalCommand):
            yield opened, sandboxes
            return
        async with _local_endpoint(model, tokenizer, settings.endpoint_config) as (registry, base_url):
            harness = ExternalHarness(opened.relative_to(os.getcwd()), registry=registry, base_url=base_url,
                                      model_name=settings.endpoint_config.model_name)
            _log(log, "info", "external harness", argv=list(opened.argv), endpoint=base_url)
            try:
                yield harness, sandboxes
            finally:
                with trio.CancelScope(shield=True):
                    await harness.aclose()


@asynccontextmanager
async def _local_endpoint(model: PoolModelClient, tokenizer: Any, config: Any) -> AsyncIterator[tuple[Any, str]]:
    """The endpoint app (`harness.openai_api.create_app`) served on 127.0.0.1 (a free
    port) while the block runs: its registry and base URL."""
    from fleetrl.daemon.control import serve_control
    from fleetrl.harness.openai_api import AttemptRegistry, create_app

    registry = AttemptRegistry(tokenizer)
    app = create_app(model, registry, config)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        _, port = await nursery.start(partial(serve_control, app, "127.0.0.1", 0, shutdown_trigger=stop.wait))
        try:
            yield registry, f"http://127.0.0.1:{port}/v1"
        finally:
            stop.set()


async def _conversation(ws: Any, codec: Any, wid: str, heartbeat_s: float, send: Any, remote: RemotePool,
                        run_task: Any, log: Any) -> None:
    """Ready at once (a first heartbeat: tasks may come); tasks and model answers in,
    until the connection ends."""
    def dispatch(msg: Any, nursery: trio.Nursery) -> None:
        if isinstance(msg, w.TaskAssigned):
            nursery.start_soon(run_task, msg)
        elif isinstance(msg, (m.Generation, m.GenerateFailed, m.TokenChunk)):
            remote.resolve(msg)

    await converse(ws, codec, wid, heartbeat_s, send, dispatch, log=log, lost=DaemonSilent, ready=True)


async def run_worker(cfg: WorkerClientConfig, *, log: Any = None, max_connections: int | None = None) -> None:
    """Own the state directory, sweep, start the reaper, then join and serve with backoff
    until cancelled (or `max_connections` have ended). Raises JoinRefused when refused."""
    from fleetrl.daemon.state import StateDir
    from fleetrl.sandboxes import sweep
    from fleetrl.sandboxes.reaper import start_reaper

    state = StateDir(cfg.state_dir).open()
    reaper = None
    try:
        try:
            report = await sweep(state.path, current_instance_id=state.instance_id)
        except Exception as exc:  # docker.errors.DockerException: the engine is not reachable
            raise WorkerSetupError(f"cannot reach this host's Docker engine (sandboxes run there): {exc}") from None
        _log(log, "info", "sandbox sweep", removed=len(report.removed), errors=list(report.errors))
        reaper = start_reaper(state.path)
        await keep_connected(lambda: serve_once(cfg, instance_id=state.instance_id, log=log),
                             base_s=cfg.backoff_base_s, max_s=cfg.backoff_max_s, log=log,
                             max_connections=max_connections, lost=(DaemonSilent,))
    finally:
        state.close()
        if reaper is not None and reaper.stdin is not None:
            reaper.stdin.close()  # it sweeps (nothing is left by now) and exits

"""The daemon's side of the remote workers' conversation (daemon/worker_messages.py).

`Hub.app()` is the ASGI app with the ``/join`` WebSocket route (mounted on the control
plane under ``join_prefix``; it authenticates itself, so a wrong token gets a `Refused`
saying why). Per connected worker:

* the join is checked (a ``worker`` or admin token, re-checked at every heartbeat: a
  revoked token gets `Refused` and the worker is out), then the worker gets its
  `WorkerWelcome` and the signed `HarnessShipped`;
* once it is ready (its first `Heartbeat`), an assignment loop hands it tasks while it has free group slots (`WorkerJoin.groups`):
  requeued tasks first, then the cursor's next (`book.TaskBook`); with pacing, each
  group's G slots are admitted by the sampler pool's pacer before the task goes out
  (the hub is the pool's one pacing consumer), and groups reach the trainer in the
  pacer's release order;
* its model calls (`GenerateRequest`) are answered through the sampler pool, streamed
  when asked;
* a `RolloutGroup` (or `RolloutFailed`) must be of a task the worker holds (else
  `Rejected`, and nothing is forwarded); a group finishes its task. `TaskEnded` frees the slot (``abandoned``:
  the task is requeued);
* when the connection ends (`Leave`, closed, ``heartbeat_timeout_s`` of silence) every
  task the worker still holds is requeued: nothing admitted is lost, and a group that
  arrives twice has the same id, which the trainer refuses.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from contextlib import aclosing
from typing import Any

import msgspec
import trio
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from fleetrl.actors.envworker.fleet_row import WorkerRow
from fleetrl.actors.envworker.pacing import Paced
from fleetrl.actors.envworker.worker import group_id_of
from fleetrl.actors.pool.remote_server import CLOSE_POLICY, close_after_peer, read_hello, receive_frame
from fleetrl.daemon import messages as m
from fleetrl.daemon import worker_messages as w
from fleetrl.daemon.errors import BadMessage
from fleetrl.daemon.protocol import PROTOCOL_VERSION, Rejected

from .book import Held, TaskBook
from .shipping import new_key, ship_harness

__all__ = ["Hub", "HubStatistics"]


class HubStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What the remote workers actor has done (its handle's ``statistics()``)."""

    workers: int
    """Workers connected now."""
    joined: int
    lost: int
    """Connections that ended while holding tasks."""
    tasks_assigned: int
    tasks_held: int
    reruns: int
    """Tasks handed out again after their worker was lost or gave them up."""
    groups: int
    """Groups received and forwarded."""
    cursor_floor: int
    worker_rows: tuple[WorkerRow, ...] = ()
    """Each connected worker (by id), then the latest that left (`KEPT_GONE`), newest
    first: what the hub sees of them (their sandboxes are on their own hosts and not
    reported; the limit is ``sandbox.max_containers``, which every worker runs under)."""


KEPT_GONE = 16
"""Workers that left (or were lost) still listed in ``worker_rows``."""


def _id_order(worker_id: str) -> tuple[int, str]:
    """``worker-2`` before ``worker-10``."""
    tail = worker_id.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 0, worker_id)


class _Link:
    """One connected worker."""

    def __init__(self, worker_id: str, send: Any, groups: int, *, name: str = "", address: str = "") -> None:
        self.worker_id = worker_id
        self.send = send
        self.free = trio.Semaphore(groups)
        self.assigned: set[int] = set()
        self.name = name
        self.address = address
        self.ready = False
        self.last_seen = time.monotonic()
        self.groups: dict[str, int] = {}
        """Its groups that ended, by outcome (`WorkerRow.groups`)."""
        self.failures: dict[str, int] = {}
        """Its failed attempts forwarded, by kind."""
        self.load: w.WorkerLoad | None = None
        """What it last said it runs (None: nothing yet)."""

    def ended(self, outcome: str, n: int = 1) -> None:
        self.groups[outcome] = self.groups.get(outcome, 0) + n

    def row(self, *, limit: int, draining: bool, ended: str | None = None) -> WorkerRow:
        """This worker as a `WorkerRow` (``ended``: why its connection ended)."""
        if ended is not None:
            health = "left" if ended.startswith("left") else "lost"
        else:
            health = "draining" if draining else "up" if self.ready else "joining"
        load = None if ended is not None else self.load
        return WorkerRow(worker=self.worker_id, host=self.name, remote=True, address=self.address,
                         groups_running=0 if ended is not None else len(self.assigned), groups=dict(self.groups),
                         failures=dict(self.failures),
                         attempts_running=None if load is None else load.attempts_running,
                         sandboxes_warm=None if load is None else load.sandboxes_warm,
                         sandboxes_leased=None if load is None else load.sandboxes_leased,
                         sandboxes_limit=limit, health=health,
                         last_seen_s=round(max(0.0, time.monotonic() - self.last_seen), 3), ended=ended)


class Hub:
    """The remote workers' side of the daemon (see the module docstring)."""

    def __init__(self, cfg: Any, *, actor: str, run_id: str, book: TaskBook, source: Any, pool: Any,
                 tokenizer: dict[str, bytes], out: Any, failures_out: Any, pacing: Any, ctx: Any,
                 may_join: Any) -> None:
        self.cfg = cfg
        self.actor = actor
        self.run_id = run_id
        self.book = book
        self.source = source
        self.pool = pool
        self.tokenizer = tokenizer
        self.out = out
        self.failures_out = failures_out
        self.pacing = pacing
        self.ctx = ctx
        self.log = ctx.log
        self.may_join = may_join
        self.settings = msgspec.msgpack.encode(cfg)
        self.links: dict[str, _Link] = {}
        self.gone: deque[tuple[_Link, str]] = deque(maxlen=KEPT_GONE)
        """The latest workers whose connection ended, and why (newest last)."""
        self._ids = itertools.count(1)
        self._admissions = itertools.count(1)
        self._take = trio.Lock()
        self._requeued = trio.Event()
        self.source_exhausted = False
        self.closed = False
        self.scopes: set[trio.CancelScope] = set()
        self.joined = self.lost = self.assigned = self.groups = 0
        self.delivering = 0
        """Groups handed in and not yet delivered to the trainer (paced: awaiting release)."""
        self.nursery: trio.Nursery | None = None
        """Where deliveries wait for the pacer's release (the actor's)."""

    def statistics(self) -> HubStatistics:
        return HubStatistics(workers=len(self.links), joined=self.joined, lost=self.lost,
                             tasks_assigned=self.assigned, tasks_held=len(self.book.held), reruns=self.book.reruns,
                             groups=self.groups, cursor_floor=self.book.cursor.floor, worker_rows=self.rows())

    def rows(self) -> tuple[WorkerRow, ...]:
        """`HubStatistics.worker_rows`."""
        limit, draining = self.cfg.sandbox.max_containers, bool(self.ctx.draining)
        live = [link.row(limit=limit, draining=draining) for _, link in sorted(self.links.items(),
                                                                               key=lambda kv: _id_order(kv[0]))]
        gone = [link.row(limit=limit, draining=draining, ended=why) for link, why in reversed(self.gone)]
        return tuple(live + gone)

    def app(self) -> Starlette:
        return Starlette(routes=[WebSocketRoute("/join", self.join)])

    def close(self) -> None:
        """End every conversation (the actor is returning)."""
        self.closed = True
        for scope in list(self.scopes):
            scope.cancel()

    # -- handing out tasks --------------------------------------------------------------
    async def _task_of(self, index: int) -> Any:
        wait_get = getattr(self.source, "wait_get", None)
        if wait_get is not None:
            return await wait_get(index)
        return self.source.get(index)

    async def next_for(self, link: _Link) -> Held | None:
        """The next task for `link` (admitted by the pacer when pacing), held by it; None
        once the daemon drains."""
        async with self._take:
            while True:
                await self.ctx.wait_unpaused()
                if self.ctx.draining or self.closed:
                    return None
                if self.source_exhausted and not self.book.requeued:
                    self._requeued = trio.Event()
                    await self._requeued.wait()
                    continue
                index, task = self.book.next_index()
                if task is None:
                    try:
                        task = await self._task_of(index)
                    except BaseException:  # the worker went away meanwhile: the next one gets it
                        self.book.put_back(index)
                        raise
                    if task is None:
                        self.book.exhausted(index)
                        self.source_exhausted = True
                        self.log.info("task source exhausted", source=self.source.describe, tasks=index)
                        continue
                held = self.book.hold(index, task, group_id_of(task.id, index, self.actor), link.worker_id)
                if self.pacing is not None:  # a requeued task's earlier admission may still be in the pacer:
                    held.paced = Paced(f"{held.group_id}~{next(self._admissions)}")  # a key of its own
                    await self.pacing.admit(held.paced)
                return held

    async def assign(self, link: _Link) -> None:
        while True:
            await link.free.acquire()
            held = await self.next_for(link)
            if held is None:
                return
            link.assigned.add(held.index)
            self.assigned += 1
            await link.send(w.TaskAssigned(index=held.index, task=msgspec.msgpack.encode(held.task)))

    def _unpace(self, held: Held, group: m.RolloutGroup | None) -> None:
        if held.paced is not None and self.pacing is not None:
            self.pacing.finish_paced(held.paced, group)
            held.paced = None

    def requeued(self, held: Held, why: str) -> None:
        self._unpace(held, None)
        self._requeued.set()
        self.log.warning("task requeued", task=held.task.id, task_number=held.index, group=held.group_id,
                         worker=held.worker, why=why)

    # -- what a worker sends ------------------------------------------------------------
    async def group_in(self, link: _Link, msg: m.RolloutGroup) -> str | None:
        """Forward a worker's group; the reason it is not forwarded, or None."""
        held = self.book.of_group(msg.group_id, link.worker_id)
        if held is None:
            return f"group {msg.group_id!r} is not the group of a task this worker holds"
        if msg.task_id != held.task.id:
            return f"group {msg.group_id!r} names task {msg.task_id!r}, not {held.task.id!r}"
        self.book.hand_in(held.index, link.worker_id)
        self.groups += 1
        link.ended("emitted")
        self.delivering += 1
        paced = held.paced
        if paced is not None and self.pacing is not None:
            self._unpace(held, msg)  # the pacer's release order sends it (`release_in_order`)
            assert self.nursery is not None  # set by the actor before any worker joins
            self.nursery.start_soon(self._finish_when_released, held.index, paced)
        else:
            try:
                await self.out.send(msg)
            except BaseException:  # cancelled before the trainer's inbox took it: it goes out again
                self.book.put_back(held.index, held.task)
                self._requeued.set()
                raise
            else:
                self.book.cursor.finish(held.index)
            finally:
                self.delivering -= 1
        return None

    async def _finish_when_released(self, index: int, paced: Paced) -> None:
        """Finish task `index` in the cursor once its group went to the trainer."""
        try:
            await paced.released.wait()
            self.book.cursor.finish(index)
        finally:
            self.delivering -= 1

    def task_ended(self, link: _Link, msg: w.TaskEnded) -> str | None:
        if msg.index not in link.assigned:
            return f"task {msg.index} is not assigned to this worker"
        link.assigned.discard(msg.index)
        link.free.release()
        if msg.outcome == "abandoned":
            held = self.book.requeue(msg.index, link.worker_id)
            if held is not None:
                link.ended("abandoned")
                self.requeued(held, "the worker gave it up")
        else:
            held = self.book.finish(msg.index, link.worker_id)  # None: its group came first
            if held is not None:
                link.ended("incomplete")  # finished without a group: too many failed attempts
                self._unpace(held, None)
        return None

    async def model_call(self, req: m.GenerateRequest, send: Any) -> None:
        if req.stream:
            async with aclosing(self.pool.stream(req)) as items:
                async for item in items:
                    await send(item)
        else:
            await send(await self.pool.generate(req))

    # -- one connection -----------------------------------------------------------------
    async def join(self, ws: WebSocket) -> None:
        await ws.accept()
        codec = w.WORKERS
        lock = trio.Lock()
        cfg = self.cfg

        async def send(msg: Any) -> None:
            data = codec.encode(msg)
            async with lock:
                await ws.send_bytes(data)

        async def refuse(reason: str) -> None:
            self.log.warning("worker refused", reason=reason, client=str(ws.client))
            try:
                await send(m.Refused(reason=reason))
                await close_after_peer(ws, 2.0, code=CLOSE_POLICY, reason=reason[:100])
            except Exception:
                pass

        hello, problem = await read_hello(ws, codec, w.WorkerJoin, cfg.heartbeat_timeout_s)
        if problem is not None:
            await refuse(problem)
            return
        if not self.may_join(hello.token):
            await refuse("wrong worker token (a worker or admin token is needed: fleetrl token create --role worker)")
            return
        if hello.protocol < 1 or hello.protocol > PROTOCOL_VERSION:
            await refuse(f"protocol {hello.protocol} not supported (this daemon speaks 1..{PROTOCOL_VERSION})")
            return
        if self.closed or self.ctx.draining:
            await refuse("the daemon is shutting down")
            return
        wid = f"worker-{next(self._ids)}"
        key = new_key()
        client = ws.client
        link = _Link(wid, send, hello.groups, name=hello.name,
                     address=f"{client.host}:{client.port}" if client is not None else "")
        why = "connection closed"
        scope = trio.CancelScope()
        self.scopes.add(scope)
        try:
            with scope:
                await send(w.WorkerWelcome(worker_id=wid, run_id=self.run_id, actor=self.actor,
                                           protocol=PROTOCOL_VERSION, heartbeat_s=cfg.heartbeat_s,
                                           settings=self.settings, tokenizer=self.tokenizer, harness_key=key))
                await send(ship_harness(cfg.harness, cfg.harness_config, key, mode=cfg.ship_harness))
                self.links[wid] = link
                self.joined += 1
                self.log.info("worker joined", worker=wid, name=hello.name, groups=hello.groups,
                              client=str(ws.client))
                why = await self._converse(ws, link, hello.token)
        except Exception as exc:  # the connection broke while sending
            why = f"{type(exc).__name__}: {exc}"
        finally:
            self.scopes.discard(scope)
            listed = self.links.pop(wid, None) is not None
            gone = self.book.lost(wid)
            for held in gone:
                self.requeued(held, f"worker {wid} lost: {why}")
            if gone:
                self.lost += 1
                link.ended("abandoned", len(gone))
            if listed:
                self.gone.append((link, why))
            self.log.info("worker left", worker=wid, why=why, requeued=[h.index for h in gone])
            with trio.CancelScope(shield=True):
                try:
                    if why == "token revoked":
                        await send(m.Refused(reason=why))
                        await close_after_peer(ws, 2.0, code=CLOSE_POLICY, reason=why)
                    else:
                        await ws.close()
                except Exception:
                    pass

    async def _converse(self, ws: WebSocket, link: _Link, token: str) -> str:
        """Run one joined worker's conversation; why it ended."""
        codec = w.WORKERS
        cfg = self.cfg
        send = link.send
        why = "connection closed"
        async with trio.open_nursery() as nursery:
            async def beat() -> None:
                nonlocal why
                while True:
                    await trio.sleep(cfg.heartbeat_s)
                    if not self.may_join(token):
                        why = "token revoked"
                        nursery.cancel_scope.cancel()
                        return
                    await send(m.Heartbeat(sampler_id=link.worker_id, sent_at=trio.current_time()))

            nursery.start_soon(beat)
            ready = False
            while True:
                data = await receive_frame(ws, cfg.heartbeat_timeout_s)
                if data is None:
                    why = f"silent for {cfg.heartbeat_timeout_s} s (or disconnected)"
                    break
                link.last_seen = time.monotonic()
                try:
                    msg = codec.decode(data)
                except BadMessage as exc:
                    self.log.warning("message rejected", worker=link.worker_id, kind=exc.kind, detail=exc.detail)
                    await send(Rejected(kind=exc.kind, detail=str(exc.detail)[:1024]))
                    continue
                problem = None
                if isinstance(msg, m.GenerateRequest):
                    nursery.start_soon(self.model_call, msg, send)
                elif isinstance(msg, m.RolloutGroup):
                    problem = await self.group_in(link, msg)
                elif isinstance(msg, m.RolloutFailed):
                    if self.book.of_group(msg.group_id, link.worker_id) is None:
                        problem = (f"failure of attempt {msg.attempt_id!r}: group {msg.group_id!r} is not "
                                   "held by this worker")
                    else:
                        link.failures[msg.reason] = link.failures.get(msg.reason, 0) + 1
                        await self.failures_out.send(msg)
                elif isinstance(msg, w.TaskEnded):
                    problem = self.task_ended(link, msg)
                elif isinstance(msg, m.Leave):
                    why = f"left: {msg.reason}"
                    break
                elif isinstance(msg, w.WorkerLoad):
                    link.load = msg
                elif isinstance(msg, m.Heartbeat):
                    if not ready:  # the first one: its harness and sandboxes are ready
                        ready = link.ready = True
                        nursery.start_soon(self.assign, link)
                elif isinstance(msg, Rejected):
                    self.log.warning("worker rejected a message", worker=link.worker_id, kind=msg.kind,
                                     detail=msg.detail)
                else:
                    problem = f"{type(msg).__name__} is not sent by workers"
                if problem is not None:
                    self.log.warning("message rejected", worker=link.worker_id, detail=problem)
                    await send(Rejected(kind="unexpected", detail=problem))
            nursery.cancel_scope.cancel()
        return why

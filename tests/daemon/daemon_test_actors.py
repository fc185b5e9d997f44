"""Small actors the daemon tests run by import path (``daemon_test_actors:NAME``).

The tests put this folder on ``sys.path`` (in-process) or ``PYTHONPATH``
(subprocesses). ``PROGRESS`` is an in-memory record the in-process tests read: it
is a fake of the outside world, keyed by each config's ``tag``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import msgspec
import trio

from fleetrl.daemon.actor import ActorContext

PROGRESS: dict[str, dict[str, Any]] = defaultdict(lambda: defaultdict(list))


class CrasherConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tag: str
    #: incarnations 1..crash_until raise; later ones run until drained
    crash_until: int = 1_000_000
    #: raise before calling task_status.started()
    before_started: bool = False


async def crasher(cfg: CrasherConfig, ctx: ActorContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    PROGRESS[cfg.tag]["starts"].append(trio.current_time())
    crash = ctx.incarnation <= cfg.crash_until
    if crash and cfg.before_started:
        raise RuntimeError(f"boom before start #{ctx.incarnation}")
    task_status.started()
    if crash:
        await trio.sleep(0)
        raise RuntimeError(f"boom #{ctx.incarnation}")
    await ctx.wait_draining()


class ProducerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tag: str
    target: str
    count: int = 1_000_000


async def producer(cfg: ProducerConfig, ctx: ActorContext, *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    out = ctx.sender(cfg.target)
    rec = PROGRESS[cfg.tag]
    task_status.started()
    async with out:
        for i in range(cfg.count):
            if ctx.draining:
                break
            await ctx.wait_unpaused()
            await out.send(i)
            rec["sent"].append(i)


class ConsumerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tag: str
    delay_s: float = 0.0


async def consumer(cfg: ConsumerConfig, ctx: ActorContext, *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    rec = PROGRESS[cfg.tag]
    task_status.started()
    async for item in ctx.inbox:
        await trio.sleep(cfg.delay_s)
        rec["got"].append(item)
    rec["ended"].append(True)


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A checkpointed worker for the subprocess tests."""

    unit_s: float = 0.2
    #: a file the checkpoint hook appends one JSON line to on every call
    hook_log: str = ""
    #: ignore the drain signal (to test the grace deadline and forced exit)
    stubborn: bool = False
    #: the first incarnation raises once it has done this many units (0: never)
    crash_at: int = 0


class WorkerState(msgspec.Struct, frozen=True):
    done: int = 0


async def worker(cfg: WorkerConfig, ctx: ActorContext, *,
                 task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    restored = ctx.restored_as(WorkerState) or WorkerState()
    done = restored.done
    ctx.log.info("worker started", restored_done=done)

    async def hook() -> WorkerState:
        if cfg.hook_log:
            with Path(cfg.hook_log).open("a") as fh:
                fh.write(json.dumps({"done": done, "draining": ctx.draining}) + "\n")
        return WorkerState(done)

    ctx.on_checkpoint(hook)
    task_status.started()
    while cfg.stubborn or not ctx.draining:
        ctx.log.info("unit begun", unit=done + 1)
        await trio.sleep(cfg.unit_s)  # the work in flight; drain lets it finish
        done += 1
        ctx.report_version("done", done)
        if ctx.incarnation == 1 and done == cfg.crash_at:
            raise RuntimeError(f"crash at unit {done}")
        ctx.log.info("unit done", done=done)
    ctx.log.info("worker drained", done=done)


class MounterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prefix: str = "/echo"
    auth: bool = True
    roles: tuple[str, ...] = ()


async def mounter(cfg: MounterConfig, ctx: ActorContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Mounts a plain ASGI app that echoes its root_path and path."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = json.dumps({"root_path": scope["root_path"], "path": scope["path"],
                           "actor": ctx.name}).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    ctx.mount(cfg.prefix, app, auth=cfg.auth, roles=cfg.roles)
    task_status.started()
    await ctx.wait_draining()


def register(subparsers: Any) -> None:
    """A `fleetrl.commands` group used by the CLI discovery test."""
    p = subparsers.add_parser("hello", help="test group")
    p.set_defaults(func=lambda args: 0)

"""Actors for the kernel-handle tests (``handle_test_actors:NAME``).

`server` starts with a handle that counts calls and has a ``statistics()`` record; it
drains by reading its inbox to the end (which, by the kernel's contract, happens only
once every actor holding its handle has returned). `client` takes the server's handle,
calls it, and keeps calling for ``linger_s`` after shutdown began. ``EVENTS`` records
what happened, in order, for the tests to read.
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from fleetrl.daemon.actor import ActorContext

EVENTS: list[tuple[str, Any]] = []


class ServerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    calls: int
    incarnation: int
    serving: bool


class ServerHandle:
    def __init__(self, incarnation: int, calls: int = 0) -> None:
        self.incarnation = incarnation
        self.calls = calls
        self.serving = True

    async def call(self) -> int:
        if not self.serving:
            raise RuntimeError("called after the server stopped serving")
        self.calls += 1
        await trio.lowlevel.checkpoint()
        return self.incarnation

    def statistics(self) -> ServerStatistics:
        return ServerStatistics(calls=self.calls, incarnation=self.incarnation, serving=self.serving)


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    #: incarnations 1..crash_until crash after `crash_after_s`
    crash_until: int = 0
    crash_after_s: float = 1.0


async def server(cfg: ServerConfig, ctx: ActorContext, *,
                 task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    previous = ctx.previous_handle
    EVENTS.append(("server started", (ctx.incarnation, None if previous is None else previous.calls)))
    handle = ServerHandle(ctx.incarnation, calls=0 if previous is None else previous.calls)
    task_status.started(handle)
    if ctx.incarnation <= cfg.crash_until:
        await trio.sleep(cfg.crash_after_s)
        handle.serving = False
        raise RuntimeError(f"server crash #{ctx.incarnation}")
    async for msg in ctx.inbox:
        EVENTS.append(("server got", msg))
    handle.serving = False
    EVENTS.append(("server inbox ended", handle.calls))


class ClientConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    target: str = "server"
    linger_s: float = 3.0
    #: ask for the handle before task_status.started() (deadlocks on a later actor)
    early: bool = False


async def client(cfg: ClientConfig, ctx: ActorContext, *,
                 task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    if cfg.early:
        await ctx.handle(cfg.target)
    task_status.started(None)
    while not ctx.draining:
        handle = await ctx.handle(cfg.target)
        try:
            got = await handle.call()
        except RuntimeError:
            await trio.sleep(0.1)  # the server crashed under us: ask for the new one
            continue
        EVENTS.append(("client called", got))
        await trio.sleep(0.5)
    with trio.move_on_after(cfg.linger_s):
        while True:  # still using the server while draining (an attempt finishing)
            await handle.call()
            await trio.sleep(0.5)
    EVENTS.append(("client returned", handle.calls))

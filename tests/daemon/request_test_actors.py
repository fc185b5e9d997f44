"""Actors for test_actor_requests.py: they ask the kernel to shut down or checkpoint."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec
import trio

from fleetrl.daemon.actor import ActorContext

#: what the actors did, per tag (cleared by the fixture)
LOG: dict[str, list[Any]] = {}


class QuitterConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tag: str
    steps: int = 3
    checkpoint_at: int = -1
    reason: str = "work done"
    halt: bool = False


async def quitter(cfg: QuitterConfig, ctx: ActorContext, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Counts `steps` ticks (asking for a checkpoint at `checkpoint_at`), then asks the
    daemon to shut down and waits for the drain like any actor."""
    log = LOG.setdefault(cfg.tag, [])
    count = 0

    async def hook() -> int:
        log.append(("hook", count))
        return count

    ctx.on_checkpoint(hook)
    task_status.started()
    while count < cfg.steps:
        await trio.sleep(1.0)
        count += 1
        if count == cfg.checkpoint_at:
            await ctx.request_checkpoint(f"tick {count}")
            log.append(("checkpointed", count))
    try:
        (ctx.halt if cfg.halt else ctx.request_shutdown)(cfg.reason)
    except ValueError as exc:
        log.append(("refused", str(exc)))
        raise
    log.append(("requested", count))
    await ctx.wait_draining()
    log.append(("drained", count))


class IdleConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tag: str


async def idle(cfg: IdleConfig, ctx: ActorContext, *,
               task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Registers a hook that records when it ran; idles until drained."""
    async def hook() -> str:
        LOG.setdefault("hooks", []).append(cfg.tag)
        return cfg.tag

    ctx.on_checkpoint(hook)
    task_status.started()
    await ctx.wait_draining()


@runtime_checkable
class Generator(Protocol):
    """What the asker needs of the actor it names."""

    async def generate(self, request: Any) -> Any: ...


class _Server:
    async def generate(self, request: Any) -> Any:
        return f"answer to {request}"


class ServerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


async def server(cfg: ServerConfig, ctx: ActorContext, *,
                 task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
    """Starts with a handle that is a `Generator`; serves until drained."""
    task_status.started(_Server())
    async for _ in ctx.inbox:
        pass


class AskerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    target: str


async def asker(cfg: AskerConfig, ctx: ActorContext, *,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Asks for ``target``'s handle as a `Generator` and records what came of it."""
    log = LOG.setdefault("asker", [])
    task_status.started()
    try:
        handle = await ctx.handle(cfg.target, Generator)
    except Exception as exc:
        log.append(("refused", type(exc).__name__, str(exc)))
        ctx.request_shutdown("asked")
        return
    log.append(("answer", await handle.generate("q")))
    ctx.request_shutdown("asked")

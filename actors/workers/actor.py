"""The remote workers actor (``fleetrl.actors.workers:run``).

``run(cfg: RemoteWorkersConfig, ctx, *, task_status)`` opens the task source and the
checkpointed task cursor (as the environment worker actor does), takes the sampler
pool's handle and the tokenizer files, and mounts the join endpoint for remote
environment workers (`hub.Hub`) at ``<join_prefix>/join``, open to ``worker`` tokens
(`fleetrl token create --role worker`) and the daemon's own. The hub is its handle. It
reads no messages: groups and failures from workers go to ``target`` (and
``failures_to``).

Drain: no task is handed out any more; groups still running on workers may arrive for
``drain_grace_s``; then the conversations end and what is unfinished stays due in the
checkpointed cursor (the next start runs it).
"""

from __future__ import annotations

import functools
from typing import Any, Never

import trio

from fleetrl.actors.envworker.cursor import CursorState, TaskCursor
from fleetrl.actors.envworker.pacing import GroupPacing
from fleetrl.actors.envworker.sources import open_task_source
from fleetrl.actors.pool.handle import PoolHandle
from fleetrl.daemon.actor import ActorContext

from .book import TaskBook
from .config import RemoteWorkersConfig
from .hub import Hub
from .shipping import new_key, ship_harness
from .tokenizer_files import read_tokenizer_files

__all__ = ["Inbox", "run"]

Inbox = Never
"""The remote workers actor takes no messages; it produces groups and failures."""

WORKER_ROLES = ("worker", "admin")


def _sender(ctx: ActorContext, name: str, key: str) -> trio.MemorySendChannel[Any]:
    try:
        return ctx.sender(name)
    except KeyError:
        raise ValueError(f"{key} = {name!r} is not an actor of this daemon") from None


def _may_join(ctx: ActorContext) -> Any:
    """Whether a token may join as a worker: an issued ``worker`` token or the daemon's own."""
    store = ctx.credentials
    if store is None:
        raise ValueError("remote workers need the daemon's token store (daemon/credentials.py)")

    def may_join(token: str) -> bool:
        cred = store.identify(token)
        return cred is not None and cred.role in WORKER_ROLES
    return may_join


async def run(cfg: RemoteWorkersConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[Hub] = trio.TASK_STATUS_IGNORED) -> None:
    """The remote workers actor (see the module docstring)."""
    source = await trio.to_thread.run_sync(functools.partial(open_task_source, cfg.tasks, ctx.log,
                                                             daemon_dir=ctx.daemon_dir, state_dir=ctx.state_dir))
    # the harness loads (and, when pickled, pickles) here, so a bad one fails the start, not every join
    await trio.to_thread.run_sync(functools.partial(ship_harness, cfg.harness, cfg.harness_config, new_key(),
                                                    mode=cfg.ship_harness))
    cursor = TaskCursor(ctx.restored_as(CursorState))

    async def checkpoint() -> CursorState:
        return cursor.state()
    ctx.on_checkpoint(checkpoint)
    model = cfg.model
    tokenizer = await trio.to_thread.run_sync(functools.partial(
        read_tokenizer_files, model.tokenizer_dir, max_bytes=int(cfg.max_tokenizer_mb * 2**20)))
    try:
        pool = await ctx.handle(model.pool, PoolHandle)
    except KeyError:
        raise ValueError(f"model.pool = {model.pool!r} is not an actor of this daemon") from None
    out = _sender(ctx, cfg.target, "target")
    failures_out = out if cfg.failures_to in (None, cfg.target) else _sender(ctx, cfg.failures_to, "failures_to")
    pacing = None
    if model.pacing:
        pacing = GroupPacing(pool, group_size=cfg.group_size, skips_zero_variance=model.trainer_skips_zero_variance,
                             scopes=set())
        if pool.pacer.attempts_per_step % cfg.group_size:
            raise ValueError(f"the sampler pool's attempts_per_step={pool.pacer.attempts_per_step} is not a multiple "
                             f"of group_size={cfg.group_size}: pacing needs attempts_per_step = the trainer's "
                             "groups_per_step x group_size")
    hub = Hub(cfg, actor=ctx.name, run_id=ctx.run_id, book=TaskBook(cursor), source=source, pool=pool,
              tokenizer=tokenizer, out=out, failures_out=failures_out, pacing=pacing, ctx=ctx,
              may_join=_may_join(ctx))
    ctx.mount(cfg.join_prefix, hub.app(), auth=False)
    ctx.log.info("remote workers ready", join=f"{cfg.join_prefix}/join", tasks=source.describe,
                 floor=cursor.floor, group_size=cfg.group_size, pacing=pacing is not None)
    try:
        async with trio.open_nursery() as nursery:
            hub.nursery = nursery
            if pacing is not None:
                nursery.start_soon(pacing.release_in_order, out)
            task_status.started(hub)
            await ctx.wait_draining()
            with trio.move_on_after(cfg.drain_grace_s):  # groups on workers, and those on their way
                while hub.book.held or hub.delivering:
                    await trio.sleep(0.1)
            if hub.book.held:
                ctx.log.warning("groups still on workers at the end of the drain grace; their tasks stay due",
                                tasks=sorted(hub.book.held))
            nursery.cancel_scope.cancel()
    finally:
        hub.close()

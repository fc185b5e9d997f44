"""The heartbeat actor: the kernel's own small, real, checkpointed workload.

Until the application actors are wired into the default config, `fleetrl serve`
runs this: it counts ticks at a fixed interval, exposes the count as the
``fleetrl_ticker_ticks`` gauge, reports it in /status, honours pause and drain, and
persists the count through its checkpoint hook, so a restarted daemon continues
counting where the last checkpoint left off.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import trio

from .actor import ActorContext

__all__ = ["TickerConfig", "TickerState", "run"]


class TickerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: seconds between ticks
    interval_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 1.0
    #: log one line every this many ticks (0: never)
    log_every: Annotated[int, msgspec.Meta(ge=0)] = 60


class TickerState(msgspec.Struct, frozen=True):
    ticks: int = 0


async def run(cfg: TickerConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    ticks = (ctx.restored_as(TickerState) or TickerState()).ticks
    gauge = ctx.metrics.gauge("ticker_ticks", "Ticks counted by the heartbeat actor")
    gauge.set(ticks)

    async def snapshot() -> TickerState:
        return TickerState(ticks)

    ctx.on_checkpoint(snapshot)
    ctx.report_version("ticks", ticks)
    ctx.log.info("ticker started", ticks=ticks, interval_s=cfg.interval_s)
    task_status.started()
    while not ctx.draining:
        await ctx.wait_unpaused()
        with trio.move_on_after(cfg.interval_s):
            await ctx.wait_draining()
        if ctx.draining:
            break
        if ctx.paused:
            continue
        ticks += 1
        gauge.set(ticks)
        ctx.report_version("ticks", ticks)
        if cfg.log_every and ticks % cfg.log_every == 0:
            ctx.log.info("tick", ticks=ticks)
    ctx.log.info("ticker stopped", ticks=ticks)

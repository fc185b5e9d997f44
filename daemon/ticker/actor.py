"""The heartbeat actor: the kernel's own small, real, checkpointed workload.

`fleetrl serve` with no config runs this: it counts ticks at a fixed interval, exposes
the count as the ``fleetrl_ticker_ticks`` gauge and in its statistics, reports it in
/status, honours pause and drain, and persists the count through its checkpoint hook,
so a restarted daemon continues counting where the last checkpoint left off. It reads
no messages.
"""

from __future__ import annotations

from typing import Never

import msgspec
import trio

from ..actor import ActorContext
from .config import TickerConfig

__all__ = ["Inbox", "TickerHandle", "TickerState", "TickerStatistics", "run"]

Inbox = Never
"""The heartbeat takes no messages."""


class TickerState(msgspec.Struct, frozen=True):
    ticks: int = 0


class TickerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    ticks: int


class TickerHandle:
    """The heartbeat's handle: its tick count."""

    def __init__(self, ticks: int) -> None:
        self.ticks = ticks

    def statistics(self) -> TickerStatistics:
        return TickerStatistics(ticks=self.ticks)


async def run(cfg: TickerConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[TickerHandle] = trio.TASK_STATUS_IGNORED) -> None:
    handle = TickerHandle((ctx.restored_as(TickerState) or TickerState()).ticks)
    gauge = ctx.metrics.gauge("ticker_ticks", "Ticks counted by the heartbeat actor")
    gauge.set(handle.ticks)

    async def snapshot() -> TickerState:
        return TickerState(handle.ticks)

    ctx.on_checkpoint(snapshot)
    ctx.report_version("ticks", handle.ticks)
    ctx.log.info("ticker started", ticks=handle.ticks, interval_s=cfg.interval_s)
    task_status.started(handle)
    while not ctx.draining:
        await ctx.wait_unpaused()
        with trio.move_on_after(cfg.interval_s):
            await ctx.wait_draining()
        if ctx.draining:
            break
        if ctx.paused:
            continue
        handle.ticks += 1
        gauge.set(handle.ticks)
        ctx.report_version("ticks", handle.ticks)
        if cfg.log_every and handle.ticks % cfg.log_every == 0:
            ctx.log.info("tick", ticks=handle.ticks)
    ctx.log.info("ticker stopped", ticks=handle.ticks)

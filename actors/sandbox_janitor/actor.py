"""The sandbox janitor actor: removes sandboxes that no live daemon owns.

At start (before the actors that lease sandboxes, which name it in ``after``) it
removes every container labelled with this daemon's state directory whose owner is
not this daemon instance: those were leaked by a daemon that was killed (SIGKILL, OOM,
power loss) before it could remove them. The daemon holds the state directory's lock,
so no other live daemon can own them (docs/reference/contracts.md). Containers without our
labels are never touched. With ``interval_s`` > 0 it sweeps again periodically. It
reads no messages.

A Docker engine that cannot be reached is an error: the actor crashes, and the
supervisor's restart policy retries and finally escalates with the error in the log.
"""

from __future__ import annotations

from typing import Never

import msgspec
import trio

from fleetrl.daemon.actor import ActorContext
from fleetrl.sandboxes import sweep

from .config import JanitorConfig

__all__ = ["Inbox", "JanitorHandle", "JanitorStatistics", "run"]

Inbox = Never
"""The janitor takes no messages."""


class JanitorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    sweeps: int
    removed: int
    """Containers removed over all sweeps."""
    errors: int
    """Containers the engine failed to remove."""


class JanitorHandle:
    def __init__(self) -> None:
        self.sweeps = 0
        self.removed = 0
        self.errors = 0

    def statistics(self) -> JanitorStatistics:
        return JanitorStatistics(sweeps=self.sweeps, removed=self.removed, errors=self.errors)


async def run(cfg: JanitorConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[JanitorHandle] = trio.TASK_STATUS_IGNORED) -> None:
    removed_metric = ctx.metrics.counter(
        "sandbox_orphans_removed", "Sandbox containers removed because no live daemon owned them")
    handle = JanitorHandle()

    async def sweep_once(when: str) -> None:
        report = await sweep(ctx.daemon_dir, current_instance_id=ctx.instance_id)
        removed_metric.inc(len(report.removed))
        handle.sweeps += 1
        handle.removed += len(report.removed)
        handle.errors += len(report.errors)
        ctx.report_version("sandbox_orphans_removed", handle.removed)
        ctx.log.info("sandbox sweep", when=when, removed=len(report.removed),
                     containers=list(report.removed), errors=list(report.errors))

    await sweep_once("start")
    task_status.started(handle)
    while not ctx.draining:
        with trio.move_on_after(cfg.interval_s if cfg.interval_s > 0 else float("inf")):
            await ctx.wait_draining()
        if not ctx.draining:
            await sweep_once("periodic")

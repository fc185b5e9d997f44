"""The sandbox janitor actor: removes sandboxes that no live daemon owns.

At start (before the actors that lease sandboxes, which name it in ``after``) it
removes every container labelled with this daemon's state directory whose owner is
not this daemon instance: those were leaked by a daemon that was killed (SIGKILL, OOM,
power loss) before it could remove them. The daemon holds the state directory's lock,
so no other live daemon can own them (docs/contracts.md). Containers without our
labels are never touched. With ``interval_s`` > 0 it sweeps again periodically.

A Docker engine that cannot be reached is an error: the actor crashes, and the
supervisor's restart policy retries and finally escalates with the error in the log.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import trio

from fleetrl.daemon.actor import ActorContext
from fleetrl.sandboxes import sweep

__all__ = ["JanitorConfig", "run"]


class JanitorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: seconds between sweeps after the first one (0: sweep only at start)
    interval_s: Annotated[float, msgspec.Meta(ge=0, le=86400)] = 0.0


async def run(cfg: JanitorConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    removed_metric = ctx.metrics.counter(
        "sandbox_orphans_removed", "Sandbox containers removed because no live daemon owned them")
    removed_total = 0

    async def sweep_once(when: str) -> None:
        nonlocal removed_total
        report = await sweep(ctx.daemon_dir, current_instance_id=ctx.instance_id)
        removed_metric.inc(len(report.removed))
        removed_total += len(report.removed)
        ctx.report_version("sandbox_orphans_removed", removed_total)
        ctx.log.info("sandbox sweep", when=when, removed=len(report.removed),
                     containers=list(report.removed), errors=list(report.errors))

    await sweep_once("start")
    task_status.started()
    while not ctx.draining:
        with trio.move_on_after(cfg.interval_s if cfg.interval_s > 0 else float("inf")):
            await ctx.wait_draining()
        if not ctx.draining:
            await sweep_once("periodic")

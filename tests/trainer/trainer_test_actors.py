"""Actors the trainer's supervisor tests run by import path (``trainer_test_actors:NAME``).

``FEED`` is a fake of the outside world (the environment workers): the test fills it
with RolloutGroups and the feeder actor sends them to the trainer, then returns (which
ends the trainer's inbox once every producer has returned).
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from fleetrl.daemon.actor import ActorContext

FEED: list[Any] = []
GOT: list[Any] = []


class FeederConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    target: str = "trainer"
    hold: bool = False
    """Keep the channel open after the feed (a producer with nothing more to send yet)."""
    interval_s: float = 0.0
    """Seconds between two items (time passing in a test on the autojump clock)."""


async def feeder(cfg: FeederConfig, ctx: ActorContext, *,
                 task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    out = ctx.sender(cfg.target)
    task_status.started()
    async with out:
        for item in FEED:
            await trio.sleep(cfg.interval_s)
            await out.send(item)
        if cfg.hold:
            await trio.sleep_forever()


class SinkConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


async def sink(cfg: SinkConfig, ctx: ActorContext, *,
               task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Stands in for the sampler pool: records the stale-group reports it receives."""
    task_status.started()
    async for item in ctx.inbox:
        GOT.append(item)


class FileFeederConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sends the RolloutGroups msgpack-encoded in ``path``, from the first, every
    incarnation (a producer with no cursor of its own, as after a crash)."""

    path: str
    interval_s: float = 0.2
    target: str = "trainer"


async def file_feeder(cfg: FileFeederConfig, ctx: ActorContext, *,
                      task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    from pathlib import Path

    from fleetrl.daemon.messages import RolloutGroup

    items = msgspec.msgpack.decode(Path(cfg.path).read_bytes(), type=list[RolloutGroup])
    out = ctx.sender(cfg.target)
    task_status.started()
    async with out:
        for item in items:
            if ctx.draining:
                break
            await out.send(item)
            await trio.sleep(cfg.interval_s)
        await ctx.wait_draining()

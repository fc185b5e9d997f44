"""Actors the endpoint tests name by import path (``endpoint_test_actors:NAME``).

``RECEIVED`` is the sink's in-memory record, keyed by its config's ``tag``: a fake of
whatever consumes rollouts (the trainer)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec
import trio

RECEIVED: dict[str, list[Any]] = defaultdict(list)


class SinkConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tag: str


async def sink(cfg: SinkConfig, ctx: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async for msg in ctx.inbox:
        RECEIVED[cfg.tag].append(msg)

"""A fake trainer the remote workers tests name by import path
(``tests.workers.workers_test_actors:trainer`` via ``actors_module``): it publishes the
tiny model's weights (version 0, then a new version every ``groups_per_step`` groups with
reward variance) and records every group and failure it receives in ``RECEIVED[tag]``."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec
import trio

RECEIVED: dict[str, list[Any]] = defaultdict(list)


class TrainerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tag: str
    model_dir: str
    weights_dir: str
    pool: str = "pool"
    groups_per_step: int = 2


async def trainer(cfg: TrainerConfig, ctx: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    import torch

    from fleetrl.actors.model.tiny_llama import read_state_dict
    from fleetrl.actors.weights import LocalDirStore, Publisher, PublisherConfig
    from fleetrl.daemon.messages import RolloutFailed, RolloutGroup, WeightVersionAvailable

    weights = {k: v.to(torch.bfloat16) for k, v in read_state_dict(cfg.model_dir).items()}
    pub = Publisher(LocalDirStore(cfg.weights_dir), PublisherConfig(run=ctx.run_id))
    pool = ctx.sender(cfg.pool)

    async def publish() -> None:
        await trio.to_thread.run_sync(pub.publish, weights)
        await pool.send(WeightVersionAvailable(version=pub.version, digest=pub.digest.hex(), base=None, blobs=()))

    await publish()
    task_status.started()
    batch = 0
    async for msg in ctx.inbox:
        if isinstance(msg, RolloutFailed):
            RECEIVED[cfg.tag + "/failed"].append(msg)
            continue
        if not isinstance(msg, RolloutGroup):
            continue
        RECEIVED[cfg.tag].append((pub.version, msg))
        if len(set(msg.rewards)) == 1:
            continue
        batch += 1
        if batch == cfg.groups_per_step:
            batch = 0
            first = next(iter(weights))
            weights[first] = (weights[first].float() + 0.05).to(torch.bfloat16)
            await publish()

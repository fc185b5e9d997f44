"""Actors and harnesses the envworker tests name by import path (``envworker_test_actors:NAME``).

``RECEIVED`` is the sink's in-memory record (keyed by its config's ``tag``): a fake of
whatever consumes rollouts (the trainer).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import msgspec
import trio

from fleetrl.harness.builtin import CompletionHarness
from fleetrl.harness.protocol import Episode
from fleetrl.harness.synthetic import reference_solution, solution_text

RECEIVED: dict[str, list[Any]] = defaultdict(list)


class SinkConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tag: str


async def sink(cfg: SinkConfig, ctx: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async for msg in ctx.inbox:
        RECEIVED[cfg.tag].append(msg)


class OracleHarness(msgspec.Struct, frozen=True, kw_only=True):
    """Asks the model once (the completion harness), then, when the first generated
    token id is even, overwrites the solution with the reference one: the expected
    reward of each attempt is known from its own trajectory."""

    max_tokens: int = 16

    async def run(self, task, sandbox, model) -> Episode:
        episode = await CompletionHarness(max_tokens=self.max_tokens).run(task, sandbox, model)
        first = episode.record.calls[0].token_ids[0]
        if first % 2 == 0:
            name = str(task.metadata.get("solution_file") or "solution.py")
            await sandbox.write_files({f"{task.workdir}/{name}":
                                       solution_text(task, reference_solution(task))})
        return episode


class CrashingHarness:
    async def run(self, task, sandbox, model) -> Episode:
        await sandbox.exec("true", timeout=10)
        raise RuntimeError("harness exploded")


class HangingHarness:
    async def run(self, task, sandbox, model) -> Episode:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


class SlowTrainerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A deliberately slow fake of the trainer: it takes groups in arrival order, skips
    zero-variance ones (as the real trainer's ``skip_zero_variance``), trains every
    ``groups_per_step`` others for ``train_s`` seconds, then publishes the next weight
    version into ``weights_dir`` and announces it to ``pool``."""

    tag: str
    model_dir: str
    weights_dir: str
    pool: str = "pool"
    groups_per_step: int = 1
    train_s: float = 1.0


async def slow_trainer(cfg: SlowTrainerConfig, ctx: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Records ``(trainer version when the group is taken, group)`` in ``RECEIVED[tag]``
    and every `RolloutFailed` in ``RECEIVED[tag + "/failed"]``."""
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

    await publish()  # version 0
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
            continue  # zero variance: not trained, not counted in a step
        batch += 1
        if batch == cfg.groups_per_step:
            batch = 0
            await trio.sleep(cfg.train_s)  # deliberately slow
            first = next(iter(weights))
            weights[first] = (weights[first].float() + 0.05).to(torch.bfloat16)  # a real change
            await publish()

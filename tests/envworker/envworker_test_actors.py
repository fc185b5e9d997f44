"""Actors and harnesses the envworker tests name by import path (``envworker_test_actors:NAME``).

``RECEIVED`` is the sink's in-memory record (keyed by its config's ``tag``): a fake of
whatever consumes rollouts (the buffer or the trainer).
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

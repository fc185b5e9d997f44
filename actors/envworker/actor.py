"""The environment worker actor (``fleetrl.actors.envworker:run``).

``run(cfg: EnvWorkerConfig, ctx, *, task_status)`` loads the harness (by import path,
`harnesses.load_harness`, or ``harness = "external"``), opens the task source and the
model client (`model.open_model`: a torch backend of its own, or the sampler pool's
handle), restores the task cursor, opens a sandbox pool (containers labelled with
``Ownership.for_state_dir(daemon_dir, owner=instance_id, run=run_id)``; every container
is removed when the pool closes), and runs the task loop (`worker._Worker`), which is
also its handle. It reads no messages: it produces `RolloutGroup`s and `RolloutFailed`s
for ``target`` (and ``failures_to``).

``harness = "external"``: the harness is an `ExternalHarness` running the configured
command (``harness_config`` = an `ExternalCommand`) against the endpoint actor named by
``endpoint`` (same daemon; its handle): each attempt opens a key in the endpoint's
`AttemptRegistry`, and the `AttemptRecord` of the command's calls, closed when it ends,
is the attempt's trajectory. The worker then loads no model of its own; when the
endpoint answers through the sampler pool with ``pacing = true``, the worker paces its
groups through that pool's pacer, as with the built-in harness.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Never

import trio

from fleetrl.daemon.actor import ActorContext
from fleetrl.harness.external import ExternalHarness
from fleetrl.harness.protocol import Harness
from fleetrl.sandboxes import Ownership, WarmPolicy, open_sandbox_pool

from .config import EXTERNAL, EnvWorkerConfig, PoolModel
from .cursor import CursorState, TaskCursor
from .harnesses import load_harness
from .model import open_model
from .sources import open_task_source
from .worker import _Worker

__all__ = ["Inbox", "run"]

Inbox = Never
"""An environment worker takes no messages; it produces groups and failures."""


def _sender(ctx: ActorContext, name: str, key: str) -> trio.MemorySendChannel[Any]:
    try:
        return ctx.sender(name)
    except KeyError:
        raise ValueError(f"{key} = {name!r} is not an actor of this daemon") from None


async def _external_harness(cfg: EnvWorkerConfig, ctx: ActorContext) -> tuple[Harness, Any]:
    """``harness = "external"``: the command against the endpoint actor ``cfg.endpoint``,
    which runs in this daemon (waits until it has started), and the endpoint's handle."""
    assert cfg.endpoint is not None  # the config checks it
    try:
        handle = await ctx.handle(cfg.endpoint)
    except KeyError:
        raise ValueError(f"endpoint = {cfg.endpoint!r} is not an actor of this daemon") from None
    command = cfg.external_command().relative_to(os.getcwd())
    ctx.log.info("external harness", argv=list(command.argv), endpoint=handle.base_url)
    harness = ExternalHarness(command, registry=handle.registry, base_url=handle.base_url,
                              model_name=handle.model_name)
    return harness, handle


def pacing_of(model: Any, setting: Any) -> tuple[Any, PoolModel] | None:
    """The sampler pool (its handle) and setting to pace groups through: the worker's own
    model's, or with an external harness the endpoint's; None unless it is the pool with
    ``pacing = true``."""
    if isinstance(setting, PoolModel) and setting.pacing and model is not None:
        return model.pool, setting
    return None


async def run(cfg: EnvWorkerConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[_Worker] = trio.TASK_STATUS_IGNORED) -> None:
    """The environment worker actor (see the module docstring)."""
    external = cfg.harness == EXTERNAL
    harness = None if external else load_harness(cfg.harness, cfg.harness_config)
    source = await trio.to_thread.run_sync(functools.partial(open_task_source, cfg.tasks, ctx.log,
                                                             daemon_dir=ctx.daemon_dir, state_dir=ctx.state_dir))
    cursor = TaskCursor(ctx.restored_as(CursorState))

    async def checkpoint() -> CursorState:
        return cursor.state()
    ctx.on_checkpoint(checkpoint)
    if external:
        harness, endpoint = await _external_harness(cfg, ctx)
        model, paced_by = None, pacing_of(endpoint.model, endpoint.model_config)
    else:
        assert cfg.model is not None  # the config checks it
        model = await open_model(cfg.model, ctx)
        paced_by = pacing_of(model, cfg.model)
    out = _sender(ctx, cfg.target, "target")
    failures_out = out if cfg.failures_to in (None, cfg.target) else _sender(ctx, cfg.failures_to, "failures_to")
    ownership = Ownership.for_state_dir(ctx.daemon_dir, owner=ctx.instance_id, run=ctx.run_id)
    s = cfg.sandbox
    policy = WarmPolicy(min_warm=s.min_warm, max_warm=s.max_warm, max_containers=s.max_containers)
    try:
        async with open_sandbox_pool(ownership, policy=policy) as pool:
            worker = _Worker(cfg, ctx, harness=harness, model=model, pool=pool, out=out,
                             failures_out=failures_out, cursor=cursor, paced_by=paced_by)
            ctx.log.info("environment worker ready", tasks=source.describe, floor=cursor.floor,
                         group_size=cfg.group_size, max_concurrent_attempts=cfg.max_concurrent_attempts)
            task_status.started(worker)
            await worker.run(source)
    finally:
        if isinstance(harness, ExternalHarness):
            await harness.aclose()  # its fork server, if it has one

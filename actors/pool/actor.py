"""The sampler pool actor (``fleetrl.actors.pool:run``).

Builds a `SamplerPool` from `PoolConfig`, keeps its local samplers alive (restarted
after ``restart_backoff_s``; each follows the trainer's delta store when
``weights_dir`` is set), mounts the join endpoint for remote samplers
(`remote_server.fleet_app`, authenticated by the fleet token), exports the per-sampler
metrics, and starts with the pool itself as its handle: other actors call
``(await ctx.handle("pool")).generate(request)`` and pace through it. Its inbox takes
`GenerateRequest`s (answered to ``reply_to``), the trainer's `WeightVersionAvailable`
announcements, samplers' `SamplerStatus` and the trainer's stale-group reports.

Drain: holding the pool's handle makes an actor a producer of its inbox, so the inbox
ends once every actor that generates through the pool has returned; then the requests
taken from the inbox are finished and the samplers are stopped.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from fleetrl.actors.buffer import StaleGroup
from fleetrl.actors.weights.follower import StoreSource
from fleetrl.actors.weights.store import LocalDirStore
from fleetrl.daemon import messages as m
from fleetrl.daemon.actor import ActorContext

from .auth import read_fleet_token
from .config import LocalSamplerConfig, PoolConfig
from .core import SamplerPool
from .local import AsyncStoreSource, LocalSampler, WeightSync
from .metrics import PoolMetrics
from .remote_server import fleet_app

__all__ = ["Inbox", "run"]

Inbox = m.GenerateRequest | m.WeightVersionAvailable | m.SamplerStatus | StaleGroup
"""Requests to answer, the trainer's versions, samplers' reports, stale-group reports."""


def _backend_factory(sc: LocalSamplerConfig) -> Callable[[], Any]:
    def build() -> Any:
        if sc.backend == "torch":
            from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig
            return TorchBackend(TorchBackendConfig(model_dir=sc.model_dir, dtype=sc.dtype, device=sc.device))
        from fleetrl.actors.samplers import vllm_backend
        return vllm_backend.VllmBackend(vllm_backend.VllmBackendConfig(model_dir=sc.model_dir, dtype=sc.dtype))
    return build


async def run(cfg: PoolConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[SamplerPool] = trio.TASK_STATUS_IGNORED) -> None:
    """The sampler pool actor (see the module docstring)."""
    pool = SamplerPool(policy=cfg.policy, max_staleness=cfg.max_staleness, max_latency_s=cfg.max_latency_s,
                       request_timeout_s=cfg.request_timeout_s, max_tries=cfg.max_tries,
                       attempts_per_step=cfg.attempts_per_step, affinity=cfg.affinity, log=ctx.log)
    collector = PoolMetrics(pool, ctx.name)
    ctx.metrics.registry.register(collector)
    reply = ctx.sender(cfg.reply_to) if cfg.reply_to else None
    source = None
    if cfg.weights_dir is not None:
        source = AsyncStoreSource(StoreSource(LocalDirStore(cfg.weights_dir)))
    try:
        async with trio.open_nursery() as samplers:
            if cfg.join:
                token_path = Path(cfg.fleet_token_file) if cfg.fleet_token_file else ctx.state_dir / "fleet_token"
                token = read_fleet_token(token_path)
                ctx.mount(cfg.join_prefix, fleet_app(pool, token=token, run_id=ctx.run_id,
                                                     heartbeat_s=cfg.heartbeat_s,
                                                     heartbeat_timeout_s=cfg.heartbeat_timeout_s),
                          auth=False)
            for sc in cfg.samplers:
                on_start = None
                if source is not None:
                    on_start = _follower_for(pool, source, samplers)
                samplers.start_soon(lambda sc=sc, on_start=on_start: pool.keep_local(
                    sc.id, _backend_factory(sc), price_per_hour=sc.price_per_hour, capacity=sc.capacity,
                    restart_backoff_s=cfg.restart_backoff_s, on_start=on_start, max_batch=sc.max_batch))
            samplers.start_soon(pool.health_loop, cfg.health_interval_s)
            task_status.started(pool)

            async def answer(req: m.GenerateRequest) -> None:
                result = await pool.generate(req)
                if reply is not None:
                    await reply.send(result)

            # the inbox ends at shutdown once every producer, and every actor holding the
            # pool's handle, has returned: nobody generates through the pool any more
            async with trio.open_nursery() as requests:
                async for msg in ctx.inbox:
                    match msg:
                        case m.GenerateRequest():
                            await ctx.wait_unpaused()
                            requests.start_soon(answer, msg)
                        case m.WeightVersionAvailable(version=version):
                            pool.announce(msg, samplers)
                            ctx.report_version("trainer", version)
                        case m.SamplerStatus(sampler_id=sid, version=version, digest=digest):
                            pool.set_sampler_version(sid, version, digest)
                        case StaleGroup():
                            pool.stale_reports += 1
                        case _:
                            ctx.log.warning("message ignored", type=type(msg).__name__)
            samplers.cancel_scope.cancel()  # the requests taken from the inbox are answered
    finally:
        if reply is not None:
            reply.close()
        ctx.metrics.registry.unregister(collector)


def _follower_for(pool: SamplerPool, source: Any, nursery: trio.Nursery
                  ) -> Callable[[LocalSampler], Awaitable[None]]:
    """Make each new local sampler follow the delta store: sync now and on every version."""

    async def start(sampler: LocalSampler) -> None:
        sync = WeightSync(sampler.backend, source)
        lock = trio.Lock()

        async def follow(_msg: m.WeightVersionAvailable | None = None) -> None:
            if sampler.sampler_id not in pool.handles or pool.handles[sampler.sampler_id] is not sampler:
                return
            async with lock:
                try:
                    v = await sync.sync()
                except Exception as exc:
                    pool._emit("weight sync failed", sampler=sampler.sampler_id,
                               error=f"{type(exc).__name__}: {exc}", level="warning")
                    return
                pool.set_sampler_version(sampler.sampler_id, v.version, v.digest)

        pool.on_version(follow)
        if pool.latest is not None:
            nursery.start_soon(follow)
    return start

"""The sampler pool actor (``fleetrl.actors.pool:run``).

Builds a `SamplerPool` from `PoolConfig`, keeps its local samplers alive (restarted
after ``restart_backoff_s``; each follows the trainer's delta store when
``weights_dir`` is set), mounts the join endpoint for remote samplers
(`remote_server.fleet_app`, authenticated by the fleet token), exports the per-sampler
metrics, and starts with the pool itself as its handle: other actors call
``(await ctx.handle("pool")).generate(request)`` and pace through it (requests go
through the handle, never the inbox). Its inbox takes the trainer's
`WeightVersionAvailable` announcements, samplers' `SamplerStatus`, the trainer's stale-group reports (acted on:
`SamplerPool.on_stale_group` lowers the pacing allowance, deprioritises lagging samplers
and resyncs followers) and its per-sampler mismatch measurements (`SamplerMismatch`,
recorded by `SamplerPool.record_mismatch`: they feed ``fleetrl_sampler_mismatch_kl``).
In-process samplers follow the delta store incrementally (`local.WeightSync`); each
version switch's pause is exported per sampler and backend (`metrics.SwitchPauses`).

A sampler configured with ``process = true`` runs as a child process that joins
through the same endpoint under its configured id and follows the delta store over
HTTP (``weights_prefix`` on the control plane); the pool restarts it when it exits
(`children.ProcessSampler`; its output in ``<state>/actors/<pool>/samplers/<id>.log``,
its pid, starts and exits in the metrics ``fleetrl_sampler_process_*``).

Drain: holding the pool's handle makes an actor a producer of its inbox, so the inbox
ends once every actor that generates through the pool has returned; then the requests
taken from the inbox are finished and the samplers are stopped (child processes get
SIGTERM, SIGKILL after ``process_grace_s``, and are reaped).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from fleetrl.actors.buffer import StaleGroup
from fleetrl.actors.weights.follower import StoreSource
from fleetrl.actors.weights.store import LocalDirStore
from fleetrl.daemon import messages as m
from fleetrl.daemon.actor import ActorContext
from fleetrl.daemon.state import client_host, control_cert, read_control, read_token

from .auth import read_fleet_token
from .children import Launch, ProcessSampler
from .config import LocalSamplerConfig, PoolConfig
from .core import SamplerPool
from .local import AsyncStoreSource, LocalSampler, WeightSync
from .metrics import PoolMetrics, SwitchPauses
from .remote_server import Reservations, fleet_app

__all__ = ["Inbox", "run"]

Inbox = m.WeightVersionAvailable | m.SamplerStatus | StaleGroup | m.SamplerMismatch
"""Requests to answer, the trainer's versions, samplers' reports, the trainer's stale-group
reports and its mismatch measurements."""


def _backend_factory(sc: LocalSamplerConfig, max_support: int) -> Callable[[], Any]:
    def build() -> Any:
        if sc.backend == "torch":
            from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig
            return TorchBackend(TorchBackendConfig(model_dir=sc.model_dir, dtype=sc.dtype, device=sc.device,
                                                   fp8_scheme=sc.fp8_scheme, matmul=sc.matmul,
                                                   max_support=max_support))
        from fleetrl.actors.samplers import vllm_backend
        return vllm_backend.VllmBackend(vllm_backend.VllmBackendConfig.of(sc.model_dir, sc.dtype, max_support, sc.vllm))
    return build


def _may_join(ctx: ActorContext) -> Callable[[str], bool] | None:
    """Whether a token is an issued credential that may join the fleet (role sampler or
    admin; daemon/credentials.py); None in a kernel without a token store."""
    store = ctx.credentials
    if store is None:
        return None

    def may_join(token: str) -> bool:
        cred = store.identify(token)
        return cred is not None and cred.role in ("sampler", "admin")
    return may_join


async def run(cfg: PoolConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[SamplerPool] = trio.TASK_STATUS_IGNORED) -> None:
    """The sampler pool actor (see the module docstring)."""
    pool = SamplerPool(policy=cfg.policy, max_staleness=cfg.max_staleness, max_latency_s=cfg.max_latency_s,
                       request_timeout_s=cfg.request_timeout_s, max_tries=cfg.max_tries,
                       attempts_per_step=cfg.attempts_per_step, affinity=cfg.affinity, log=ctx.log,
                       max_support=cfg.max_support, whole_vocabulary=cfg.whole_vocabulary)
    collector = PoolMetrics(pool, ctx.name)
    ctx.metrics.registry.register(collector)
    pauses = SwitchPauses(ctx.name)
    ctx.metrics.registry.register(pauses)
    source = None
    if cfg.weights_dir is not None:
        source = AsyncStoreSource(StoreSource(LocalDirStore(cfg.weights_dir)))
    children = [sc for sc in cfg.samplers if sc.process]
    launch = _launch(cfg, ctx) if children else None
    reservations = Reservations()
    try:
        async with trio.open_nursery() as samplers:
            if cfg.join or children:
                token = None
                if cfg.join:
                    token_path = Path(cfg.fleet_token_file) if cfg.fleet_token_file else ctx.state_dir / "fleet_token"
                    token = read_fleet_token(token_path)
                ctx.mount(cfg.join_prefix, fleet_app(pool, token=token, run_id=ctx.run_id,
                                                     heartbeat_s=cfg.heartbeat_s,
                                                     heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                                                     reservations=reservations,
                                                     credentials=_may_join(ctx) if cfg.join else None),
                          auth=False)
            processes: list[ProcessSampler] = []
            for sc in cfg.samplers:
                if sc.process:
                    assert launch is not None
                    child = ProcessSampler(sc, pool=pool, reservations=reservations, launch=launch,
                                           log_dir=ctx.state_dir / "samplers", policy=cfg.process_restart,
                                           start_timeout_s=cfg.process_start_timeout_s,
                                           grace_s=cfg.process_grace_s, log=ctx.log,
                                           on_change=_process_metrics(ctx))
                    samplers.start_soon(child.run)
                    processes.append(child)
                    continue
                on_start = None
                if source is not None:
                    on_start = _follower_for(pool, source, samplers, pauses)
                samplers.start_soon(lambda sc=sc, on_start=on_start: pool.keep_local(
                    sc.id, _backend_factory(sc, cfg.max_support), price_per_hour=sc.price_per_hour, capacity=sc.capacity,
                    restart_backoff_s=cfg.restart_backoff_s, on_start=on_start, max_batch=sc.max_batch))
            samplers.start_soon(pool.health_loop, cfg.health_interval_s)
            if cfg.wait_for_processes and processes:
                await _first_joins(processes, cfg.process_start_timeout_s, ctx)
            task_status.started(pool)

            # the inbox ends at shutdown once every producer, and every actor holding the
            # pool's handle, has returned: nobody generates through the pool any more
            async for msg in ctx.inbox:
                match msg:
                    case m.WeightVersionAvailable(version=version):
                        pool.announce(msg, samplers)
                        ctx.report_version("trainer", version)
                    case m.SamplerStatus(sampler_id=sid, version=version, digest=digest):
                        pool.set_sampler_version(sid, version, digest)
                    case StaleGroup():
                        pool.on_stale_group(msg, samplers)
                    case m.SamplerMismatch():
                        pool.record_mismatch(msg)
                    case _:
                        ctx.log.warning("message ignored", type=type(msg).__name__)
            samplers.cancel_scope.cancel()
    finally:
        if launch is not None and launch.weights_url is not None and ctx.credentials is not None:
            from fleetrl.daemon.credentials import UnknownCredential

            try:
                ctx.credentials.revoke(children_credential(ctx))
            except UnknownCredential:
                pass
        ctx.metrics.registry.unregister(collector)
        ctx.metrics.registry.unregister(pauses)


async def _first_joins(processes: list[ProcessSampler], timeout_s: float, ctx: ActorContext) -> None:
    """Wait until every child sampler joined once, at most ``timeout_s`` (``wait_for_processes``)."""
    t0 = trio.current_time()
    with trio.move_on_after(timeout_s):
        for child in processes:
            await child.first_join.wait()
    missing = [c.sc.id for c in processes if not c.first_join.is_set()]
    if missing:
        ctx.log.warning("starting without child samplers", samplers=missing, waited_s=round(timeout_s, 1))
    else:
        ctx.log.info("child samplers joined", samplers=[c.sc.id for c in processes],
                     waited_s=round(trio.current_time() - t0, 1))


def _launch(cfg: PoolConfig, ctx: ActorContext) -> Launch:
    """Where child samplers join (this daemon's control plane) and follow the deltas."""
    names = ", ".join(sc.id for sc in cfg.samplers if sc.process)
    try:
        host, port = read_control(ctx.daemon_dir)
    except FileNotFoundError:
        raise ValueError(f"samplers {names} have process = true: they join through the control plane, so "
                         f"set [http] enabled = true (no control.json in {ctx.daemon_dir})") from None
    base = f"{client_host(host)}:{port}"
    cert = control_cert(ctx.daemon_dir)  # TLS: the children verify the daemon's own certificate
    web, ws = ("https", "wss") if cert else ("http", "ws")
    weights_url = f"{web}://{base}{cfg.weights_prefix}" if cfg.weights_dir is not None else None
    return Launch(join_url=f"{ws}://{base}{cfg.join_prefix}/join", weights_url=weights_url,
                  control_token=_weights_token(ctx) if weights_url is not None else None, ca_file=cert,
                  max_support=cfg.max_support)


def children_credential(ctx: ActorContext) -> str:
    """The name of the ``weights-read`` token this pool's child samplers read weights with."""
    return re.sub(r"[^A-Za-z0-9._@-]", "-", f"pool-{ctx.name}-children")[:64]


def _weights_token(ctx: ActorContext) -> str:
    """A ``weights-read`` token for the child samplers (they read weights and nothing
    else: their join uses a reservation token of its own): the one of an earlier start is
    revoked and a fresh one issued; revoked again when the pool ends. Without a token
    store (a bare kernel): the daemon's token."""
    store = ctx.credentials
    if store is None:
        return read_token(ctx.daemon_dir)
    from fleetrl.daemon.credentials import UnknownCredential

    try:
        store.revoke(children_credential(ctx))
    except UnknownCredential:
        pass
    _, token = store.create("weights-read", children_credential(ctx))
    return token


def _process_metrics(ctx: ActorContext) -> Callable[[ProcessSampler], None]:
    """Export each child sampler's pid, starts and exits (called after each start and exit)."""

    def update(child: ProcessSampler) -> None:
        labels = {"sampler": child.sc.id}
        ctx.metrics.gauge("sampler_process_pid", "pid of the sampler's child process (0 between starts)",
                          labels).set(child.pid or 0)
        ctx.metrics.gauge("sampler_process_starts", "times the sampler's child process was started",
                          labels).set(child.starts)
        ctx.metrics.gauge("sampler_process_exits", "times the sampler's child process exited or was killed",
                          labels).set(child.exits)
    return update


def _follower_for(pool: SamplerPool, source: Any, nursery: trio.Nursery, pauses: SwitchPauses | None = None
                  ) -> Callable[[LocalSampler], Awaitable[None]]:
    """Make each new local sampler follow the delta store: sync now and on every version."""

    async def start(sampler: LocalSampler) -> None:
        sync = WeightSync(sampler.backend, source,
                          on_switch=pauses.observer(sampler.sampler_id) if pauses is not None else None)
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

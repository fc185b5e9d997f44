"""The sampler pool: routes generate requests over local and remote samplers.

`SamplerPool` is the in-process core (no daemon needed, so tests and benches use it
directly); `run` is the actor that builds one from `PoolConfig`, keeps its local
samplers alive, mounts the join endpoint for remote samplers, exports metrics, and
serves `GenerateRequest`s from its inbox. Other actors in the daemon can also call it
directly: ``pool = await pool_client("pool")`` then ``await pool.generate(request)``.

What the pool guarantees:

* every request gets exactly one answer: a `Generation`, or a `GenerateFailed` when the
  request itself is bad or has broken ``max_tries`` samplers;
* a request is only ever routed to a live sampler whose weights are new enough
  (`routing.feasible`); when none is, it waits (the trainer's next version or a
  sampler catching up wakes it);
* prompt affinity (``affinity``, on by default): a request whose prompt token ids
  equal those of a request still outstanding goes to that request's sampler while it
  is feasible and has a free slot (`routing.with_affinity`), so a group's attempts
  share a batch and a batching backend can prefill their prompt once; the memory of a
  prompt ends with its last outstanding request (`routing.AffinityTable`);
* a sampler that dies (its connection drops, its backend raises), fails a health check,
  or does not answer a request within ``request_timeout_s`` is taken out; the requests
  it held go back to routing and are served by others, nothing is lost;
* local samplers are restarted (after ``restart_backoff_s``); remote ones rejoin by
  themselves (the remote client reconnects with backoff);
* each `Generation` carries its cost (``cost_usd``): the answering sampler's price
  times the busy seconds charged to the request (`registry`);
* pacing: ``async with pool.attempt(id)`` admits an attempt only while it cannot end
  up staler than ``max_staleness`` (`pacing`), and `released` hands finished attempts
  on in admission order (the order the bound assumes the trainer takes them in);
  nothing finished is dropped.
"""

from __future__ import annotations

import hmac
import itertools
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fleetrl.daemon import messages as m

from .local import LocalSampler, SamplerHandle, SamplerLost
from .pacing import Admission, Pacer
from .registry import Registry
from .routing import AffinityTable, Bounds, policy_named, prompt_key, with_affinity

__all__ = ["LocalSamplerConfig", "PacedAttempt", "PoolConfig", "PoolMetrics", "SamplerPool", "pool_client",
           "read_fleet_token", "run"]

PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]


class LocalSamplerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One sampler run inside the daemon."""

    id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]+$")]
    model_dir: str
    backend: Literal["torch", "vllm"] = "torch"
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    device: str = "cpu"
    price_per_hour: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    capacity: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Requests served at once (what routing counts against)."""
    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Most requests in one backend call (concurrent requests are decoded as batches)."""


class PoolConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of the sampler pool actor (``[actors.pool.config]``)."""

    policy: Literal["least_loaded", "cost_aware"] = "least_loaded"
    affinity: bool = True
    """Prompt affinity: a request goes to the sampler holding others with the same prompt
    (while that one is feasible and has a free slot), so a group shares a batch."""
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] = 2
    """Samplers more than this many versions behind the trainer get no requests."""
    max_latency_s: PosFloat = 120.0
    """Cost-aware routing keeps the expected latency of a request under this."""
    request_timeout_s: PosFloat = 600.0
    """A sampler that holds one request longer than this has stopped answering."""
    max_tries: Annotated[int, msgspec.Meta(ge=1)] = 5
    """Samplers a request may break (or be refused by) before it is failed."""
    health_interval_s: PosFloat = 10.0
    health_timeout_s: PosFloat = 30.0
    restart_backoff_s: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    samplers: tuple[LocalSamplerConfig, ...] = ()
    """Local samplers."""
    weights_dir: str | None = None
    """A local delta store (actors/weights LocalDirStore) that local samplers follow."""
    join: bool = True
    """Mount the join endpoint for remote samplers at ``join_prefix`` on the control plane."""
    join_prefix: str = "/fleet"
    fleet_token_file: str | None = None
    """File holding the fleet token; default ``<actor state dir>/fleet_token`` (created, 0600)."""
    heartbeat_s: PosFloat = 2.0
    heartbeat_timeout_s: PosFloat = 10.0
    """A remote silent for this long is treated as dead."""
    reply_to: str | None = None
    """Actor that receives the answers to requests taken from the inbox."""
    attempts_per_step: Annotated[int, msgspec.Meta(ge=1)] = 64
    """Attempts the trainer consumes per version (for staleness pacing)."""

    def __post_init__(self) -> None:
        ids = [s.id for s in self.samplers]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"samplers: duplicate id(s) {', '.join(dup)}")


class PacedAttempt:
    """An admitted attempt inside `SamplerPool.attempt`; set `result` before leaving."""

    __slots__ = ("admission", "result")

    def __init__(self, admission: Admission) -> None:
        self.admission = admission
        self.result: Any = None


class SamplerPool:
    """The routing core (see the module docstring)."""

    def __init__(self, *, policy: str = "least_loaded", max_staleness: int = 2,
                 max_latency_s: float = math.inf, request_timeout_s: float = 600.0,
                 max_tries: int = 5, attempts_per_step: int = 64, trainer_version: int = 0,
                 affinity: bool = True, log: Any = None) -> None:
        self.policy_name = policy
        self._policy = policy_named(policy)
        self.affinity: AffinityTable | None = AffinityTable() if affinity else None
        """Prompt -> sampler of its outstanding requests (None: affinity off)."""
        self.max_staleness = max_staleness
        self.max_latency_s = max_latency_s
        self.request_timeout_s = request_timeout_s
        self.max_tries = max_tries
        self.registry = Registry()
        self.handles: dict[str, SamplerHandle] = {}
        self.trainer_version = trainer_version
        self.latest: m.WeightVersionAvailable | None = None
        self.pacer = Pacer(max_staleness=max_staleness, attempts_per_step=attempts_per_step,
                           start_version=trainer_version)
        self.log = log
        self._changed = trio.Event()
        self._inflight: dict[str, set[trio.CancelScope]] = {}
        self._dead_events: dict[str, trio.Event] = {}
        self._listeners: list[Callable[[m.WeightVersionAvailable], Awaitable[None]]] = []
        self._ready: list[tuple[Admission, Any, bool]] = []  # released, not yet taken
        self.answered = 0
        self.rerouted = 0
        self.failed = 0
        self._ids = itertools.count(1)

    # -- membership ---------------------------------------------------------------------
    def add(self, handle: SamplerHandle, identity: m.SamplerIdentity, *, price_per_hour: float,
            capacity: int, remote: bool, version: int = 0, digest: str = "") -> None:
        """Register a live sampler (replacing a dead record of the same id)."""
        sid = handle.sampler_id
        if sid in self.handles:
            raise ValueError(f"sampler {sid!r} is already registered")
        self.registry.add(identity, price_per_hour=price_per_hour, capacity=capacity, remote=remote,
                          version=version, digest=digest, now=trio.current_time())
        self.handles[sid] = handle
        self._inflight[sid] = set()
        self._dead_events[sid] = trio.Event()
        self._emit("sampler joined", sampler=sid, remote=remote, version=version,
                   backend=identity.backend, dtype=identity.dtype)
        self._notify()

    def new_sampler_id(self, prefix: str) -> str:
        while True:
            sid = f"{prefix}-{next(self._ids)}"
            if sid not in self.registry:
                return sid

    def mark_dead(self, sampler_id: str, reason: str) -> None:
        """Take a sampler out: no new requests; its in-flight ones are re-routed."""
        handle = self.handles.pop(sampler_id, None)
        if handle is None:
            return
        self.registry.mark_dead(sampler_id)
        if self.affinity is not None:
            self.affinity.forget_sampler(sampler_id)
        for scope in self._inflight.pop(sampler_id, set()):
            scope.cancel()
        self._dead_events.pop(sampler_id).set()
        self._emit("sampler lost", sampler=sampler_id, reason=reason, level="warning")
        self._notify()

    async def wait_dead(self, sampler_id: str) -> None:
        ev = self._dead_events.get(sampler_id)
        if ev is not None:
            await ev.wait()

    def set_sampler_version(self, sampler_id: str, version: int, digest: str) -> None:
        if sampler_id in self.registry:
            self.registry.set_version(sampler_id, version, digest, trio.current_time())
            self._notify()

    def heard_from(self, sampler_id: str) -> None:
        if sampler_id in self.registry:
            self.registry.seen(sampler_id, trio.current_time())

    # -- versions -------------------------------------------------------------------------
    def on_version(self, listener: Callable[[m.WeightVersionAvailable], Awaitable[None]]) -> None:
        """Call `listener` (in the nursery given to `announce`) for every new version."""
        self._listeners.append(listener)

    def announce(self, msg: m.WeightVersionAvailable, nursery: trio.Nursery) -> None:
        """The trainer published `msg.version`: move the staleness bound, tell samplers."""
        if msg.version < self.trainer_version:
            self._emit("old weight version ignored", version=msg.version, current=self.trainer_version,
                       level="warning")
            return
        self.trainer_version = msg.version
        self.latest = msg
        self.pacer.advance(msg.version)
        for listener in list(self._listeners):
            nursery.start_soon(listener, msg)
        self._notify()

    def set_trainer_version(self, version: int) -> None:
        """Move the staleness bound without a delta message (tests, embedded use)."""
        self.trainer_version = max(self.trainer_version, version)
        self.pacer.advance(self.trainer_version)
        self._notify()

    # -- pacing ---------------------------------------------------------------------------
    async def admit(self, attempt_id: str) -> Admission:
        """Wait until a new attempt may start without risking the staleness bound.
        Every admitted attempt must be ended with `finish` (or use `attempt`)."""
        while True:
            oldest = self.registry.oldest_live_version()
            oldest = self.trainer_version if oldest is None else min(oldest, self.trainer_version)
            # routing never uses weights older than trainer_version - max_staleness
            oldest = max(oldest, self.trainer_version - self.max_staleness)
            adm = self.pacer.try_admit(attempt_id, oldest)
            if adm is not None:
                return adm
            await self._wait_change()

    def finish(self, attempt_id: str, result: Any = None, *, failed: bool = False) -> None:
        """An admitted attempt ended with `result` (`failed`: without one). Every finished
        attempt whose predecessors have all ended moves, in admission order, to the
        releases that `released` hands out."""
        self.pacer.finish(attempt_id, result, failed=failed)
        ready = self.pacer.take_ready()
        if ready:
            self._ready.extend(ready)
            self._notify()

    async def released(self) -> list[tuple[Admission, Any, bool]]:
        """Wait for released attempts and take them: ``(admission, result, failed)`` in
        admission order. The bound assumes the trainer consumes results in this order."""
        while not self._ready:
            await self._wait_change()
        out, self._ready = self._ready, []
        return out

    @asynccontextmanager
    async def attempt(self, attempt_id: str) -> AsyncIterator[PacedAttempt]:
        """Pacing for one attempt::

            async with pool.attempt(attempt_id) as att:   # waits for admission
                ...                                        # generate, score
                att.result = trajectory

        Leaving normally finishes the attempt with ``att.result``; leaving by an
        exception (cancellation included) finishes it as failed. Either way it keeps
        its place in the order and comes out of `released` once its predecessors ended."""
        att = PacedAttempt(await self.admit(attempt_id))
        try:
            yield att
        except BaseException:
            self.finish(attempt_id, failed=True)
            raise
        self.finish(attempt_id, att.result)

    # -- serving --------------------------------------------------------------------------
    def bounds(self, request: m.GenerateRequest) -> Bounds:
        return Bounds(trainer_version=self.trainer_version, max_staleness=self.max_staleness,
                      min_version=request.min_version, max_latency_s=self.max_latency_s)

    async def _route(self, request: m.GenerateRequest, key: bytes | None) -> str:
        """The sampler for `request`: with affinity (`key` given), the one holding other
        requests with the same prompt if it can take it, else the policy's choice."""
        while True:
            views, bounds = self.registry.views(trio.current_time()), self.bounds(request)
            if key is None or self.affinity is None:
                sid = self._policy(views, bounds)
            else:
                sid = with_affinity(self._policy, views, bounds, self.affinity.sampler_for(key))
            if sid is not None and sid in self.handles:
                return sid
            await self._wait_change()

    async def generate(self, request: m.GenerateRequest) -> m.Generation | m.GenerateFailed:
        """Answer `request` (see the module docstring for the guarantees)."""
        problems: list[str] = []
        key = None
        if self.affinity is not None:
            key = prompt_key(request.prompt_ids.dtype, request.prompt_ids.data)
        while True:
            sid = await self._route(request, key)
            handle = self.handles[sid]
            record = self.registry.assign(sid)
            if key is not None and self.affinity is not None:
                self.affinity.routed(key, sid)  # no checkpoint since _route: the memory is current
            scope = trio.CancelScope(deadline=trio.current_time() + self.request_timeout_s)
            self._inflight[sid].add(scope)
            t_start: float | None = None
            mark: float | None = None

            def started() -> None:
                nonlocal t_start, mark
                t_start = trio.current_time()
                mark = self.registry.started(sid, t_start, record=record)

            result: m.Generation | m.GenerateFailed | None = None
            lost: str | None = None
            try:
                with scope:
                    result = await handle.generate(request, started)
            except SamplerLost as exc:
                lost = str(exc)
            except BaseException:  # the caller gave up (cancelled): the request is over here
                self.registry.ended(sid, trio.current_time(), ran=t_start is not None, mark=mark, record=record)
                self._notify()
                raise
            finally:
                live = self._inflight.get(sid)
                if live is not None:
                    live.discard(scope)
                if key is not None and self.affinity is not None:
                    self.affinity.ended(key)
            now = trio.current_time()
            if result is None and lost is None:  # our scope was cancelled
                if sid in self.handles:  # not by mark_dead: the deadline passed
                    lost = f"no answer within request_timeout_s={self.request_timeout_s}"
                    self.mark_dead(sid, lost)
                else:
                    lost = "sampler taken out while serving"
            elif lost is not None:
                self.mark_dead(sid, lost)
            ok = isinstance(result, m.Generation)
            busy_s = self.registry.ended(sid, now, ran=t_start is not None,
                                         tokens=result.token_ids.shape[0] if ok else 0,
                                         latency_s=(now - t_start) if ok and t_start is not None else None,
                                         failed=not ok, mark=mark, record=record)
            self._notify()
            if ok:
                self.answered += 1
                price = record.price_per_hour
                return msgspec.structs.replace(result, cost_usd=price / 3600.0 * busy_s)
            if isinstance(result, m.GenerateFailed) and not result.retryable:
                self.failed += 1
                return result
            problems.append(f"{sid}: {lost if lost is not None else result.reason}")
            self.rerouted += 1
            self._emit("request re-routed", request=request.request_id, sampler=sid, why=problems[-1])
            if len(problems) >= self.max_tries:
                self.failed += 1
                return m.GenerateFailed(request_id=request.request_id, retryable=True,
                                        reason=f"failed on {len(problems)} samplers: " + "; ".join(problems))

    # -- local samplers -------------------------------------------------------------------
    async def keep_local(self, sampler_id: str, factory: Callable[[], Any], *, price_per_hour: float,
                         capacity: int, restart_backoff_s: float,
                         on_start: Callable[[LocalSampler], Awaitable[None]] | None = None,
                         max_batch: int = 64) -> None:
        """Run a local sampler for ever: build its backend (in a thread), register it,
        wait until it is taken out, then rebuild it after `restart_backoff_s`."""
        while True:
            try:
                backend = await trio.to_thread.run_sync(factory)
            except Exception as exc:
                self._emit("local sampler failed to start", sampler=sampler_id,
                           error=f"{type(exc).__name__}: {exc}", level="error")
                await trio.sleep(max(restart_backoff_s, 0.1))
                continue
            sampler = LocalSampler(sampler_id, backend, capacity=capacity, max_batch=max_batch)
            try:
                v = backend.weight_version
                self.add(sampler, sampler.identity, price_per_hour=price_per_hour, capacity=capacity,
                         remote=False, version=v.version, digest=v.digest)
                if on_start is not None:
                    await on_start(sampler)
                await self.wait_dead(sampler_id)
            finally:  # also when the actor stops: a vLLM engine holds memory until closed
                await sampler.aclose()
            await trio.sleep(restart_backoff_s)
            self._emit("restarting local sampler", sampler=sampler_id)

    async def health_loop(self, interval_s: float) -> None:
        """Check every sampler each `interval_s`; take out the ones that fail."""
        while True:
            await trio.sleep(interval_s)
            for sid, handle in list(self.handles.items()):
                if not await handle.health():
                    self.mark_dead(sid, "health check failed")

    # -- internals ------------------------------------------------------------------------
    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_change(self) -> None:
        await self._changed.wait()

    def _emit(self, event: str, level: str = "info", **kw: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(event, **kw)


class PoolMetrics(Collector):
    """Per-sampler Prometheus metrics, read from the registry at scrape time."""

    def __init__(self, pool: SamplerPool, actor: str) -> None:
        self.pool = pool
        self.actor = actor

    def describe(self) -> Iterable[Any]:
        return []  # names are checked at scrape time, so a restarted actor can re-register

    def collect(self) -> Iterable[GaugeMetricFamily]:
        labels = ["actor", "sampler", "backend", "device", "dtype", "remote"]
        fams = {
            "up": GaugeMetricFamily("fleetrl_sampler_up", "1 while the sampler is live", labels=labels),
            "tps": GaugeMetricFamily("fleetrl_sampler_tokens_per_second",
                                     "generated tokens per busy second", labels=labels),
            "queue": GaugeMetricFamily("fleetrl_sampler_queue_depth",
                                       "requests assigned and not answered", labels=labels),
            "lag": GaugeMetricFamily("fleetrl_sampler_version_lag",
                                     "trainer version minus the sampler's", labels=labels),
            "usd": GaugeMetricFamily("fleetrl_sampler_usd_per_1k_tokens",
                                     "measured dollars per 1000 generated tokens", labels=labels),
            "tokens": GaugeMetricFamily("fleetrl_sampler_tokens", "tokens generated", labels=labels),
        }
        try:
            now: float | None = trio.current_time()
        except RuntimeError:  # scraped from outside Trio: busy time up to the last change
            now = None
        for r in self.pool.registry.records():
            lv = [self.actor, r.sampler_id, r.identity.backend, r.identity.device_kind,
                  r.identity.dtype, str(r.remote).lower()]
            fams["up"].add_metric(lv, 1.0 if r.alive else 0.0)
            fams["queue"].add_metric(lv, float(r.assigned))
            fams["lag"].add_metric(lv, float(self.pool.trainer_version - r.version))
            fams["tokens"].add_metric(lv, float(r.tokens))
            tps = r.tokens_per_s(now)
            if tps is not None:
                fams["tps"].add_metric(lv, tps)
            usd = r.usd_per_1k_tokens(now)
            if usd is not None:
                fams["usd"].add_metric(lv, usd)
        kl = GaugeMetricFamily("fleetrl_sampler_mismatch_kl",
                               "k3 KL of sampler vs trainer log-probs, reported by the trainer",
                               labels=["actor", "backend", "device", "dtype"])
        for (backend, device, dtype), value in self.pool.registry.mismatch_kl.items():
            kl.add_metric([self.actor, backend, device, dtype], value)
        yield from fams.values()
        yield kl


# -- the actor --------------------------------------------------------------------------------

_CLIENTS: dict[str, SamplerPool] = {}
_READY: dict[str, trio.Event] = {}


async def pool_client(name: str = "pool") -> SamplerPool:
    """The running pool actor called `name` (waits until it has started)."""
    while name not in _CLIENTS:
        ev = _READY.setdefault(name, trio.Event())
        await ev.wait()
    return _CLIENTS[name]


def read_fleet_token(path: Path) -> str:
    """The fleet token in `path`, created (random, mode 0600) when missing."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        fd = path.open("x", encoding="utf-8")
        with fd:
            path.chmod(0o600)
            fd.write(token + "\n")
    token = path.read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"fleet token file {path} is empty")
    return token


def token_matches(given: str, token: str) -> bool:
    return hmac.compare_digest(given.encode(), token.encode())


def _backend_factory(sc: LocalSamplerConfig) -> Callable[[], Any]:
    def build() -> Any:
        if sc.backend == "torch":
            from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig
            return TorchBackend(TorchBackendConfig(model_dir=sc.model_dir, dtype=sc.dtype, device=sc.device))
        from fleetrl.actors.samplers import vllm_backend
        return vllm_backend.VllmBackend(vllm_backend.VllmBackendConfig(model_dir=sc.model_dir, dtype=sc.dtype))
    return build


async def run(cfg: PoolConfig, ctx: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """The sampler pool actor (see the module docstring)."""
    from .remote_server import fleet_app

    pool = SamplerPool(policy=cfg.policy, max_staleness=cfg.max_staleness, max_latency_s=cfg.max_latency_s,
                       request_timeout_s=cfg.request_timeout_s, max_tries=cfg.max_tries,
                       attempts_per_step=cfg.attempts_per_step, affinity=cfg.affinity, log=ctx.log)
    collector = PoolMetrics(pool, ctx.name)
    ctx.metrics.registry.register(collector)
    reply = ctx.sender(cfg.reply_to) if cfg.reply_to else None
    source = None
    if cfg.weights_dir is not None:
        from fleetrl.actors.weights.follower import StoreSource
        from fleetrl.actors.weights.store import LocalDirStore

        from .local import AsyncStoreSource
        source = AsyncStoreSource(StoreSource(LocalDirStore(cfg.weights_dir)))
    try:
        async with trio.open_nursery() as nursery:
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
                    on_start = _follower_for(pool, source, nursery)
                nursery.start_soon(lambda sc=sc, on_start=on_start: pool.keep_local(
                    sc.id, _backend_factory(sc), price_per_hour=sc.price_per_hour, capacity=sc.capacity,
                    restart_backoff_s=cfg.restart_backoff_s, on_start=on_start, max_batch=sc.max_batch))
            nursery.start_soon(pool.health_loop, cfg.health_interval_s)
            _CLIENTS[ctx.name] = pool
            _READY.pop(ctx.name, trio.Event()).set()
            task_status.started()

            async def answer(req: m.GenerateRequest) -> None:
                result = await pool.generate(req)
                if reply is not None:
                    await reply.send(result)

            async for msg in ctx.inbox:
                if isinstance(msg, m.GenerateRequest):
                    await ctx.wait_unpaused()
                    nursery.start_soon(answer, msg)
                elif isinstance(msg, m.WeightVersionAvailable):
                    pool.announce(msg, nursery)
                    ctx.report_version("trainer", msg.version)
                elif isinstance(msg, m.SamplerStatus):
                    pool.set_sampler_version(msg.sampler_id, msg.version, msg.digest)
                else:
                    ctx.log.warning("message ignored", type=type(msg).__name__)
            # inbox ended (shutdown): let in-flight requests finish, then stop the samplers
            while pool.registry.records() and any(r.assigned for r in pool.registry.records()):
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    finally:
        _CLIENTS.pop(ctx.name, None)
        ctx.metrics.registry.unregister(collector)


def _follower_for(pool: SamplerPool, source: Any, nursery: trio.Nursery
                  ) -> Callable[[LocalSampler], Awaitable[None]]:
    """Make each new local sampler follow the delta store: sync now and on every version."""
    from .local import WeightSync

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

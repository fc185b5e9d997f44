"""The sampler pool: routes generate requests over local and remote samplers.

`SamplerPool` is the in-process core (no daemon needed, so tests and benches use it
directly); the actor (`fleetrl.actors.pool.actor`) builds one from `PoolConfig`, keeps
its local samplers alive, mounts the join endpoint for remote samplers, exports
metrics, serves `GenerateRequest`s from its inbox, and starts with the pool as its
handle: other actors in the daemon call it directly, ``pool = await
ctx.handle("pool")`` then ``await pool.generate(request)``.

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
  nothing finished is dropped. The pacer's bound needs every token of an admitted
  attempt to come from weights at least as new as the version it was admitted with
  (the fleet's oldest then); so while an attempt is in flight, no request is routed to
  a sampler older than the newest such promise (`Pacer.floor`; the requests do not say
  which attempt they belong to). A sampler that joins, or restarts, with older weights
  waits until it has caught up;
* stale-group reports (`on_stale_group`, the trainer's `StaleGroup` rejections) are
  acted on: counted by reason; the pacing allowance is lowered by the excess staleness
  (fewer attempts run ahead of the trainer; it comes back gradually, `pacing`); samplers
  whose weights the trainer already refuses (older than ``trainer_version -
  max_staleness`` of the report) are asked to sync again (every version follower is
  re-sent the newest version; those on it fetch nothing) and get no requests while a
  sampler at least that new is live (they are deprioritised, never the only ones left
  idle with work waiting);
* the trainer's mismatch measurements (`record_mismatch`, `SamplerMismatch`) are kept
  per sampler and per (backend, device kind, dtype) in the registry, which the
  ``fleetrl_sampler_mismatch_kl`` gauge reads.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any

import msgspec
import trio

from fleetrl.actors.buffer import StaleGroup
from fleetrl.actors.samplers.base import routed_params
from fleetrl.daemon import messages as m
from fleetrl.daemon.streams import stream_or_once
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT

from .errors import SamplerLost
from .local import LocalSampler, SamplerHandle
from .pacing import Admission, Pacer
from .registry import Registry, SamplerRow, sampler_rows
from .routing import AffinityTable, Bounds, policy_named, prompt_key, with_affinity

__all__ = ["RESTART_CAUSES", "PacedAttempt", "PoolStatistics", "SamplerPool", "restart_cause"]


class PoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What the pool has done (its handle's ``statistics()``; /status and /metrics)."""

    trainer_version: int
    samplers_live: int
    samplers_remote: int
    answered: int
    """Requests answered with a Generation."""
    rerouted: int
    """Times a request was taken off a sampler and routed again."""
    failed: int
    """Requests answered with GenerateFailed."""
    attempts_in_flight: int
    """Admitted attempts the pacer has not released yet."""
    attempts_waiting: int
    """Finished attempts waiting for earlier ones (release in admission order)."""
    stale_reports: int
    """Stale-group reports the trainer sent."""
    stale_by_reason: dict[str, int] = {}
    """The same by reason (``too_stale`` at admission, ``expired`` in the trainer's queue)."""
    pacing_allowance: int = 0
    """The staleness the pacer admits attempts with now (<= max_staleness; lowered by
    stale-group reports, restored gradually)."""
    resyncs: int = 0
    """Times a stale-group report made the pool re-send the newest version to its followers."""
    mismatch_reports: int = 0
    """Mismatch measurements the trainer sent (`SamplerMismatch`)."""
    restarted: dict[str, dict[str, int]] = {}
    """Requests a sampler did not answer and the pool routed again or failed, per sampler
    id and cause (`RESTART_CAUSES`): ``weight_version`` (the sampler held older weights
    than the request needed: a weight switch restarted it), ``lost`` (the sampler died
    or was taken out), ``deadline`` (no answer within ``request_timeout_s``), ``failed``
    (another retryable failure). A version switch that reaches a running request never
    restarts it: the request goes on with the new weights and each token records its
    version."""
    discarded_tokens: dict[str, dict[str, int]] = {}
    """Tokens those requests had already streamed to their caller (thrown away: a stream is
    not resumed elsewhere), per sampler id and cause."""
    samplers: tuple[SamplerRow, ...] = ()
    """Every sampler the pool knows, live or not: backend, device, dtype, version, queue,
    tokens per second, dollars per 1k tokens, mismatch, health (`registry.SamplerRow`)."""


RESTART_CAUSES = ("weight_version", "lost", "deadline", "failed")
"""Why a sampler did not answer a request the pool then routed again or failed."""


def restart_cause(result: m.Generation | m.GenerateFailed | None, lost: str | None, deadline: bool) -> str:
    """The `RESTART_CAUSES` entry of a request a sampler did not answer: its answer said it
    held older weights, the request's deadline passed, the sampler was lost, or it failed."""
    if isinstance(result, m.GenerateFailed) and result.cause == "weight_version":
        return "weight_version"
    if deadline:
        return "deadline"
    return "lost" if lost is not None else "failed"


def _trio_now() -> float | None:
    try:
        return trio.current_time()
    except RuntimeError:  # read from outside Trio: rates up to the last finished request
        return None


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
                 affinity: bool = True, log: Any = None, restore_versions: int = 4,
                 max_support: int = DEFAULT_MAX_SUPPORT, whole_vocabulary: bool = False) -> None:
        self.policy_name = policy
        self._policy = policy_named(policy)
        self.affinity: AffinityTable | None = AffinityTable() if affinity else None
        """Prompt -> sampler of its outstanding requests (None: affinity off)."""
        self.max_staleness = max_staleness
        self.max_latency_s = max_latency_s
        self.request_timeout_s = request_timeout_s
        self.max_tries = max_tries
        self.max_support = max_support
        """Every request's ``top_k`` is at most this (`routed_params`)."""
        self.whole_vocabulary = whole_vocabulary
        """Untruncated calls draw from the whole vocabulary (`routed_params`)."""
        self.registry = Registry()
        self.handles: dict[str, SamplerHandle] = {}
        self.trainer_version = trainer_version
        self.latest: m.WeightVersionAvailable | None = None
        self.pacer = Pacer(max_staleness=max_staleness, attempts_per_step=attempts_per_step,
                           start_version=trainer_version, restore_versions=restore_versions)
        self.log = log
        self._changed = trio.Event()
        self._inflight: dict[str, set[trio.CancelScope]] = {}
        self._dead_events: dict[str, trio.Event] = {}
        self._listeners: list[Callable[[m.WeightVersionAvailable], Awaitable[None]]] = []
        self._ready: list[tuple[Admission, Any, bool]] = []  # released, not yet taken
        self.answered = 0
        self.rerouted = 0
        self.failed = 0
        self.restarted: dict[str, dict[str, int]] = {}
        self.discarded_tokens: dict[str, dict[str, int]] = {}
        self.stale_reports = 0
        self.stale_by_reason: dict[str, int] = {}
        self.resyncs = 0
        self._resync_at = -1  # trainer version of the last resync
        self.lag_floor = 0
        """Samplers older than this are deprioritised (`on_stale_group`)."""
        self.mismatch_reports = 0
        self._ids = itertools.count(1)

    def statistics(self) -> PoolStatistics:
        """What the pool has done so far (the pool actor's handle record)."""
        live = [r for r in self.registry.records() if r.alive]
        return PoolStatistics(trainer_version=self.trainer_version, samplers_live=len(live),
                              samplers_remote=sum(1 for r in live if r.remote), answered=self.answered,
                              rerouted=self.rerouted, failed=self.failed,
                              restarted={k: dict(v) for k, v in self.restarted.items()},
                              discarded_tokens={k: dict(v) for k, v in self.discarded_tokens.items()},
                              attempts_in_flight=self.pacer.in_flight, attempts_waiting=self.pacer.waiting,
                              stale_reports=self.stale_reports, stale_by_reason=dict(self.stale_by_reason),
                              pacing_allowance=self.pacer.allowance, resyncs=self.resyncs,
                              mismatch_reports=self.mismatch_reports,
                              samplers=sampler_rows(self.registry.records(), self.trainer_version, _trio_now()))

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
    def promised_version(self) -> int:
        """The oldest weight version a new attempt's tokens may come from: the fleet's
        oldest live version (no newer than the trainer's), raised to ``trainer_version -
        allowance`` (older samplers are kept off the attempt by the pacer's floor)."""
        oldest = self.registry.oldest_live_version()
        oldest = self.trainer_version if oldest is None else min(oldest, self.trainer_version)
        return max(oldest, self.trainer_version - self.pacer.allowance, 0)

    async def admit(self, attempt_id: str) -> Admission:
        """Wait until a new attempt may start without risking the staleness bound.
        Every admitted attempt must be ended with `finish` (or use `attempt`)."""
        while True:
            adm = self.pacer.try_admit(attempt_id, self.promised_version())
            if adm is not None:
                self._notify()  # the floor may have risen
                return adm
            await self._wait_change()

    def finish(self, attempt_id: str, result: Any = None, *, failed: bool = False) -> None:
        """An admitted attempt ended with `result` (`failed`: without one). Every finished
        attempt whose predecessors have all ended moves, in admission order, to the
        releases that `released` hands out."""
        self.pacer.finish(attempt_id, result, failed=failed)
        self._ready.extend(self.pacer.take_ready())
        self._notify()  # releases, or a lower floor

    async def released(self) -> list[tuple[Admission, Any, bool]]:
        """Wait for released attempts and take them: ``(admission, result, failed)`` in
        admission order. The bound assumes the trainer consumes results in this order."""
        while not self._ready:
            await self._wait_change()
        return self.released_nowait()

    def released_nowait(self) -> list[tuple[Admission, Any, bool]]:
        """`released` without waiting: what has been released so far (maybe nothing)."""
        out, self._ready = self._ready, []
        return out

    # -- the trainer's reports --------------------------------------------------------------
    def on_stale_group(self, msg: StaleGroup, nursery: trio.Nursery | None = None) -> None:
        """The trainer refused a group as too stale (``msg``): count it, lower the pacing
        allowance (`Pacer.tighten`), and deprioritise and resync the samplers whose
        weights the trainer would refuse (see the module docstring). ``nursery`` runs
        the version followers (the one given to `announce`); without it nothing is re-sent."""
        self.stale_reports += 1
        self.stale_by_reason[msg.reason] = self.stale_by_reason.get(msg.reason, 0) + 1
        excess = msg.staleness - msg.max_staleness
        if self.pacer.tighten(excess, msg.trainer_version):
            self._emit("pacing allowance lowered", allowance=self.pacer.allowance, max_staleness=self.max_staleness,
                       group=msg.group_id, staleness=msg.staleness, accepted=msg.max_staleness, level="warning")
        cutoff = msg.trainer_version - msg.max_staleness  # the trainer refuses tokens older than this
        if cutoff > self.lag_floor:
            self.lag_floor = cutoff
            self._notify()
        lagging = sorted(r.sampler_id for r in self.registry.records() if r.alive and r.version < cutoff)
        if not lagging or self._resync_at >= self.trainer_version:
            return  # once per trainer version: the reports of one step come together
        self._resync_at = self.trainer_version
        self._emit("samplers lag behind what the trainer accepts", samplers=lagging, oldest_accepted=cutoff,
                   level="warning")
        if nursery is not None and self.latest is not None:
            self.resyncs += 1
            for listener in list(self._listeners):
                nursery.start_soon(listener, self.latest)

    def record_mismatch(self, msg: m.SamplerMismatch) -> None:
        """Keep the trainer's measurements of the samplers' tokens (`SamplerMismatch`):
        per sampler on its record (when it is registered), and per (backend, device kind,
        dtype) the token-weighted k3 KL of the samplers of that kind in this report."""
        self.mismatch_reports += 1
        kinds: dict[tuple[str, str, str], list[m.MismatchFigures]] = {}
        for ident, fig in msg.by_sampler:
            self.registry.record_sampler_mismatch(ident.sampler_id, fig, version=msg.version)
            kinds.setdefault((ident.backend, ident.device_kind, ident.dtype), []).append(fig)
        for (backend, device, dtype), figs in kinds.items():
            tokens = sum(f.tokens for f in figs)
            self.registry.report_mismatch(backend, device, dtype, sum(f.kl_k3 * f.tokens for f in figs) / tokens,
                                          version=msg.version)

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
        """The request's routing bounds: its own ``min_version``, raised to the pacer's
        floor (an attempt in flight was promised weights at least that new) and to the
        lag floor while some live sampler is that new."""
        floor = max(request.min_version, self.pacer.floor or 0)
        if self.lag_floor > floor:
            newest = max((r.version for r in self.registry.records() if r.alive), default=None)
            if newest is not None:
                floor = max(floor, min(self.lag_floor, newest))
        return Bounds(trainer_version=self.trainer_version, max_staleness=self.max_staleness,
                      min_version=floor, max_latency_s=self.max_latency_s)

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
        answer: m.Generation | m.GenerateFailed | None = None
        async with aclosing(self._serve(request, streamed=False)) as items:
            async for item in items:
                assert not isinstance(item, m.TokenChunk)
                answer = item
        assert answer is not None
        return answer

    def stream(self, request: m.GenerateRequest
               ) -> AsyncIterator[m.TokenChunk | m.Generation | m.GenerateFailed]:
        """`generate`, streamed: zero or more `TokenChunk`s as the sampler decodes the
        tokens, then the answer (a `Generation` whose ``token_ids`` the chunks add up
        to, or a `GenerateFailed`). The request goes out with ``stream=True``; a sampler
        that does not stream (an older remote, a backend without ``streams_tokens``)
        sends no chunks, only the answer.

        Same guarantees as `generate`, but a request whose tokens have begun to stream
        is not re-routed when its sampler is lost (another sampler would draw other
        tokens): it ends with a retryable `GenerateFailed`. Close the iterator to give
        the request up (``async with contextlib.aclosing(pool.stream(r)) as items``):
        the sampler drops it, the rest of its batch goes on."""
        if not request.stream:
            request = msgspec.structs.replace(request, stream=True)
        return self._serve(request, streamed=True)

    async def _serve(self, request: m.GenerateRequest, *, streamed: bool
                     ) -> AsyncIterator[m.TokenChunk | m.Generation | m.GenerateFailed]:
        """`generate` / `stream`: the chunks (when `streamed`), then the one answer.

        Each wait for the sampler runs in its own cancel scope with the request's
        deadline, registered in ``_inflight`` so that `mark_dead` cuts it; chunks are
        yielded outside those scopes (the caller's code runs at a ``yield``)."""
        problems: list[str] = []
        params = routed_params(request.params, self.max_support, whole_vocabulary=self.whole_vocabulary)
        if params is not request.params:
            request = msgspec.structs.replace(request, params=params)
        key = None
        if self.affinity is not None:
            key = prompt_key(request.prompt_ids.dtype, request.prompt_ids.data)
        while True:
            sid = await self._route(request, key)
            handle = self.handles[sid]
            record = self.registry.assign(sid)
            if key is not None and self.affinity is not None:
                self.affinity.routed(key, sid)  # no checkpoint since _route: the memory is current
            deadline = trio.current_time() + self.request_timeout_s
            t_start: float | None = None
            mark: float | None = None

            def started() -> None:
                nonlocal t_start, mark
                t_start = trio.current_time()
                mark = self.registry.started(sid, t_start, record=record)

            result: m.Generation | m.GenerateFailed | None = None
            lost: str | None = None
            cut = False  # our scope was cancelled: the deadline passed or the sampler was taken out
            sent = 0  # tokens handed to the caller
            items = _handle_items(handle, request, started, streamed)
            try:
                while result is None:
                    if self.handles.get(sid) is not handle:  # taken out while the caller held a chunk
                        cut = True
                        break
                    scopes = self._inflight[sid]
                    scope = trio.CancelScope(deadline=deadline)
                    scopes.add(scope)
                    try:
                        with scope:
                            item = await items.__anext__()
                    except SamplerLost as exc:
                        lost = str(exc)
                        break
                    except StopAsyncIteration:
                        lost = f"sampler {sid} ended the request without an answer"
                        break
                    finally:
                        scopes.discard(scope)
                    if scope.cancelled_caught:
                        cut = True
                        break
                    if isinstance(item, list):
                        if item:
                            sent += len(item)
                            yield m.TokenChunk(request_id=request.request_id, token_ids=item)
                    else:
                        result = item
            except BaseException:  # the caller gave up (cancelled, or closed the stream): the request is over here
                self.registry.ended(sid, trio.current_time(), ran=t_start is not None, mark=mark, record=record)
                self._notify()
                raise
            finally:
                with trio.CancelScope(shield=True):
                    await items.aclose()  # the sampler drops the request if it still holds it
                if key is not None and self.affinity is not None:
                    self.affinity.ended(key)
            now = trio.current_time()
            deadline_passed = False
            if cut:
                if sid in self.handles and self.handles[sid] is handle:  # not by mark_dead: the deadline passed
                    deadline_passed = True
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
                sampling = result.sampling or m.SamplingRecord.of(request.params, result.seed)  # an earlier release's
                yield msgspec.structs.replace(result, cost_usd=price / 3600.0 * busy_s, sampling=sampling)
                return
            if isinstance(result, m.GenerateFailed) and not result.retryable:
                self.failed += 1
                yield result
                return
            problems.append(f"{sid}: {lost if lost is not None else result.reason}")
            cause = restart_cause(result, lost, deadline_passed)
            by_cause = self.restarted.setdefault(sid, {})
            by_cause[cause] = by_cause.get(cause, 0) + 1
            if sent:
                tokens = self.discarded_tokens.setdefault(sid, {})
                tokens[cause] = tokens.get(cause, 0) + sent
                self.failed += 1
                yield m.GenerateFailed(request_id=request.request_id, retryable=True,
                                       reason=f"{problems[-1]} (after streaming {sent} tokens; a stream is "
                                              "not resumed on another sampler)")
                return
            self.rerouted += 1
            self._emit("request re-routed", request=request.request_id, sampler=sid, why=problems[-1])
            if len(problems) >= self.max_tries:
                self.failed += 1
                yield m.GenerateFailed(request_id=request.request_id, retryable=True,
                                       reason=f"failed on {len(problems)} samplers: " + "; ".join(problems))
                return

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


def _handle_items(handle: SamplerHandle, request: m.GenerateRequest, started: Callable[[], None],
                  streamed: bool) -> AsyncIterator[list[int] | m.Generation | m.GenerateFailed]:
    """What `handle` sends back for `request`: its ``stream`` (chunks of token ids, then
    the answer) when `streamed` and it has one, else its ``generate``'s answer alone."""
    return stream_or_once(getattr(handle, "stream", None) if streamed else None, handle.generate, request, started)

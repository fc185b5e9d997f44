"""The warm pool: idle, reset containers per (image, limits), ready to lease.

    async with open_sandbox_pool(ownership) as pool:
        async with pool.lease(image="fleetrl-sandbox:py311") as sb:
            result = await sb.exec(["python3", "-c", "print(1)"])

A lease takes an idle container (or starts one, or waits for one being reset when the
pool is at ``max_containers``). On release the container is reset in the background
(every process killed; work dir, /tmp, /dev/shm, /dev/mqueue wiped) and goes back to the idle set, or is
removed when the reset fails, it was marked dirty, the lease body raised or was
cancelled, or the key already has its warm target of containers
(``warm.DemandTracker``: recent peak of concurrent leases times 1 + headroom).

Shutdown contract: leaving ``open_sandbox_pool`` cancels background starts and resets
and removes every container the pool still owns (shielded, each within
``REMOVE_DEADLINE_S``); leases still held by other tasks remove their own container
when they end. Containers that cannot be removed keep their ownership labels and are
left for the sweep.
"""

from __future__ import annotations

import math
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio
from prometheus_client import CollectorRegistry

from .errors import PoolClosedError, SandboxError
from .image import DEFAULT_IMAGE
from .limits import DEFAULT_LIMITS, Limits
from .metrics import PoolStatistics, SandboxMetrics
from .sandbox import Sandbox
from .start import start_sandbox
from .sweep import Ownership
from .transport import Engine
from .warm import DemandTracker, WarmPolicy

__all__ = ["SandboxPool", "open_sandbox_pool", "PoolClosedError"]


START_BACKOFF_S = 10.0
"""After a background start fails, no background starts for this key for this long."""


class _Slot:
    """Per (image, limits) state."""

    def __init__(self, policy: WarmPolicy) -> None:
        self.idle: deque[Sandbox] = deque()
        self.leased = 0
        self.starting = 0  # background starts in flight
        self.resetting = 0
        self.waiters = 0
        self.demand = DemandTracker(policy)
        self.last_error: SandboxError | None = None  # of the latest failed background start
        self.last_error_at = -math.inf  # trio time of it: background starts pause for a while


class SandboxPool:
    """See the module docstring. Create with ``open_sandbox_pool``."""

    def __init__(
        self,
        nursery: trio.Nursery,
        engine: Engine,
        ownership: Ownership,
        *,
        policy: WarmPolicy,
        metrics: SandboxMetrics,
    ) -> None:
        self._nursery = nursery
        self.engine = engine
        self.ownership = ownership
        self.policy = policy
        self.metrics = metrics
        self._slots: dict[tuple[str, Limits], _Slot] = {}
        self._total = 0  # containers owned: idle + leased + starting + resetting
        self._closing = False
        self._changed = trio.lowlevel.ParkingLot()  # woken whenever a container frees up or idles

    # -- public -------------------------------------------------------------------------
    def statistics(self) -> PoolStatistics:
        self._publish_sizes()
        return self.metrics.snapshot()

    @asynccontextmanager
    async def lease(self, image: str = DEFAULT_IMAGE, limits: Limits = DEFAULT_LIMITS) -> AsyncIterator[Sandbox]:
        """Hold one sandbox for the body of the ``async with``."""
        if not isinstance(limits, Limits):
            raise TypeError(f"SandboxPool.lease: limits must be a Limits, not {type(limits).__name__}")
        if not isinstance(image, str) or not image:
            raise ValueError(f"SandboxPool.lease: image {image!r} must be a non-empty image name")
        key = (image, limits)
        slot = self._slot(key)
        t0 = time.monotonic()
        sb = await self._acquire(key, slot)
        self.metrics.on_lease(time.monotonic() - t0)
        try:
            yield sb
        except BaseException:
            sb.mark_dirty()  # an error or cancellation inside the lease: never reuse
            raise
        finally:
            slot.leased -= 1
            slot.demand.record(trio.current_time(), slot.leased)
            self.metrics.on_release()
            await self._release(key, slot, sb)

    async def prewarm(self, image: str = DEFAULT_IMAGE, limits: Limits = DEFAULT_LIMITS, n: int | None = None) -> None:
        """Start containers until ``n`` (default ``min_warm``) are idle for this key; the
        demand window then remembers ``n`` as if that many leases had been held."""
        key = (image, limits)
        slot = self._slot(key)
        want = self.policy.min_warm if n is None else min(n, self.policy.max_warm)
        peak = math.ceil(want / (1.0 + self.policy.headroom))  # so that target_warm >= want
        slot.demand.record(trio.current_time(), max(peak, slot.leased))
        slot.demand.record(trio.current_time(), slot.leased)
        slot.last_error, slot.last_error_at = None, -math.inf
        self._refill(key, slot)
        while len(slot.idle) < want:
            if slot.last_error is not None:
                raise slot.last_error
            if slot.starting == 0 and not self._refill(key, slot):
                break  # at max_containers
            slot.waiters += 1
            try:
                await self._changed.park()
            finally:
                slot.waiters -= 1

    # -- internals ------------------------------------------------------------------------
    def _slot(self, key: tuple[str, Limits]) -> _Slot:
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = _Slot(self.policy)
        return slot

    def _publish_sizes(self) -> None:
        self.metrics.set_sizes(idle=sum(len(s.idle) for s in self._slots.values()), containers=self._total)

    async def _acquire(self, key: tuple[str, Limits], slot: _Slot) -> Sandbox:
        if self._closing:
            raise PoolClosedError("sandbox pool is closed")
        slot.leased += 1
        slot.demand.record(trio.current_time(), slot.leased)
        ok = False
        try:
            while True:
                if slot.idle:
                    sb = slot.idle.popleft()
                    break
                pending = slot.resetting + slot.starting
                if pending <= slot.waiters and self._total < self.policy.max_containers:
                    # Nothing on its way for us: start one here.
                    self._total += 1
                    try:
                        sb = await start_sandbox(
                            self.engine, image=key[0], limits=key[1], ownership=self.ownership, metrics=self.metrics
                        )
                    except BaseException:
                        self._total -= 1
                        raise
                    break
                slot.waiters += 1
                try:
                    await self._changed.park()
                finally:
                    slot.waiters -= 1
                if self._closing:
                    raise PoolClosedError("sandbox pool closed while waiting for a lease")
            ok = True
        finally:
            if not ok:
                slot.leased -= 1
        self._refill(key, slot)
        self._publish_sizes()
        return sb

    async def _release(self, key: tuple[str, Limits], slot: _Slot, sb: Sandbox) -> None:
        if sb.dirty or sb.closed or self._closing:
            await self._discard(sb)
            self._changed.unpark_all()
            return
        if sb.clean:  # its final exec already reset it: no engine round trip needed
            if self._keep(slot, extra=0):
                slot.idle.append(sb)
                self._publish_sizes()
                self._changed.unpark_all()
            else:
                await self._discard(sb)
                self._changed.unpark_all()
            return
        slot.resetting += 1
        self._nursery.start_soon(self._recycle, key, slot, sb)

    async def _recycle(self, key: tuple[str, Limits], slot: _Slot, sb: Sandbox) -> None:
        placed = False
        try:
            ok = await sb.reset()
            if not ok:
                self.metrics.on_reset_failed()
            elif self._keep(slot, extra=1):  # 1: this one still counts as resetting
                slot.idle.append(sb)
                placed = True
        finally:
            slot.resetting -= 1
            if not placed:
                await self._discard(sb)
            self._publish_sizes()
            self._changed.unpark_all()

    async def _discard(self, sb: Sandbox) -> None:
        try:
            await sb.aclose()  # shielded, with a deadline
        except Exception:
            pass  # removal failed: the labels leave it to the sweep
        finally:
            self._total -= 1
            self.metrics.on_discarded()
            self._publish_sizes()

    def _keep(self, slot: _Slot, *, extra: int) -> bool:
        """Should a released, clean container go back to idle (else it is removed)?"""
        if self._closing:
            return False
        return slot.waiters > 0 or self._warm(slot) - extra < slot.demand.target_warm(trio.current_time())

    @staticmethod
    def _warm(slot: _Slot) -> int:
        """Containers of this key: idle, leased, starting, being reset."""
        return len(slot.idle) + slot.leased + slot.starting + slot.resetting

    def _refill(self, key: tuple[str, Limits], slot: _Slot) -> bool:
        """Start background containers up to the idle target; False when at capacity."""
        if self._closing:
            return False
        target = slot.demand.target_warm(trio.current_time())
        while slot.idle and self._warm(slot) > target:  # demand fell: shed the longest-idle surplus
            self._nursery.start_soon(self._discard, slot.idle.popleft())
        deficit = target - self._warm(slot)
        if trio.current_time() - slot.last_error_at < START_BACKOFF_S:
            deficit = 0  # the image or engine just failed a start: leases report it, no retry storm
        started = False
        while deficit > 0 and slot.starting < self.policy.max_starting and self._total < self.policy.max_containers:
            self._total += 1
            slot.starting += 1
            deficit -= 1
            started = True
            self._nursery.start_soon(self._start_one, key, slot)
        return started or slot.starting > 0

    async def _start_one(self, key: tuple[str, Limits], slot: _Slot) -> None:
        sb: Sandbox | None = None
        try:
            sb = await start_sandbox(
                self.engine, image=key[0], limits=key[1], ownership=self.ownership, metrics=self.metrics
            )
        except SandboxError as e:
            slot.last_error = e  # a lease that needs one starts its own and reports the error
            slot.last_error_at = trio.current_time()
        finally:
            slot.starting -= 1
            if sb is None:
                self._total -= 1
            elif self._closing:
                await self._discard(sb)
            else:
                slot.idle.append(sb)
            self._publish_sizes()
            self._changed.unpark_all()

    async def _maintain(self) -> None:
        """Trim and refill every key now and then, so targets follow decaying demand."""
        period = min(5.0, self.policy.window_s / 4)
        while True:
            await trio.sleep(period)
            for key, slot in list(self._slots.items()):
                self._refill(key, slot)
            self._publish_sizes()

    async def _close(self) -> None:
        self._closing = True
        self._changed.unpark_all()
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as n:
                for slot in self._slots.values():
                    while slot.idle:
                        n.start_soon(self._discard, slot.idle.popleft())


@asynccontextmanager
async def open_sandbox_pool(
    ownership: Ownership,
    *,
    engine: Engine | None = None,
    policy: WarmPolicy = WarmPolicy(),
    metrics: SandboxMetrics | None = None,
    registry: CollectorRegistry | None = None,
) -> AsyncIterator[SandboxPool]:
    """Open a warm pool; on exit every container it still owns is removed.

    ``registry``: a prometheus_client registry to register the pool's metrics on
    (default: none); ignored when ``metrics`` is given.
    """
    engine = engine or Engine()
    metrics = metrics or SandboxMetrics(registry)
    async with trio.open_nursery() as nursery:
        pool = SandboxPool(nursery, engine, ownership, policy=policy, metrics=metrics)
        nursery.start_soon(pool._maintain)
        try:
            yield pool
        finally:
            nursery.cancel_scope.cancel()
            await pool._close()

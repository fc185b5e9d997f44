"""Sandbox metrics: plain counters for ``statistics()`` and, optionally, Prometheus
metrics registered on a registry the caller passes (sandboxes never pick a global one,
so they do not depend on the daemon and two pools in one process do not collide).
"""

from __future__ import annotations

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["SandboxMetrics", "PoolStatistics", "EXEC_BUCKETS"]

EXEC_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class PoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of a pool's counters (totals since the pool opened)."""

    leases: int
    """Leases handed out."""
    leases_active: int
    """Leases held right now."""
    idle: int
    """Idle, reset containers ready for a lease (all keys)."""
    containers: int
    """Containers the pool owns right now (idle + leased + being reset or started)."""
    created: int
    """Containers started."""
    discarded: int
    """Containers removed (reset failed, marked dirty, surplus, or pool closed)."""
    resets_failed: int
    execs: int
    timeouts: int
    oom_kills: int
    sweeps: int
    swept: int
    """Containers removed by sweeps."""
    lease_wait_p50_s: float
    """Median time from asking for a lease to holding a container (recent leases)."""
    lease_wait_p99_s: float


class SandboxMetrics:
    """Counters shared by a pool, its sandboxes and sweeps. Not thread-safe: update from
    the Trio thread only."""

    def __init__(self, registry: CollectorRegistry | None = None, *, namespace: str = "fleetrl_sandbox") -> None:
        self.leases = 0
        self.leases_active = 0
        self.created = 0
        self.discarded = 0
        self.resets_failed = 0
        self.execs = 0
        self.timeouts = 0
        self.oom_kills = 0
        self.sweeps = 0
        self.swept = 0
        self.idle = 0
        self.containers = 0
        self._lease_waits: list[float] = []
        self._prom = None
        if registry is not None:
            ns = namespace
            self._prom = dict(
                leases=Counter(f"{ns}_leases", "Sandbox leases handed out", registry=registry),
                active=Gauge(f"{ns}_leases_active", "Sandbox leases held now", registry=registry),
                idle=Gauge(f"{ns}_pool_idle", "Idle warm sandbox containers", registry=registry),
                containers=Gauge(f"{ns}_pool_containers", "Sandbox containers owned by the pool", registry=registry),
                created=Counter(f"{ns}_containers_created", "Sandbox containers started", registry=registry),
                discarded=Counter(f"{ns}_containers_discarded", "Sandbox containers removed", registry=registry),
                exec_seconds=Histogram(
                    f"{ns}_exec_seconds", "Wall time of one exec in a sandbox", buckets=EXEC_BUCKETS, registry=registry
                ),
                lease_wait=Histogram(
                    f"{ns}_lease_wait_seconds", "Time to obtain a sandbox lease", buckets=EXEC_BUCKETS, registry=registry
                ),
                timeouts=Counter(f"{ns}_exec_timeouts", "Execs killed at their wall-clock timeout", registry=registry),
                oom=Counter(f"{ns}_oom_kills", "Processes killed by the OOM killer in sandboxes", registry=registry),
                sweeps=Counter(f"{ns}_sweeps", "Orphan sweeps run", registry=registry),
                swept=Counter(f"{ns}_swept_containers", "Orphan containers removed by sweeps", registry=registry),
            )

    # -- events ------------------------------------------------------------------
    def on_lease(self, wait_s: float) -> None:
        self.leases += 1
        self.leases_active += 1
        self._lease_waits.append(wait_s)
        if len(self._lease_waits) > 4096:
            del self._lease_waits[:2048]
        if self._prom:
            self._prom["leases"].inc()
            self._prom["active"].set(self.leases_active)
            self._prom["lease_wait"].observe(wait_s)

    def on_release(self) -> None:
        self.leases_active -= 1
        if self._prom:
            self._prom["active"].set(self.leases_active)

    def on_exec(self, seconds: float, *, timed_out: bool, oom_killed: bool) -> None:
        self.execs += 1
        self.timeouts += timed_out
        self.oom_kills += oom_killed
        if self._prom:
            self._prom["exec_seconds"].observe(seconds)
            if timed_out:
                self._prom["timeouts"].inc()
            if oom_killed:
                self._prom["oom"].inc()

    def on_created(self) -> None:
        self.created += 1
        if self._prom:
            self._prom["created"].inc()

    def on_discarded(self) -> None:
        self.discarded += 1
        if self._prom:
            self._prom["discarded"].inc()

    def on_reset_failed(self) -> None:
        self.resets_failed += 1

    def on_sweep(self, removed: int) -> None:
        self.sweeps += 1
        self.swept += removed
        if self._prom:
            self._prom["sweeps"].inc()
            self._prom["swept"].inc(removed)

    def set_sizes(self, *, idle: int, containers: int) -> None:
        self.idle, self.containers = idle, containers
        if self._prom:
            self._prom["idle"].set(idle)
            self._prom["containers"].set(containers)

    # -- snapshot ----------------------------------------------------------------
    def lease_wait_quantile(self, q: float) -> float:
        waits = sorted(self._lease_waits[-1024:])
        if not waits:
            return 0.0
        return waits[min(len(waits) - 1, int(q * len(waits)))]

    def snapshot(self) -> PoolStatistics:
        return PoolStatistics(
            leases=self.leases,
            leases_active=self.leases_active,
            idle=self.idle,
            containers=self.containers,
            created=self.created,
            discarded=self.discarded,
            resets_failed=self.resets_failed,
            execs=self.execs,
            timeouts=self.timeouts,
            oom_kills=self.oom_kills,
            sweeps=self.sweeps,
            swept=self.swept,
            lease_wait_p50_s=self.lease_wait_quantile(0.5),
            lease_wait_p99_s=self.lease_wait_quantile(0.99),
        )

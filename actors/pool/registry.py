"""Sampler records: who is in the fleet, what it serves, what it costs (pure bookkeeping).

One `SamplerRecord` per sampler (local or remote): identity (backend, device kind,
dtype), price per hour, capacity, the weight version and digest it serves, requests
assigned to it, health, and measurements: tokens generated, *busy* seconds (wall time
with at least one request running, which is what a rented device is paid for while it
works), mean request latency. From those: tokens/s and dollars per 1k generated tokens.

Each request is charged its share of the busy time: while ``n`` requests run on a
sampler, each second is split equally among them, so a request's busy seconds are the
integral of ``1/n`` over the time it ran, and the requests' shares add up to the
sampler's busy time. `started` returns a mark; `ended` turns it into the request's
busy seconds (the pool prices them into `Generation.cost_usd`).
The trainer reports the measured mismatch of each sampler's tokens after every step
(`MismatchFigures`: k3 KL against its own log-probs, out-of-band fraction, log-ratio
spread): the registry keeps the latest figures of each sampler on its record
(`record_sampler_mismatch`) and the latest k3 KL per (backend, device kind, dtype)
(`report_mismatch`, which the pool's ``fleetrl_sampler_mismatch_kl`` gauge reads).

Time is passed in (``now``), so the bookkeeping is testable without a clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import msgspec

from fleetrl.daemon.messages import MismatchFigures, SamplerIdentity

from .routing import SamplerView
from .errors import UnknownSampler

__all__ = ["Registry", "SamplerRecord", "SamplerRow", "UnknownSampler", "sampler_rows"]



@dataclass
class SamplerRecord:
    identity: SamplerIdentity
    price_per_hour: float
    capacity: int
    remote: bool
    version: int = 0
    digest: str = ""
    alive: bool = True
    assigned: int = 0
    running: int = 0
    last_seen: float = 0.0
    tokens: int = 0
    requests: int = 0
    failures: int = 0
    busy_s: float = 0.0
    latency_total_s: float = 0.0
    mismatch: MismatchFigures | None = None
    """The trainer's latest measurement of this sampler's tokens (None: none yet)."""
    mismatch_version: int = -1
    """The trainer's version after the step that measured ``mismatch``."""
    _busy_since: float | None = field(default=None, repr=False)
    _share: float = field(default=0.0, repr=False)
    """Integral of 1 / running over busy time so far (seconds per running request)."""
    _share_at: float = field(default=0.0, repr=False)

    @property
    def sampler_id(self) -> str:
        return self.identity.sampler_id

    @property
    def mismatch_key(self) -> tuple[str, str, str]:
        return (self.identity.backend, self.identity.device_kind, self.identity.dtype)

    def tokens_per_s(self, now: float | None) -> float | None:
        busy = self.busy_total(now)
        return self.tokens / busy if self.tokens and busy > 0 else None

    def busy_total(self, now: float | None) -> float:
        """Busy seconds so far (`now` None: up to the last finished request)."""
        running = now - self._busy_since if now is not None and self._busy_since is not None else 0.0
        return self.busy_s + running

    def usd_per_token(self, now: float | None) -> float | None:
        """Price of the busy time divided by the tokens generated in it."""
        if not self.tokens:
            return None
        return self.price_per_hour / 3600.0 * self.busy_total(now) / self.tokens

    def usd_per_1k_tokens(self, now: float | None) -> float | None:
        cost = self.usd_per_token(now)
        return None if cost is None else cost * 1000.0

    def latency_s(self) -> float | None:
        return self.latency_total_s / self.requests if self.requests else None

    def _advance_share(self, now: float) -> float:
        if self.running > 0:
            self._share += (now - self._share_at) / self.running
        self._share_at = now
        return self._share


class Registry:
    """The fleet's records, keyed by sampler id."""

    def __init__(self) -> None:
        self._records: dict[str, SamplerRecord] = {}
        self.mismatch_kl: dict[tuple[str, str, str], float] = {}
        self._mismatch_at: dict[tuple[str, str, str], int] = {}  # the version of each figure

    def add(self, identity: SamplerIdentity, *, price_per_hour: float, capacity: int, remote: bool,
            version: int = 0, digest: str = "", now: float = 0.0) -> SamplerRecord:
        """Register (or re-register, e.g. a restarted local sampler) a sampler."""
        if price_per_hour < 0:
            raise ValueError(f"sampler {identity.sampler_id!r}: price_per_hour must be >= 0, got {price_per_hour}")
        if capacity < 1:
            raise ValueError(f"sampler {identity.sampler_id!r}: capacity must be >= 1, got {capacity}")
        rec = SamplerRecord(identity=identity, price_per_hour=price_per_hour, capacity=capacity,
                            remote=remote, version=version, digest=digest, last_seen=now)
        self._records[identity.sampler_id] = rec
        return rec

    def get(self, sampler_id: str) -> SamplerRecord:
        try:
            return self._records[sampler_id]
        except KeyError:
            raise UnknownSampler(sampler_id) from None

    def remove(self, sampler_id: str) -> None:
        self._records.pop(sampler_id, None)

    def __contains__(self, sampler_id: str) -> bool:
        return sampler_id in self._records

    def records(self) -> list[SamplerRecord]:
        return list(self._records.values())

    def mark_dead(self, sampler_id: str) -> None:
        if sampler_id in self._records:
            self._records[sampler_id].alive = False

    def set_version(self, sampler_id: str, version: int, digest: str, now: float) -> None:
        rec = self.get(sampler_id)
        rec.version, rec.digest, rec.last_seen = version, digest, now

    def seen(self, sampler_id: str, now: float) -> None:
        self.get(sampler_id).last_seen = now

    # -- request accounting ---------------------------------------------------------
    def assign(self, sampler_id: str) -> SamplerRecord:
        """A request is assigned to the sampler; returns its registration, to hand to
        `started` and `ended` as ``record``."""
        rec = self.get(sampler_id)
        rec.assigned += 1
        return rec

    def _current(self, sampler_id: str, record: SamplerRecord | None) -> SamplerRecord | None:
        """The sampler's record, or None when it is gone or when ``record`` (the one a
        request was assigned under) has since been replaced by a new registration (a
        restarted sampler under the same id): that request's accounting died with the
        old record and must not touch the new one."""
        rec = self._records.get(sampler_id)
        if rec is None or (record is not None and rec is not record):
            return None
        return rec

    def started(self, sampler_id: str, now: float, *, record: SamplerRecord | None = None) -> float:
        """A request begins running; returns its mark for `ended` (0.0 for a request of
        a replaced registration, which is not counted)."""
        rec = self._current(sampler_id, record) if record is not None else self.get(sampler_id)
        if rec is None:
            return 0.0
        mark = rec._advance_share(now)
        if rec.running == 0:
            rec._busy_since = now
        rec.running += 1
        return mark

    def ended(self, sampler_id: str, now: float, *, ran: bool, tokens: int = 0,
              latency_s: float | None = None, failed: bool = False, mark: float | None = None,
              record: SamplerRecord | None = None) -> float:
        """A request assigned to the sampler is over (`ran`: it had been started, and
        `mark` is what `started` returned; ``record``: what `assign` returned). Returns
        the busy seconds charged to it (0.0, and nothing counted, when the sampler is
        gone or was registered again since the request was assigned)."""
        rec = self._current(sampler_id, record)
        if rec is None:
            return 0.0
        rec.assigned -= 1
        charged = 0.0
        if ran:
            share = rec._advance_share(now)
            if mark is not None:
                charged = max(share - mark, 0.0)
            rec.running -= 1
            if rec.running == 0 and rec._busy_since is not None:
                rec.busy_s += now - rec._busy_since
                rec._busy_since = None
        if failed:
            rec.failures += 1
        elif latency_s is not None:
            rec.tokens += tokens
            rec.requests += 1
            rec.latency_total_s += latency_s
            rec.last_seen = now
        return charged

    def report_mismatch(self, backend: str, device_kind: str, dtype: str, kl: float, *,
                        version: int | None = None) -> None:
        """The trainer's measured k3 KL between this kind of sampler and itself (after
        the step that ended at ``version``: a figure older than the one kept is ignored)."""
        if not kl >= 0:
            raise ValueError(f"mismatch KL must be >= 0, got {kl} for ({backend}, {device_kind}, {dtype})")
        key = (backend, device_kind, dtype)
        if version is not None:
            if version < self._mismatch_at.get(key, -1):
                return
            self._mismatch_at[key] = version
        self.mismatch_kl[key] = kl

    def record_sampler_mismatch(self, sampler_id: str, figures: MismatchFigures, *, version: int) -> bool:
        """The trainer's measurement of a sampler's tokens in the step that ended at
        ``version``; kept on its record unless a newer one is there.
        False when the sampler is not registered (it left; its figures go nowhere)."""
        rec = self._records.get(sampler_id)
        if rec is None:
            return False
        if version >= rec.mismatch_version:
            rec.mismatch, rec.mismatch_version = figures, version
        return True

    # -- routing snapshot -------------------------------------------------------------
    def views(self, now: float) -> list[SamplerView]:
        return [SamplerView(sampler_id=r.sampler_id, alive=r.alive, version=r.version,
                            assigned=r.assigned, capacity=r.capacity,
                            usd_per_token=r.usd_per_token(now), latency_s=r.latency_s())
                for r in self._records.values()]

    def oldest_live_version(self) -> int | None:
        live = [r.version for r in self._records.values() if r.alive]
        return min(live) if live else None


class SamplerRow(msgspec.Struct, frozen=True, kw_only=True):
    """One sampler as /status shows it (the pool's statistics: ``samplers``)."""

    sampler: str
    backend: str
    device: str
    dtype: str
    remote: bool
    version: int
    lag: int
    """The trainer's version minus the sampler's."""
    queue: int
    """Requests assigned and not answered."""
    capacity: int
    tokens: int
    failures: int
    health: str
    """``up`` while live, else ``down``."""
    tokens_per_s: float | None = None
    """Generated tokens per busy second (None: nothing generated yet)."""
    usd_per_1k_tokens: float | None = None
    mismatch_kl: float | None = None
    """The trainer's latest k3 KL of this sampler's tokens (None: none measured yet)."""


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


def sampler_rows(records: list[SamplerRecord], trainer_version: int, now: float | None) -> tuple[SamplerRow, ...]:
    """The `records` as rows, by sampler id; `now` (Trio time) for the rates (None: up to
    the last finished request)."""
    return tuple(SamplerRow(
        sampler=r.sampler_id, backend=r.identity.backend, device=r.identity.device_kind, dtype=r.identity.dtype,
        remote=r.remote, version=r.version, lag=trainer_version - r.version, queue=r.assigned, capacity=r.capacity,
        tokens=r.tokens, failures=r.failures, health="up" if r.alive else "down",
        tokens_per_s=_finite(r.tokens_per_s(now)), usd_per_1k_tokens=_finite(r.usd_per_1k_tokens(now)),
        mismatch_kl=_finite(r.mismatch.kl_k3) if r.mismatch is not None else None,
    ) for r in sorted(records, key=lambda r: r.sampler_id))

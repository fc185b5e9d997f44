"""The sampler pool's per-sampler Prometheus series: `PoolMetrics`, read from its
registry at scrape time, and `SwitchPauses`, the pauses version switches cost each
sampler (fed by `local.WeightSync`'s ``on_switch``)."""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from .core import SamplerPool
from .local import VersionSwitch

__all__ = ["SWITCH_BUCKETS", "PauseStats", "PoolMetrics", "SwitchPauses"]

SWITCH_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                     10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the version-switch pause histogram: an incremental update of
a few tensors takes milliseconds, a full load of a large model tens of seconds."""


class PoolMetrics(Collector):
    """Per-sampler Prometheus metrics, read from the registry at scrape time."""

    def __init__(self, pool: SamplerPool, actor: str) -> None:
        self.pool = pool
        self.actor = actor

    def describe(self) -> Iterable[Any]:
        return []  # names are checked at scrape time, so a restarted actor can re-register

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
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
        restarted = CounterMetricFamily("fleetrl_sampler_requests_restarted",
                                        "requests a sampler did not answer, routed again or failed, by cause "
                                        "(weight_version: it held older weights than the request needed)",
                                        labels=["actor", "sampler", "cause"])
        discarded = CounterMetricFamily("fleetrl_sampler_tokens_discarded",
                                        "tokens those requests had streamed before they were given up, by cause",
                                        labels=["actor", "sampler", "cause"])
        for into, table in ((restarted, self.pool.restarted), (discarded, self.pool.discarded_tokens)):
            for sid, by_cause in sorted(table.items()):
                for cause, n in sorted(by_cause.items()):
                    into.add_metric([self.actor, sid, cause], float(n))
        yield restarted
        yield discarded


class PauseStats(msgspec.Struct, frozen=True, kw_only=True):
    """The version switches of one sampler, backend, dtype and kind (full load or update)."""

    count: int
    seconds: float
    """Their total pause."""
    max_s: float
    tensors: int
    """Tensors handed over in all of them."""
    bucket_counts: tuple[int, ...]
    """Switches per bucket of `SwitchPauses.buckets` (not cumulative), the last one for
    pauses above every bound."""


class SwitchPauses(Collector):
    """Version-switch pauses per sampler and backend, as a Prometheus histogram
    ``fleetrl_sampler_switch_pause_seconds`` and a counter
    ``fleetrl_sampler_switch_tensors_total`` (labels actor, sampler, backend, dtype and
    load = ``full`` or ``update``). `observer` gives a `WeightSync` ``on_switch``."""

    def __init__(self, actor: str, buckets: Sequence[float] = SWITCH_BUCKETS) -> None:
        bounds = tuple(float(b) for b in buckets)
        if not bounds or any(not math.isfinite(b) or b <= 0 for b in bounds) or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"SwitchPauses buckets must be finite, positive and increasing, got {buckets!r}")
        self.actor = actor
        self.buckets = bounds
        self._lock = threading.Lock()  # recorded in the Trio thread, scraped from another
        self._series: dict[tuple[str, str, str, str], list[Any]] = {}  # [counts, seconds, max, tensors]

    def record(self, sampler_id: str, switch: VersionSwitch) -> None:
        """Count one switch of sampler `sampler_id`."""
        if not math.isfinite(switch.seconds) or switch.seconds < 0:
            raise ValueError(f"SwitchPauses.record: sampler {sampler_id} reported a pause of {switch.seconds} s")
        key = (sampler_id, switch.backend, switch.dtype, "full" if switch.full else "update")
        with self._lock:
            s = self._series.setdefault(key, [[0] * (len(self.buckets) + 1), 0.0, 0.0, 0])
            s[0][bisect.bisect_left(self.buckets, switch.seconds)] += 1
            s[1] += switch.seconds
            s[2] = max(s[2], switch.seconds)
            s[3] += switch.tensors

    def observer(self, sampler_id: str) -> Callable[[VersionSwitch], None]:
        """An ``on_switch`` for the `WeightSync` of sampler `sampler_id`."""
        return lambda switch: self.record(sampler_id, switch)

    def stats(self) -> dict[tuple[str, str, str, str], PauseStats]:
        """Per (sampler, backend, dtype, load): the switches so far."""
        with self._lock:
            return {k: PauseStats(count=sum(c), seconds=total, max_s=top, tensors=n, bucket_counts=tuple(c))
                    for k, (c, total, top, n) in self._series.items()}

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterable[HistogramMetricFamily | CounterMetricFamily]:
        labels = ["actor", "sampler", "backend", "dtype", "load"]
        hist = HistogramMetricFamily("fleetrl_sampler_switch_pause_seconds",
                                     "seconds a version switch held the sampler's backend", labels=labels)
        tensors = CounterMetricFamily("fleetrl_sampler_switch_tensors",
                                      "tensors handed to the sampler's backend at version switches", labels=labels)
        names = [repr(b) for b in self.buckets] + ["+Inf"]
        for key, st in sorted(self.stats().items()):
            lv = [self.actor, *key]
            cumulative, total = [], 0
            for name, count in zip(names, st.bucket_counts):
                total += count
                cumulative.append((name, float(total)))
            hist.add_metric(lv, cumulative, st.seconds)
            tensors.add_metric(lv, float(st.tensors))
        yield hist
        yield tensors

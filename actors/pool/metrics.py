"""The sampler pool's per-sampler Prometheus series, read from its registry at scrape time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import trio
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .core import SamplerPool

__all__ = ["PoolMetrics"]


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

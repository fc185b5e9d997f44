"""Prometheus metrics of one daemon: its own registry, get-or-create helpers.

Each daemon has a private `CollectorRegistry` (so several daemons, or tests, in one
process never collide); /metrics renders it in the text exposition format. Actors
create metrics through `ActorMetrics`, which adds an ``actor`` label and returns the
same child again when an actor restarts and asks for the same metric.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from .handles import numeric_fields

__all__ = ["ActorMetrics", "KernelMetrics", "MetricsRegistry"]

PREFIX = "fleetrl_"


class MetricsRegistry:
    """Get-or-create access to one `CollectorRegistry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._metrics: dict[str, tuple[Any, type, tuple[str, ...]]] = {}
        self._lock = threading.Lock()

    def _get(self, kind: type, name: str, doc: str, labelnames: tuple[str, ...],
             **kw: Any) -> Any:
        full = name if name.startswith(PREFIX) else PREFIX + name
        with self._lock:
            existing = self._metrics.get(full)
            if existing is not None:
                metric, have_kind, have_labels = existing
                if have_kind is not kind or have_labels != labelnames:
                    raise ValueError(
                        f"metric {full!r} already exists as {have_kind.__name__} with "
                        f"labels {have_labels}; asked for {kind.__name__} {labelnames}")
                return metric
            metric = kind(full, doc, labelnames=labelnames, registry=self.registry, **kw)
            self._metrics[full] = (metric, kind, labelnames)
            return metric

    def counter(self, name: str, doc: str, labelnames: Iterable[str] = ()) -> Counter:
        return self._get(Counter, name, doc, tuple(labelnames))

    def gauge(self, name: str, doc: str, labelnames: Iterable[str] = ()) -> Gauge:
        return self._get(Gauge, name, doc, tuple(labelnames))

    def histogram(self, name: str, doc: str, labelnames: Iterable[str] = (),
                  buckets: Iterable[float] | None = None) -> Histogram:
        kw = {"buckets": tuple(buckets)} if buckets is not None else {}
        return self._get(Histogram, name, doc, tuple(labelnames), **kw)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class ActorMetrics:
    """An actor's view: every metric carries ``actor=<name>`` plus fixed `labels`."""

    def __init__(self, registry: MetricsRegistry, actor: str) -> None:
        self._registry = registry
        self.actor = actor

    @property
    def registry(self) -> CollectorRegistry:
        """The daemon's raw registry, for code that registers its own metrics or
        collectors (names must be unique per daemon; prefer the helpers below)."""
        return self._registry.registry

    def _child(self, make: Callable[..., Any], name: str, doc: str,
               labels: Mapping[str, str], **kw: Any) -> Any:
        keys = tuple(sorted(labels))
        metric = make(name, doc, ("actor", *keys), **kw)
        return metric.labels(actor=self.actor, **{k: str(labels[k]) for k in keys})

    def counter(self, name: str, doc: str, labels: Mapping[str, str] = {}) -> Any:
        return self._child(self._registry.counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Mapping[str, str] = {}) -> Any:
        return self._child(self._registry.gauge, name, doc, labels)

    def histogram(self, name: str, doc: str, labels: Mapping[str, str] = {},
                  buckets: Iterable[float] | None = None) -> Any:
        return self._child(self._registry.histogram, name, doc, labels, buckets=buckets)


class _InboxCollector(Collector):
    """Reads inbox depth/capacity at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, stats: Callable[[], Mapping[str, tuple[int, int]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[GaugeMetricFamily]:
        depth = GaugeMetricFamily(PREFIX + "inbox_messages", "Messages waiting in an actor's inbox",
                                  labels=["actor"])
        cap = GaugeMetricFamily(PREFIX + "inbox_capacity", "Capacity of an actor's inbox",
                                labels=["actor"])
        for actor, (used, size) in sorted(self._stats().items()):
            depth.add_metric([actor], used)
            cap.add_metric([actor], size)
        yield depth
        yield cap


class _StatisticsCollector(Collector):
    """Every running actor's ``statistics()`` record, read at scrape time: one gauge
    sample per numeric field (`fleetrl.daemon.handles`)."""

    def __init__(self, stats: Callable[[], Mapping[str, Mapping[str, Any]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[GaugeMetricFamily]:
        fam = GaugeMetricFamily(PREFIX + "actor_statistic",
                                "A numeric field of an actor's statistics() record",
                                labels=["actor", "name"])
        for actor, record in sorted(self._stats().items()):
            for key, value in numeric_fields(record):
                fam.add_metric([actor, key], value)
        yield fam


class KernelMetrics:
    """The supervisor's own metrics."""

    def __init__(self, reg: MetricsRegistry, *, uptime: Callable[[], float],
                 inbox_stats: Callable[[], Mapping[str, tuple[int, int]]],
                 statistics: Callable[[], Mapping[str, Mapping[str, Any]]] | None = None) -> None:
        self.restarts = reg.counter("actor_restarts_total", "Actor restarts after a crash",
                                    ["actor"])
        self.up = reg.gauge("actor_up", "1 while the actor is running", ["actor"])
        self.paused = reg.gauge("paused", "1 while the daemon is paused")
        self.draining = reg.gauge("draining", "1 once shutdown has begun")
        self.checkpoints = reg.counter("checkpoints_written_total", "Checkpoints written")
        self.checkpoint_errors = reg.counter(
            "checkpoint_hook_errors_total", "Checkpoint hooks that raised or timed out",
            ["actor"])
        self.checkpoint_seconds = reg.histogram(
            "checkpoint_seconds", "Time to collect and write one checkpoint",
            buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 30))
        uptime_g = reg.gauge("uptime_seconds", "Seconds since the daemon started")
        uptime_g.set_function(uptime)
        reg.add_collector(_InboxCollector(inbox_stats))
        if statistics is not None:
            reg.add_collector(_StatisticsCollector(statistics))

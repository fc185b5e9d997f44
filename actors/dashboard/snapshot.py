"""What the dashboard shows, computed from the daemon's own records (pure).

`Series` keeps the charted figures of the trainer's metrics rows (a bounded window);
`eval_points` the held-out pass@1 with its interval per split; `fleet_of` the samplers
as /status reports them; `workers_of` the environment workers and their sandboxes;
`event_of` picks the log lines worth showing (restarts, failures, requeues, lost
samplers, retokenization breaks, warnings). `snapshot` puts them together with the
/status body into the one JSON object every page receives.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["CHARTS", "ENV_WORKER_FACTORIES", "EVENT_NAMES", "Series", "eval_points", "event_of", "fleet_of",
           "snapshot", "workers_of"]

CHARTS = ("reward_mean", "pass_rate", "grad_norm", "mismatch_kl_k3", "staleness_mean", "delta_ratio",
          "usd_per_rollout", "loss")
"""The trainer's figures charted, one point per step (``staleness_mean``: of the step's
``staleness_hist``; every other is the metrics.jsonl field of that name)."""

EVENT_NAMES = frozenset({
    "actor crashed", "actor restarted", "actor escalated", "sampler lost", "sampler process exited",
    "restarting sampler process", "request re-routed", "task requeued", "worker left", "group incomplete: "
    "too many failed attempts", "attempt failed", "checkpoint written", "shutdown requested", "report written",
})
"""Log events shown besides every warning and error."""

ENV_WORKER_FACTORIES = frozenset({"fleetrl.actors.envworker:run", "fleetrl.actors.envworker.actor:run"})
"""The environment worker actor: listed in the workers table even while it reports no
row (starting, restarting, failed), with its state as health."""


def _finite(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def staleness_mean(hist: Any) -> float | None:
    """Mean staleness of a ``staleness_hist`` (``{"0": 5, "2": 3}``), None if empty."""
    if not isinstance(hist, Mapping):
        return None
    total = weight = 0.0
    for k, n in hist.items():
        try:
            total += int(k) * float(n)
            weight += float(n)
        except (TypeError, ValueError):
            return None
    return total / weight if weight else None


class Series:
    """The charted figures of the last `points` steps (and KL per sampler kind)."""

    def __init__(self, points: int) -> None:
        self.steps: deque[int] = deque(maxlen=points)
        self.values: dict[str, deque[float | None]] = {k: deque(maxlen=points) for k in CHARTS}
        self.kl_by_sampler: dict[str, deque[float | None]] = {}
        self.points = points
        self.last: dict[str, Any] = {}

    def add(self, row: Mapping[str, Any]) -> None:
        step = row.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or (self.steps and step <= self.steps[-1]):
            return
        self.steps.append(step)
        for k in CHARTS:
            v = staleness_mean(row.get("staleness_hist")) if k == "staleness_mean" else _finite(row.get(k))
            self.values[k].append(v)
        kl = row.get("mismatch_kl_by_sampler")
        kl = kl if isinstance(kl, Mapping) else {}
        for kind in set(kl) | set(self.kl_by_sampler):
            q = self.kl_by_sampler.setdefault(kind, deque([None] * (len(self.steps) - 1), maxlen=self.points))
            q.append(_finite(kl.get(kind)))
        self.last = {k: row.get(k) for k in ("step", "version", "skipped", "tokens_per_s", "groups", "cost_usd")}

    def as_json(self, since: int | None = None) -> dict[str, Any]:
        """Every kept point; with ``since`` (a step), only the points after it (a page
        that holds the earlier ones appends them and keeps the last ``points``)."""
        n = len(self.steps) if since is None else sum(1 for s in self.steps if s > since)

        def tail(q: deque) -> list:
            return list(q)[len(q) - n:] if n else []
        return {"steps": tail(self.steps), **{k: tail(v) for k, v in self.values.items()},
                "kl_by_sampler": {k: tail(v) for k, v in sorted(self.kl_by_sampler.items())}, "last": self.last,
                "points": self.points}


def eval_points(rows: Iterable[Mapping[str, Any]]) -> dict[str, list[dict[str, float]]]:
    """Held-out pass@1 per split: ``{split: [{version, pass_at_1, ci_low, ci_high}, ...]}``
    in version order (a version evaluated again: its latest line)."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for r in rows:
        split, version = r.get("split"), r.get("version")
        p, lo, hi = (_finite(r.get(k)) for k in ("pass_at_1", "ci_low", "ci_high"))
        if not isinstance(split, str) or not isinstance(version, int) or None in (p, lo, hi):
            continue
        out.setdefault(split, {})[version] = {"version": version, "pass_at_1": p, "ci_low": lo, "ci_high": hi}
    return {s: [v[k] for k in sorted(v)] for s, v in sorted(out.items())}


def fleet_of(status: Mapping[str, Any], pool: str | None) -> list[dict[str, Any]]:
    """The samplers of the pool actor `pool` as /status reports them (its statistics'
    ``samplers``: `actors.pool.registry.SamplerRow`); none without a pool."""
    stats = ((status.get("actors") or {}).get(pool) or {}).get("statistics") if pool else None
    rows = stats.get("samplers") if isinstance(stats, Mapping) else None
    return [dict(r) for r in rows if isinstance(r, Mapping)] if isinstance(rows, (list, tuple)) else []


def workers_of(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per environment worker, as /status reports them: the ``worker_rows`` of
    every actor's statistics (`actors.envworker.fleet_row.WorkerRow`: an environment
    worker actor's one row, the remote workers actor's one per worker), each with its
    ``actor``. A worker of the daemon whose actor is not running has that state as its
    health; an environment worker actor with no row (not started, restarting) gets a row
    of its name and state alone."""
    out: list[dict[str, Any]] = []
    for name, a in (status.get("actors") or {}).items():
        if not isinstance(a, Mapping):
            continue
        stats, state = a.get("statistics"), a.get("state")
        rows = stats.get("worker_rows") if isinstance(stats, Mapping) else None
        rows = [r for r in rows if isinstance(r, Mapping)] if isinstance(rows, (list, tuple)) else []
        for r in rows:
            row = {"actor": name, **r}
            if not r.get("remote") and state not in (None, "running"):
                row["health"] = state
            out.append(row)
        if not rows and a.get("factory") in ENV_WORKER_FACTORIES:
            out.append({"actor": name, "worker": name, "host": "", "remote": False, "address": "",
                        "attempts_running": None, "groups_running": None, "groups": {}, "failures": {},
                        "sandboxes_warm": None, "sandboxes_leased": None, "sandboxes_limit": None,
                        "health": state or "unknown", "last_seen_s": None, "ended": None})
    return out


def event_of(line: Mapping[str, Any]) -> dict[str, Any] | None:
    """A log line worth showing as an event (see `EVENT_NAMES`), trimmed; else None."""
    event, level = line.get("event"), line.get("level")
    if not isinstance(event, str) or not (level in ("warning", "error", "critical") or event in EVENT_NAMES):
        return None
    keep = {k: v for k, v in line.items() if k not in ("event", "level", "timestamp", "run_id")
            and isinstance(v, (str, int, float, bool)) and len(str(v)) <= 300}
    return {"time": line.get("timestamp"), "level": level, "event": event, "actor": keep.pop("actor", None),
            "detail": keep}


def snapshot(status: Mapping[str, Any], series: Series, evals: Mapping[str, Any], fleet: list[dict[str, Any]],
             events: Iterable[Mapping[str, Any]], *, seq: int) -> dict[str, Any]:
    """The JSON object sent to every page at each refresh (the stream's ``tick`` is the
    same with the series of `Series.as_json` ``since`` the last step sent)."""
    actors = status.get("actors") or {}
    return {
        "seq": seq,
        "run": {k: status.get(k) for k in ("run_id", "phase", "paused", "draining", "uptime_s", "checkpoint")},
        "actors": {name: {"state": a.get("state"), "restarts": a.get("restarts"), "last_error": a.get("last_error"),
                          "versions": a.get("versions"), "statistics": a.get("statistics")}
                   for name, a in actors.items()},
        "series": series.as_json(),
        "evals": evals,
        "fleet": fleet,
        "workers": workers_of(status),
        "events": list(events),
    }

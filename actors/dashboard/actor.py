"""The dashboard actor (``fleetrl.actors.dashboard:run``): a live view of the run in the
browser, served by the daemon at ``prefix`` (``/ui``).

Every ``refresh_s`` it reads what was appended to the trainer's metrics, the evaluator's
held-out results and the daemon's log, asks the kernel for ``/status`` (which holds the
sampler pool's samplers), and publishes one snapshot (`snapshot.snapshot`) that every open
page receives by server-sent events: the work is done once per refresh however many
pages are open. The routes are in `app`; logging in takes the daemon's control token
once, in a form's body, and gives a session cookie (`sessions`).

It starts without waiting for anyone (``after`` is not needed: the page shows the
warm-up and the start of each actor) and stays through the shutdown, showing the final
evaluation, until every other actor has ended. It reads no messages.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from typing import Any, Never

import msgspec
import trio

from fleetrl.actors.tracker.tail import read_new_rows
from fleetrl.daemon.actor import ActorContext

from .app import Feed, dashboard_app
from .config import DashboardConfig
from .rollouts import RolloutSource
from .sessions import Sessions
from .snapshot import Series, eval_points, event_of, fleet_of, snapshot

__all__ = ["DashboardHandle", "DashboardStatistics", "Inbox", "run"]

Inbox = Never
"""The dashboard takes no messages."""

_ENDED = ("finished", "failed", "cancelled")


class DashboardStatistics(msgspec.Struct, frozen=True, kw_only=True):
    snapshots: int
    """Snapshots published."""
    pages: int
    """Event streams open now."""
    refresh_ms: float
    """How long the last refresh took."""


class DashboardHandle:
    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.refresh_ms = 0.0

    def statistics(self) -> DashboardStatistics:
        return DashboardStatistics(snapshots=self.feed.seq, pages=self.feed.streams,
                                   refresh_ms=round(self.refresh_ms, 3))


class _Files:
    """The JSONL files the dashboard follows, each with its read offset."""

    def __init__(self, cfg: DashboardConfig, root: Path, points: int) -> None:
        self.paths = {"metrics": root / cfg.metrics, "evals": root / cfg.evals, "log": root / cfg.log}
        self.offsets = dict.fromkeys(self.paths, 0)
        self.series = Series(points)
        self.eval_rows: list[dict[str, Any]] = []
        self.events: deque[dict[str, Any]] = deque(maxlen=cfg.events)

    def read(self) -> None:  # in a worker thread
        for name, path in self.paths.items():
            rows, self.offsets[name], _problems = read_new_rows(path, self.offsets[name])
            for row in rows:
                if name == "metrics":
                    self.series.add(row)
                elif name == "evals":
                    self.eval_rows.append(row)
                else:
                    event = event_of(row)
                    if event is not None:
                        self.events.append(event)


def _may_log_in(ctx: ActorContext) -> Any:
    """Only the daemon's control token (role admin) opens the dashboard."""
    store = ctx.credentials

    def may(token: str) -> bool:
        cred = store.identify(token) if store is not None else None
        return cred is not None and cred.role == "admin"
    return may


async def run(cfg: DashboardConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[DashboardHandle] = trio.TASK_STATUS_IGNORED) -> None:
    """The dashboard actor (see the module docstring)."""
    feed = Feed()
    handle = DashboardHandle(feed)
    files = _Files(cfg, ctx.daemon_dir, cfg.points)
    sessions = Sessions(cfg.session_hours * 3600.0, time.monotonic)
    rollouts = RolloutSource(ctx.daemon_dir / cfg.rollouts, cfg.tokenizer_dir)
    ctx.mount(cfg.prefix, dashboard_app(feed, sessions, _may_log_in(ctx), rollouts), auth=False)

    def others_ended(status: dict[str, Any]) -> bool:
        return all(a.get("state") in _ENDED for name, a in (status.get("actors") or {}).items() if name != ctx.name)

    ctx.log.info("dashboard serving", path=f"{cfg.prefix}/")
    sent_up_to = -1  # the last step of the series already published
    task_status.started(handle)
    while True:
        t0 = time.perf_counter()
        await trio.to_thread.run_sync(files.read)
        status = ctx.daemon_status()
        snap = snapshot(status, files.series, eval_points(files.eval_rows), fleet_of(status, cfg.pool),
                        reversed(files.events), seq=feed.seq + 1)
        # the tick: the same snapshot with only the series' steps after those already sent
        tick = None if feed.seq == 0 else {**snap, "series": files.series.as_json(since=sent_up_to)}
        feed.publish(msgspec.json.encode(snap), None if tick is None else msgspec.json.encode(tick))
        sent_up_to = files.series.steps[-1] if files.series.steps else -1
        handle.refresh_ms = (time.perf_counter() - t0) * 1e3
        if ctx.draining and others_ended(status):
            break
        await trio.sleep(cfg.refresh_s)
    ctx.log.info("dashboard stopped", snapshots=feed.seq)

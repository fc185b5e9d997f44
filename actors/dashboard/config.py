"""Settings of the dashboard actor (``[actors.NAME.config]``; docs/guides/dashboard.md)."""

from __future__ import annotations

from typing import Annotated

import msgspec

__all__ = ["DashboardConfig"]


class DashboardConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prefix: Annotated[str, msgspec.Meta(pattern=r"^/[A-Za-z0-9_-]+$")] = "/ui"
    """Where the dashboard is served on the control plane."""
    refresh_s: Annotated[float, msgspec.Meta(ge=0.1, le=60.0)] = 1.0
    """How often the figures are recomputed and pushed to every open page."""
    points: Annotated[int, msgspec.Meta(ge=10, le=100_000)] = 2000
    """Steps kept in the charts (the latest)."""
    events: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 100
    """Recent events kept."""
    pool: str | None = "pool"
    """The sampler pool actor whose samplers (in its /status statistics) the fleet table
    lists (None, or no such actor: an empty table)."""
    metrics: str = "actors/trainer/metrics.jsonl"
    evals: str = "actors/evaluator/eval.jsonl"
    rollouts: str = "actors/trainer/rollouts"
    """The trainer's rollout log (its ``rollout_log`` setting), read by the rollout browser."""
    tokenizer_dir: str | None = None
    """The model's tokenizer, to show the rollout browser's tokens as text (None: as ids)."""
    log: str = "logs/daemon.jsonl"
    """The daemon's log (JSON lines), read for the events list."""
    session_hours: Annotated[float, msgspec.Meta(gt=0.0, le=24 * 30)] = 12.0
    """How long a log-in lasts."""

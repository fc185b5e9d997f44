"""Settings of the experiment tracker actor (``[actors.NAME.config]``; docs/guides/trackers.md)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

__all__ = ["TrackerConfig"]


class TrackerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    tracker: Literal["wandb", "trackio"]
    """``wandb`` (Weights & Biases; ``mode = "offline"`` needs no network or account) or
    ``trackio`` (local-first, the same API, a SQLite file per project)."""
    project: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] = "fleetrl"
    name: str | None = None
    """The run's name in the tracker (default: the daemon's run id)."""
    mode: Literal["offline", "online"] = "offline"
    """W&B only: ``online`` syncs as it logs (needs ``WANDB_API_KEY``); ``offline`` writes
    the run directory for a later ``wandb sync``."""
    dir: str = "tracker"
    """Where the tracker writes (relative to the daemon's state directory): W&B's
    ``wandb/`` run directories, trackio's project database."""
    metrics: str = "actors/trainer/metrics.jsonl"
    """The step scalars to follow (relative to the state directory): one row per step."""
    evals: str = "actors/evaluator/eval.jsonl"
    """The held-out evaluations to follow (relative to the state directory; the
    evaluator's ``eval.jsonl``): one line per version and split, logged as
    ``eval/<split>/<field>``. A file that does not exist is nothing to log."""
    report_dir: str | None = None
    """The run's report (the evaluator's ``report_dir``): its plots are logged as images
    once its ``index.html`` is written at the end of the run."""
    report_wait_s: Annotated[float, msgspec.Meta(ge=0.0, le=86_400.0)] = 900.0
    """At shutdown, how long to wait for that report (the final evaluation runs first)."""
    poll_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 1.0

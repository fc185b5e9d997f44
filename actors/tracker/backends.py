"""The experiment trackers the tracker actor writes to, behind one small interface
(``log(step, scalars)``, ``images(step, paths)``, ``finish()``; blocking: call them in a
worker thread). Both are imported only when chosen (optional dependencies: the
``trackers`` extra)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from .config import TrackerConfig

__all__ = ["TrackioRun", "WandbRun", "open_tracker"]


class WandbRun:
    """A Weights & Biases run (``mode`` offline or online) under ``<dir>/wandb``; the run
    id is the daemon's, so a restarted daemon resumes the same run."""

    def __init__(self, cfg: TrackerConfig, where: Path, run_id: str, name: str, config: dict[str, Any]) -> None:
        import wandb

        self._wandb = wandb
        where.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, dir=str(where), mode=cfg.mode, id=run_id, resume="allow",
                              name=name, config=config,
                              settings=wandb.Settings(console="off", silent=True, x_disable_stats=True))
        self.where = Path(self.run.dir).parent  # the run's own directory (offline-run-..., run-...)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def images(self, step: int, paths: list[Path]) -> None:
        self.run.log({f"report/{p.stem}": self._wandb.Image(str(p)) for p in paths}, step=step)

    def finish(self) -> None:
        self.run.finish()


class TrackioRun:
    """A trackio run; its project database lives in `where` (``TRACKIO_DIR``, which
    trackio reads once, when it is first imported in the process)."""

    def __init__(self, cfg: TrackerConfig, where: Path, run_id: str, name: str, config: dict[str, Any]) -> None:
        where.mkdir(parents=True, exist_ok=True)
        if "trackio" not in sys.modules:
            os.environ["TRACKIO_DIR"] = str(where)
        import trackio
        from trackio import utils

        if Path(utils.TRACKIO_DIR).resolve() != where.resolve():
            raise ValueError(f"trackio was loaded in this process with TRACKIO_DIR={utils.TRACKIO_DIR}, not {where}: "
                             "one trackio directory per process")
        self._trackio = trackio
        self.where = where
        self.run = trackio.init(project=cfg.project, name=name, config=config, resume="allow", embed=False,
                                auto_log_cpu=False, auto_log_gpu=False)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def images(self, step: int, paths: list[Path]) -> None:
        self.run.log({f"report/{p.stem}": self._trackio.Image(str(p)) for p in paths}, step=step)

    def finish(self) -> None:
        self.run.finish()


def open_tracker(cfg: TrackerConfig, where: Path, run_id: str, name: str, config: dict[str, Any]) -> Any:
    """The chosen tracker's run (blocking: starts W&B's service process). A tracker that
    is not installed is a ValueError naming the extra to install."""
    kind = WandbRun if cfg.tracker == "wandb" else TrackioRun
    try:
        return kind(cfg, where, run_id, name, config)
    except ModuleNotFoundError as exc:
        raise ValueError(f"tracker = {cfg.tracker!r} needs the {exc.name} package: "
                         "pip install 'fleetrl[trackers]'") from None

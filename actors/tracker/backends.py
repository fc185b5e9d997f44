"""The experiment trackers the tracker actor writes to, behind one small interface
(``log(step, scalars)``, ``log_eval(evaluation)``, ``queued_evals()``,
``images(step, paths)``, ``finish()``; blocking: call them in a worker thread). Both are
imported only when chosen (optional dependencies: the ``trackers`` extra).

Where an evaluation goes: trackio takes a row at any step, so each evaluation is a row
of its own at its trainer step, beside that step's metrics row. W&B drops a row logged at
a step below its current one (an evaluation of step s finishes after the trainer has
logged later steps), so its evaluations are plotted against their own x-axis
(``define_metric("eval/*", step_metric="eval/step")``) and ride in the rows the run
logs anyway: each joins the newest row, one evaluation (one version, each split once)
per row; one that finds that row taken waits for the next row (`queued_evals`), and
those still waiting at ``finish`` get rows of their own after the last one.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from pathlib import Path
from typing import Any

from .config import TrackerConfig
from .scalars import EVAL_STEP, Evaluation

__all__ = ["EvalRows", "TrackioRun", "WandbRun", "open_tracker"]


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
        self.run.define_metric(EVAL_STEP)
        self.run.define_metric("eval/*", step_metric=EVAL_STEP)
        self._evals = EvalRows()
        self._first = self.run.step
        """The step of the run's next row (a resumed run: after its last one); W&B drops a
        row below it, so no evaluation joins such a row."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._log_row(step, dict(scalars))

    def log_eval(self, evaluation: Evaluation) -> None:
        row = self._evals.add(evaluation)
        if row:
            self.run.log(row, step=self._evals.step)

    def queued_evals(self) -> int:
        return len(self._evals.queue)

    def images(self, step: int, paths: list[Path]) -> None:
        self._log_row(step, {f"report/{p.stem}": self._wandb.Image(str(p)) for p in paths})

    def finish(self) -> None:
        while self._evals.queue:
            self._log_row(self._first if self._evals.step is None else self._evals.step + 1, {})
        self.run.finish()

    def _log_row(self, step: int, row: dict[str, Any]) -> None:
        self.run.log(row if step < self._first else self._evals.new_row(step, row), step=step)


class EvalRows:
    """Which W&B row each evaluation joins (pure; see the module docstring): the newest
    row, if it holds no other evaluation (an evaluation: one version, each split once);
    else it waits in `queue` for the next row."""

    def __init__(self) -> None:
        self.step: int | None = None
        """The W&B step of the newest row (still open: a row logged at the same step joins it)."""
        self.queue: deque[Evaluation] = deque()
        """Evaluations that wait for a row, oldest first."""
        self._holds: tuple[int, int] | None = None
        """(version, step) of the evaluation in the newest row."""
        self._splits: set[str] = set()

    def new_row(self, step: int, row: dict[str, Any]) -> dict[str, Any]:
        """`row`, the next row (at `step`), with the waiting evaluations that fit it."""
        self.step, self._holds, self._splits = step, None, set()
        return self._take(row)

    def add(self, evaluation: Evaluation) -> dict[str, Any]:
        """Queue `evaluation`; what to log now at `step` (empty: it waits for a row)."""
        self.queue.append(evaluation)
        return {} if self.step is None else self._take({})

    def _take(self, row: dict[str, Any]) -> dict[str, Any]:
        while self.queue:
            ev = self.queue[0]
            if self._holds not in (None, (ev.version, ev.step)) or ev.split in self._splits:
                break
            row.update(ev.scalars)
            self._holds = (ev.version, ev.step)
            self._splits.add(ev.split)
            self.queue.popleft()
        return row


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

    def log_eval(self, evaluation: Evaluation) -> None:
        self.run.log(evaluation.scalars, step=evaluation.step)

    def queued_evals(self) -> int:
        return 0

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

"""The experiment tracker actor (``fleetrl.actors.tracker:run``): the run's step scalars,
live, in W&B or trackio, and the report's plots at the end.

It follows ``metrics`` (the trainer's metrics.jsonl) and logs each new row's scalars at
its ``step`` under the names the file uses (`scalars.scalars_of`), every ``poll_s``; and
it follows ``evals`` (the evaluator's eval.jsonl) and logs each new evaluation as
``eval/<split>/<field>`` against its trainer step (`scalars.eval_scalars_of`; where that
step lies in each tracker: `backends`). Its checkpoint is the byte offset logged so far
in each file, so a restart neither skips nor repeats a row or an evaluation (an
evaluation W&B still holds back, `queued_evals`, is not counted as logged). At shutdown
it reads the rest; with ``report_dir`` it waits (at most ``report_wait_s``) for the
report that the evaluator writes after its final evaluation, logs its plots as images
(``report/<plot>``), and finishes the tracker's run. It reads no messages.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from pathlib import Path
from typing import Never

import msgspec
import trio

from fleetrl.daemon.actor import ActorContext

from .backends import open_tracker
from .config import TrackerConfig
from .scalars import STEP, Evaluation, eval_scalars_of, scalars_of
from .tail import read_new_lines, read_new_rows

__all__ = ["Inbox", "TrackerHandle", "TrackerState", "TrackerStatistics", "run"]

Inbox = Never
"""The tracker takes no messages."""

REPORT_PAGE = "index.html"


class TrackerState(msgspec.Struct, frozen=True, kw_only=True):
    """The checkpointed cursors: bytes of ``metrics`` and of ``evals`` already logged (a
    checkpoint written before evaluations were logged holds only ``offset``)."""

    offset: int = 0
    eval_offset: int = 0


class TrackerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    """Rows logged by this incarnation."""
    last_step: int | None
    skipped_rows: int
    """Lines that were not JSON objects, or had no integer ``step``."""
    evals: int
    """Evaluations (eval.jsonl lines) handed to the tracker by this incarnation."""
    queued_evals: int
    """Of those, the ones W&B holds back until its next row."""
    skipped_evals: int
    """eval.jsonl lines that were not JSON objects, or not evaluations."""
    images: int


class TrackerHandle:
    def __init__(self, where: Path) -> None:
        self.where = where
        self.rows = self.skipped = self.images = self.evals = self.eval_skipped = 0
        self.last_step: int | None = None
        self.offset = 0
        self.eval_offset = 0
        """Bytes of ``evals`` read (handed to the tracker or skipped)."""
        self.eval_queued: deque[int] = deque()
        """Where the lines of the evaluations the tracker still holds back start, oldest first."""

    def eval_logged_offset(self) -> int:
        """Bytes of ``evals`` logged: up to the first evaluation still held back."""
        return self.eval_queued[0] if self.eval_queued else self.eval_offset

    def statistics(self) -> TrackerStatistics:
        return TrackerStatistics(rows=self.rows, last_step=self.last_step, skipped_rows=self.skipped,
                                 evals=self.evals, queued_evals=len(self.eval_queued),
                                 skipped_evals=self.eval_skipped, images=self.images)


async def run(cfg: TrackerConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[TrackerHandle] = trio.TASK_STATUS_IGNORED) -> None:
    """The tracker actor (see the module docstring)."""
    metrics = ctx.daemon_dir / cfg.metrics
    evals = ctx.daemon_dir / cfg.evals
    where = ctx.daemon_dir / cfg.dir
    restored = ctx.restored_as(TrackerState) or TrackerState()
    handle = TrackerHandle(where)
    handle.offset = restored.offset
    handle.eval_offset = restored.eval_offset

    async def checkpoint() -> TrackerState:
        return TrackerState(offset=handle.offset, eval_offset=handle.eval_logged_offset())
    ctx.on_checkpoint(checkpoint)
    tracker = await trio.to_thread.run_sync(functools.partial(
        open_tracker, cfg, where, ctx.run_id, cfg.name or ctx.run_id,
        {"run_id": ctx.run_id, "metrics": str(metrics)}))
    ctx.log.info("tracker logging", tracker=cfg.tracker, where=str(getattr(tracker, "where", where)),
                 project=cfg.project, metrics=str(metrics), offset=handle.offset, evals=str(evals),
                 eval_offset=handle.eval_offset)
    task_status.started(handle)

    def note_queued() -> None:
        """Forget the held-back evaluations the tracker has logged since (oldest first)."""
        while len(handle.eval_queued) > tracker.queued_evals():
            handle.eval_queued.popleft()

    async def follow() -> None:
        rows, offset, problems = await trio.to_thread.run_sync(read_new_rows, metrics, handle.offset)
        lines, eval_offset, eval_problems = await trio.to_thread.run_sync(read_new_lines, evals, handle.eval_offset)
        for problem in problems:
            ctx.log.warning("metrics line skipped", problem=problem)
        handle.skipped += len(problems)
        logged = []
        for row in rows:
            step = row.get(STEP)
            if not isinstance(step, int) or isinstance(step, bool) or (
                    handle.last_step is not None and step <= handle.last_step):
                ctx.log.warning("metrics row skipped", why=f"step {step!r} is not an integer after "
                                                           f"{handle.last_step}", file=str(metrics))
                handle.skipped += 1
                continue
            logged.append((step, scalars_of(row)))
            handle.last_step = step
        for problem in eval_problems:
            ctx.log.warning("eval line skipped", problem=problem)
        handle.eval_skipped += len(eval_problems)
        evaluations: list[tuple[int, Evaluation]] = []
        for at, line in lines:
            evaluation = eval_scalars_of(line)
            if isinstance(evaluation, str):
                ctx.log.warning("eval line skipped", problem=f"{evals}: line at byte {at}: {evaluation}")
                handle.eval_skipped += 1
                continue
            evaluations.append((at, evaluation))
        if logged or evaluations:
            def log_all() -> None:
                for step, scalars in logged:
                    tracker.log(step, scalars)
                for at, evaluation in evaluations:
                    handle.eval_queued.append(at)
                    tracker.log_eval(evaluation)
                    handle.evals += 1
            await trio.to_thread.run_sync(log_all)
            handle.rows += len(logged)
        handle.offset = offset
        handle.eval_offset = eval_offset
        note_queued()

    try:
        while not ctx.draining:
            await follow()
            with trio.move_on_after(cfg.poll_s):
                await ctx.wait_draining()
        await follow()
        if cfg.report_dir is not None:
            await _log_report(cfg, ctx, tracker, handle, time.time())
            note_queued()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(tracker.finish)
        note_queued()
        ctx.log.info("tracker finished", rows=handle.rows, last_step=handle.last_step, evals=handle.evals,
                     images=handle.images)


async def _log_report(cfg: TrackerConfig, ctx: ActorContext, tracker: object, handle: TrackerHandle,
                      since: float) -> None:
    """Wait for the report written after `since` (unix time), then log its plots."""
    assert cfg.report_dir is not None
    report = ctx.daemon_dir / cfg.report_dir
    page = report / REPORT_PAGE
    with trio.move_on_after(cfg.report_wait_s):
        while not (page.exists() and page.stat().st_mtime >= since - 1.0):
            await trio.sleep(cfg.poll_s)
    if not page.exists():
        ctx.log.warning("report not logged: none was written", report=str(page), waited_s=cfg.report_wait_s)
        return
    plots = sorted(report.glob("*.png"))
    step = (handle.last_step or 0) + 1
    await trio.to_thread.run_sync(tracker.images, step, plots)  # type: ignore[attr-defined]
    handle.images += len(plots)
    ctx.log.info("report logged", plots=[p.name for p in plots], step=step)

"""The trainer actor: a thin Trio loop around `Trainer` (docs/reference/trainer.md).

Reads `RolloutGroup`s from its inbox, judges each with the rollout buffer (staleness,
zero variance, duplicates, malformed groups), trains whenever ``groups_per_step`` are
queued, publishes every new version into a `LocalDirStore` under its state directory
(served on the control plane at ``/weights``), reports its version, exports Prometheus
metrics, writes one JSON line of `StepMetrics` per step into ``metrics.jsonl``, and
checkpoints: the daemon's hook (periodic and final), plus its own file every
``checkpoint_every`` steps and when it ends; every ``daemon_checkpoint_every`` steps it
also asks the daemon for a checkpoint (``ctx.request_checkpoint``), so the daemon's
file, which holds every actor's state, is taken at step boundaries; at a step where both
are due the daemon's (it holds the same snapshot) replaces the trainer's own file, which
is written only if the daemon's fails. Each published version is announced
(`WeightVersionAvailable`) to the ``announce_to`` actors. After every step that measured
the samplers' tokens, the measured mismatch per sampler kind and per sampler
(`SamplerMismatch`, `mismatch_report`) goes to the ``stale_reports_to`` actor, the
sampler pool, with the stale-group reports: it feeds the pool's per-sampler mismatch
gauge. Neither report ever blocks the trainer: a full pool inbox drops the report (and
counts it). With ``max_steps`` or
``time_budget_s`` (wall-clock, checkpointed across restarts) and ``shutdown_when_done``
it asks the daemon to shut down once the first budget is spent.

Alarms: a step whose corrections mask more than the configured share of its tokens or
sequences, whose batch left out more than the configured share of its model calls
(greedy calls), or whose whole-vocabulary tokens left too much of the sampler's mass
outside their listing, raises an alarm (`alarms.step_alarms`): a ``correction alarm`` warning in
the log (so in the terminal and the dashboard's events), the counter
``trainer_alarms_total{alarm}``, the step's ``alarms`` in metrics.jsonl, and the counts
and latest alarm in /status. A step that masks every token halts the run
(``ctx.halt``: exit code 7) with the reason and the fix, since no later step would train.

Exactly-once: a group is marked trained in the same locked section as the step that
trains it, and the checkpoint holds the queued groups and the trained ids, so after a
crash a group is either still queued (and trained later) or recorded as trained (and a
re-sent copy is refused as a duplicate). The checkpoint hook first takes into the
buffer the group the loop has just received (if any) and every group waiting in the
inbox, so a group a producer has sent is never in neither snapshot (the kernel runs
producers' hooks before their consumers').
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import trio

from fleetrl.actors.buffer import Admitted, BadGroup, Duplicate, StaleGroup, ZeroVariance
from fleetrl.actors.weights.http import blob_app
from fleetrl.daemon.actor import ActorContext
from fleetrl.daemon.messages import RolloutFailed, RolloutGroup, WeightVersionAvailable

from .batch import BadBatch, check_group
from .config import TrainerConfig
from .core import Trainer
from .rank_engine import RankEngine
from .reporting import Progress, TrainerHandle, TrainerMetrics, TrainerStatistics, mismatch_report
from .step import StepMetrics

__all__ = ["Inbox", "TrainerHandle", "TrainerStatistics", "mismatch_report", "run"]

Inbox = RolloutGroup | RolloutFailed
"""What environment workers send the trainer: scored groups, and attempts that failed."""


async def run(cfg: TrainerConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[TrainerHandle] = trio.TASK_STATUS_IGNORED) -> None:
    """The trainer actor; see the module docstring."""
    def rank_restart(why: str) -> None:  # called from the worker thread that runs the step
        ctx.log.warning("trainer rank group restarting", reason=why)

    trainer = await ctx.run_blocking(partial(Trainer, cfg, ctx.state_dir, ctx.run_id, clock=ctx.clock,
                                             on_rank_restart=rank_restart))
    try:
        await ctx.run_blocking(trainer.start, ctx.restored)
    except BaseException:
        with trio.CancelScope(shield=True):
            await ctx.run_blocking(trainer.close)
        raise
    lock = trio.Lock()
    handle = TrainerHandle(trainer)
    metrics = TrainerMetrics(ctx, handle)

    def sender(name: str, key: str) -> trio.MemorySendChannel[Any]:
        try:
            return ctx.sender(name)
        except KeyError:
            raise ValueError(f"TrainerConfig.{key} = {name!r} names no configured actor") from None

    rejects = sender(cfg.stale_reports_to, "stale_reports_to") if cfg.stale_reports_to else None
    announce = [(name, sender(name, "announce_to")) for name in cfg.announce_to]
    pending: list[Any] = []  # received by the loop, not yet handled (the hook handles it first)

    async def hook() -> bytes:
        async with lock:
            handle_pending()
            while trainer.buffer.has_room:  # what producers sent is in this snapshot
                try:
                    pending.append(ctx.inbox.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
                handle_pending()
            return await ctx.run_blocking(trainer.snapshot)

    ctx.on_checkpoint(hook)
    # followers read weights with a sampler, worker or weights-read token (daemon/credentials.py)
    ctx.mount("/weights", blob_app(trainer.store), roles=("sampler", "worker", "weights-read"))
    ctx.report_version("version", trainer.version)
    ctx.report_version("step", trainer.step)
    metrics.version.set(trainer.version)
    metrics.step.set(trainer.step)
    ctx.log.info("trainer started", version=trainer.version, step=trainer.step,
                 resumed_from=trainer.resumed_from, queued=len(trainer.buffer))
    progress = Progress(cfg.progress, cfg.max_steps, trainer.step)
    task_status.started(handle)

    async def announce_version() -> None:
        if not announce or trainer.digest is None:
            return
        msg = WeightVersionAvailable(version=trainer.version, digest=trainer.digest,
                                     base=None, blobs=())
        for name, chan in announce:
            try:
                await chan.send(msg)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                ctx.log.info("version not announced: the actor is gone", to=name, version=msg.version)

    def report_mismatch(m: StepMetrics) -> None:
        if rejects is None:
            return
        msg = mismatch_report(m, cfg.corrections)
        if msg is None:
            return
        try:
            rejects.send_nowait(msg)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            metrics.mismatch_reports("undelivered")
            return
        metrics.mismatch_reports("sent")

    def report(rej: StaleGroup) -> None:
        metrics.group(rej.reason)
        trainer.note_no_gradient("stale")
        ctx.log.info("group rejected as stale", group_id=rej.group_id, task_id=rej.task_id,
                     staleness=rej.staleness, max_staleness=rej.max_staleness, reason=rej.reason)
        if rejects is not None:
            try:
                rejects.send_nowait(rej)
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                metrics.group("stale_report_undelivered")
                ctx.log.warning("stale-group report not delivered", group_id=rej.group_id,
                                to=cfg.stale_reports_to)

    def offer(group: RolloutGroup) -> None:
        trainer.task_cursor += 1
        trainer.note_received(group)
        try:
            check_group(group, trainer.vocab_size)
            outcome = trainer.buffer.offer(group, trainer.version)
        except (BadBatch, BadGroup) as exc:
            metrics.group("malformed")
            trainer.note_no_gradient("malformed")
            ctx.log.warning("malformed rollout group refused", group_id=group.group_id, error=str(exc))
            return
        if isinstance(outcome, Admitted):
            metrics.group("admitted")
            metrics.staleness.observe(outcome.staleness)
        elif isinstance(outcome, StaleGroup):
            report(outcome)
        elif isinstance(outcome, ZeroVariance):
            metrics.group("zero_variance")
            trainer.note_no_gradient("zero_variance")
        elif isinstance(outcome, Duplicate):
            metrics.group("duplicate")
            trainer.note_no_gradient("duplicate")
            ctx.log.info("duplicate rollout group refused", group_id=group.group_id,
                         already_trained=outcome.trained)
        metrics.queued.set(len(trainer.buffer))

    def handle_pending() -> None:
        while pending:
            match pending.pop(0):
                case RolloutGroup() as group:
                    offer(group)
                case RolloutFailed() as failed:
                    metrics.group("attempt_failed")
                    trainer.note_failed(failed)
                case other:
                    metrics.group("ignored")
                    ctx.log.warning("trainer ignored a message it does not handle", type=type(other).__name__)

    async def train_ready() -> None:
        while trainer.ready():
            await ctx.wait_unpaused()
            async with lock:
                m, expired = await ctx.run_blocking(trainer.take_and_train)
            for rej in expired:
                report(rej)
            if m is None:
                break
            for a in trainer.last_alarms:
                metrics.alarm(a)
                if a.fatal:
                    progress.close()
                    ctx.log.error("training halted", alarm=a.kind, step=a.step, reason=a.message, fix=a.fix)
                    ctx.halt(f"training halted at step {a.step}: {a.message}. Fix: {a.fix}")
                else:
                    ctx.log.warning("correction alarm", alarm=a.kind, step=a.step, value=round(a.value, 4),
                                    threshold=a.threshold, reason=a.message, fix=a.fix)
            metrics.observe(m)
            report_mismatch(m)
            metrics.version.set(trainer.version)
            metrics.step.set(trainer.step)
            metrics.queued.set(len(trainer.buffer))
            ctx.report_version("version", trainer.version)
            ctx.report_version("step", trainer.step)
            progress.step(m, trainer.time_left_s())
            if trainer.rollout_log_failure is not None:
                ctx.log.warning("could not write the rollout log", error=trainer.rollout_log_failure)
                trainer.rollout_log_failure = None
            ctx.log.info("train step", step=m.step, version=m.version, loss=m.loss,
                         reward_mean=m.reward_mean, pass_rate=m.pass_rate, skipped=m.skipped,
                         usd_per_rollout=m.usd_per_rollout)
            if not m.skipped:
                await announce_version()
                if trainer.daemon_checkpoint_due:
                    if not await checkpoint_daemon(f"step {trainer.step}") and \
                            trainer.step % cfg.checkpoint_every == 0:
                        async with lock:  # the trainer's own file, skipped for the daemon's
                            await ctx.run_blocking(trainer.write_checkpoint)

    async def checkpoint_daemon(reason: str) -> bool:
        try:
            await ctx.request_checkpoint(reason)
        except OSError as exc:  # disk full: keep training (the trainer's own file is tried)
            ctx.log.error("daemon checkpoint failed", error=f"{type(exc).__name__}: {exc}")
            return False
        return True

    async def watch_ranks(engine: RankEngine, interval_s: float) -> None:
        while True:
            await trio.sleep(interval_s)
            async with lock:
                await ctx.run_blocking(engine.check)

    finished = False

    async def main_loop() -> None:
        nonlocal finished
        while True:
            await train_ready()
            reason = trainer.stop_reason()
            if reason is not None and not finished:
                finished = True
                progress.close()
                async with lock:
                    await ctx.run_blocking(trainer.write_checkpoint)
                ctx.log.info("training budget spent", reason=reason, step=trainer.step, version=trainer.version,
                             max_steps=cfg.max_steps, time_budget_s=cfg.time_budget_s,
                             elapsed_s=round(trainer.elapsed_s, 1))
                if cfg.shutdown_when_done:
                    await checkpoint_daemon(f"training budget spent: {reason}")
                    ctx.request_shutdown(f"trainer: {reason}")
            if not trainer.buffer.has_room:
                # only when a budget is spent: hold the inbox (backpressure) until drained
                await ctx.wait_draining()
                break
            left = None if finished else trainer.time_left_s()
            with trio.move_on_after(math.inf if left is None else left + 0.01) as waited:
                try:
                    msg = await ctx.inbox.receive()
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    break
            if waited.cancelled_caught:  # the time budget ran out while nothing arrived
                continue
            pending.append(msg)
            async with lock:
                handle_pending()

    try:
        await announce_version()
        async with trio.open_nursery() as nursery:
            if isinstance(trainer.engine, RankEngine):
                assert cfg.ranks is not None
                nursery.start_soon(watch_ranks, trainer.engine, cfg.ranks.watch_interval_s)
            await main_loop()
            nursery.cancel_scope.cancel()
    finally:
        progress.close()
        with trio.CancelScope(shield=True):
            async with lock:
                try:
                    await ctx.run_blocking(trainer.write_checkpoint)
                finally:
                    await ctx.run_blocking(trainer.close)
        for chan in [rejects, *(c for _, c in announce)]:
            if chan is not None:
                chan.close()
        ctx.log.info("trainer stopped", version=trainer.version, step=trainer.step,
                     queued=len(trainer.buffer))

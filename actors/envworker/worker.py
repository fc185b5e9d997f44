"""The environment worker's task loop: tasks in, rollout groups (and typed failures) out.

`_Worker.run` takes task after task from its source and runs each task's G attempts
concurrently (at most ``max_concurrent_attempts`` over all groups; one attempt is
`attempt.AttemptRunner.run`). A failure becomes a `RolloutFailed` with its kind, sent
at once, counted in Prometheus, and retried by the `RetryPolicy`. When every slot of
the group has ended, the group (`group.GroupTracker`) is sent as one `RolloutGroup`, or
reported as incomplete. With pacing (``model.kind = "pool"``, ``pacing = true``) the
group's slots go through the pool's staleness pacer (`pacing.GroupPacing`).

Drain (shutdown): no new task is taken and no failed attempt is retried; a group still
waiting for the pacer's admission is abandoned at once (it has started nothing, and the
pacer would not admit it before the trainer steps again); attempts in flight may finish
for ``drain_grace_s``; then they are cancelled and each is reported as a ``timeout``
failure "abandoned at shutdown". A group with an abandoned attempt is
never emitted and its task is not marked finished, so the checkpointed cursor
(`cursor.CursorState`) keeps it due and the next start runs it again from scratch.
"""

from __future__ import annotations

import socket
from functools import partial
from typing import Any

import msgspec
import trio

from fleetrl.daemon.messages import RolloutFailed, Trajectory
from fleetrl.harness.protocol import Harness, sandbox_use_of
from fleetrl.harness.tasks import Task

from .atif_files import AtifFiles, atif_dir
from .attempt import AttemptRunner, Failed, sandbox_limits
from .config import EnvWorkerConfig, PoolModel
from .cursor import TaskCursor
from .fleet_row import WorkerRow, sandbox_counts
from .group import AttemptTicket, GroupResult, GroupTracker
from .pacing import GroupPacing, Paced
from .sandboxing import GroupScorer
from .score_batches import ScoreBatcher

__all__ = ["EnvWorkerStatistics", "group_id_of"]

_HOST = socket.gethostname()


def group_id_of(task_id: str, index: int, worker: str) -> str:
    """The id of the group of task number ``index`` run by worker ``worker``: the same
    on every run of that task, so a re-run after a crash or restart is a duplicate."""
    return f"{task_id}#{index}@{worker}"


class EnvWorkerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What an environment worker has done (its handle's ``statistics()``)."""

    tasks_taken: int
    groups: dict[str, int]
    """Groups that ended, by outcome (emitted, abandoned, incomplete)."""
    attempts: dict[str, int]
    """Attempts that ended, by outcome (scored, failed, retried)."""
    attempts_in_flight: int
    cursor_floor: int
    """Every task below this number is done."""
    worker_rows: tuple[WorkerRow, ...] = ()
    """This worker and its sandboxes, as one row (the dashboard's environment workers)."""


class _SlotHold:
    """One attempt slot of the semaphore, released at most once (early or at the end)."""

    def __init__(self, sem: trio.Semaphore) -> None:
        self._sem = sem
        self._held = False

    async def acquire(self) -> None:
        await self._sem.acquire()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._sem.release()


class _Metrics:
    """The worker's Prometheus series, and the counts its statistics report."""

    def __init__(self, metrics: Any) -> None:
        self._m = metrics
        self._in_flight = metrics.gauge("envworker_attempts_in_flight", "Attempts running now")
        self.running = 0
        self.attempts: dict[str, int] = {}
        self.groups: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.groups_running = 0

    def started(self) -> None:
        self.running += 1
        self._in_flight.inc()

    def ended(self) -> None:
        self.running -= 1
        self._in_flight.dec()

    def attempt(self, outcome: str) -> None:
        self.attempts[outcome] = self.attempts.get(outcome, 0) + 1
        self._m.counter("envworker_attempts_total", "Attempts that ended, by outcome",
                        {"outcome": outcome}).inc()

    def failure(self, reason: str, final: bool) -> None:
        self.failures[reason] = self.failures.get(reason, 0) + 1
        self._m.counter("envworker_attempt_failures_total", "Failed attempts, by reason and whether "
                        "the slot gave up (final) or was retried", {"reason": reason,
                                                                   "final": str(final).lower()}).inc()

    def group(self, outcome: str) -> None:
        self.groups[outcome] = self.groups.get(outcome, 0) + 1
        self._m.counter("envworker_groups_total", "Groups that ended, by outcome", {"outcome": outcome}).inc()

    def score_batch(self, groups: int) -> None:
        self._m.histogram("envworker_score_batch_groups", "Groups scored together in one lease and engine exec",
                          buckets=(1, 2, 4, 8, 16, 32, 64)).observe(groups)

    def breaks(self, trajectory: Trajectory) -> None:
        prefix = "retokenization_breaks/"
        for key, n in trajectory.metrics.items():
            if key.startswith(prefix) and n:
                self._m.counter("envworker_retokenization_breaks_total",
                                "Chat calls that did not extend the attempt's earlier calls token for token "
                                "(each starts a new segment), by cause", {"cause": key[len(prefix):]}).inc(n)

    def reward(self, value: float) -> None:
        self._m.histogram("envworker_reward", "Rewards of scored attempts",
                          buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)).observe(value)


class _Worker:
    """One incarnation's worker; also the actor's handle (`statistics`)."""

    def __init__(self, cfg: EnvWorkerConfig, ctx: Any, *, harness: Harness, model: Any, pool: Any,
                 out: Any, failures_out: Any, cursor: TaskCursor,
                 paced_by: tuple[Any, PoolModel] | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.log = ctx.log
        self.harness = harness
        self.model = model
        self.pool = pool
        self.out = out
        self.failures_out = failures_out
        self.cursor = cursor
        self.metrics = _Metrics(ctx.metrics)
        self.attempt_slots = trio.Semaphore(cfg.max_concurrent_attempts)
        self.scopes: set[trio.CancelScope] = set()
        self.abandoning = False
        self.sandbox_use = "eager" if harness is None else sandbox_use_of(harness)
        self.runner = AttemptRunner(cfg, harness, pool, self.sandbox_use)
        atif = cfg.atif_output()
        if atif is not None:
            self.runner.atif_files = AtifFiles(atif_dir(ctx.daemon_dir, ctx.name, atif), max_files=atif.max_files,
                                               log=self.log, support=atif.support)
        self.pacing = None
        if paced_by is not None:  # the pool (handle) and its setting: actor.pacing_of
            pacer_pool, setting = paced_by
            self.pacing = GroupPacing(pacer_pool, group_size=cfg.group_size,
                                      skips_zero_variance=setting.trainer_skips_zero_variance, scopes=self.scopes)
        b = cfg.score_batching
        self.score_batcher = (ScoreBatcher(pool, max_groups=b.max_groups, linger_s=b.linger_s, slots=b.slots,
                                           on_batch=self.metrics.score_batch)
                              if b.max_groups > 1 else None)
        self.tasks_taken = 0

    @property
    def awaiting(self) -> dict[str, Paced]:
        """Paced groups not yet released (empty without pacing)."""
        return {} if self.pacing is None else self.pacing.awaiting

    def statistics(self) -> EnvWorkerStatistics:
        return EnvWorkerStatistics(tasks_taken=self.tasks_taken, groups=dict(self.metrics.groups),
                                   attempts=dict(self.metrics.attempts),
                                   attempts_in_flight=self.metrics.running, cursor_floor=self.cursor.floor,
                                   worker_rows=(self.row(),))

    def row(self) -> WorkerRow:
        """This worker and its sandboxes (`fleet_row.WorkerRow`)."""
        warm, leased = sandbox_counts(self.pool)
        m = self.metrics
        return WorkerRow(worker=getattr(self.ctx, "name", ""), host=_HOST, remote=False,
                         attempts_running=m.running, groups_running=m.groups_running, groups=dict(m.groups),
                         failures=dict(m.failures), sandboxes_warm=warm, sandboxes_leased=leased,
                         sandboxes_limit=self.cfg.sandbox.max_containers,
                         health="draining" if getattr(self.ctx, "draining", False) else "up")

    # -- one attempt ------------------------------------------------------------------------
    def scores_by_group(self, task: Task) -> bool:
        """Whether the attempts at `task` are scored together (`sandboxing.GroupScorer`):
        a ``"files"`` harness, a task with no setup commands, ``group_scoring`` on."""
        return self.cfg.group_scoring and self.sandbox_use == "files" and not task.setup.commands

    async def attempt(self, task: Task, ticket: AttemptTicket, scorer: GroupScorer | None = None, *,
                      generated: Any = None) -> Trajectory | Failed:
        """One try (`AttemptRunner.run`) with the model viewed for this attempt."""
        model = self.model.for_attempt(ticket.attempt_id) if self.model is not None else None
        return await self.runner.run(task, ticket, model, scorer, generated=generated)

    async def slot(self, task: Task, tracker: GroupTracker, ticket: AttemptTicket | None,
                   scorer: GroupScorer | None = None) -> None:
        """Run one slot of a group: its first try and any retries."""
        while ticket is not None:
            if self.abandoning or (ticket.try_no > 1 and self.ctx.draining):
                await self.report(tracker.abandon(ticket, "shutdown began before it could run"), final=True)
                return
            scope = trio.CancelScope()
            self.scopes.add(scope)
            outcome: Trajectory | Failed | None = None
            held = _SlotHold(self.attempt_slots)
            try:
                with scope:
                    await held.acquire()
                    self.metrics.started()
                    try:
                        outcome = await self.attempt(task, ticket, scorer, generated=held.release)
                    finally:
                        self.metrics.ended()
            finally:
                held.release()
                self.scopes.discard(scope)
            if outcome is None:  # cancelled by the drain deadline
                await self.report(tracker.abandon(ticket, f"still running {self.cfg.drain_grace_s:g} s "
                                                          "after shutdown began"), final=True)
                return
            if isinstance(outcome, Trajectory):
                tracker.scored(ticket, outcome)
                self.metrics.attempt("scored")
                self.metrics.reward(outcome.reward)
                self.metrics.breaks(outcome)
                return
            msg, ticket = tracker.failed(ticket, outcome.kind, outcome.detail)
            await self.report(msg, final=ticket is None)

    async def report(self, msg: RolloutFailed, *, final: bool) -> None:
        self.metrics.attempt("failed" if final else "retried")
        self.metrics.failure(msg.reason, final)
        self.log.warning("attempt failed", attempt=msg.attempt_id, reason=msg.reason, detail=msg.detail,
                         final=final)
        await self.failures_out.send(msg)

    # -- one group --------------------------------------------------------------------------
    async def group(self, index: int, task: Task, done: trio.Semaphore) -> None:
        self.metrics.groups_running += 1
        try:
            # deterministic: a task re-run after a restart gets the same id, so the trainer
            # refuses a copy of a group it already holds (exactly-once across SIGKILL)
            group_id = group_id_of(task.id, index, self.ctx.name)
            tracker = GroupTracker(group_id=group_id, task_id=task.id, group_size=self.cfg.group_size,
                                   policy=self.cfg.retry)
            paced = Paced(group_id) if self.pacing is not None else None
            try:
                admitted = True
                if paced is not None:  # an admission wait ends when the drain begins: nothing has started
                    got, ok = await self.unless_draining(partial(self.pacing.admit, paced))
                    admitted = got and bool(ok)
                tickets = tracker.start()
                if not admitted:
                    for t in tickets:
                        await self.report(tracker.abandon(t, "shutdown began while it waited for the "
                                                             "sampler pool's pacer"), final=True)
                else:
                    async with trio.open_nursery() as n:
                        scorer = None
                        if self.scores_by_group(task):
                            scorer = GroupScorer(self.pool, task, sandbox_limits(task, self.cfg.sandbox),
                                                 nursery=n, scopes=self.scopes, batcher=self.score_batcher)
                        for ticket in tickets:
                            n.start_soon(self.slot, task, tracker, ticket, scorer)
                result = tracker.result()
            finally:
                if paced is not None:  # always, cancellation included
                    self.pacing.finish_paced(paced, tracker.result().group if tracker.done else None)
            if paced is not None:
                await paced.released.wait()  # sent (when emitted) by `release_in_order`
            elif result.group is not None:
                await self.out.send(result.group)
            self.group_ended(index, task, result)
        finally:
            self.metrics.groups_running -= 1
            done.release()

    def group_ended(self, index: int, task: Task, result: GroupResult) -> None:
        group_id = result.group_id
        if result.group is not None:
            self.metrics.group("emitted")
            self.log.info("group emitted", group=group_id, task=task.id, rewards=list(result.group.rewards),
                          failed=len(result.failures), retried=len(result.retried))
            self.cursor.finish(index)
        elif result.abandoned:
            self.metrics.group("abandoned")
            self.log.warning("group abandoned at shutdown; its task stays due", group=group_id, task=task.id,
                             task_number=index, unused=[t.attempt_id for t in result.unused])
            self.cursor.release(index)
        else:
            self.metrics.group("incomplete")
            self.log.warning("group incomplete: too many failed attempts", group=group_id, task=task.id,
                             failed=[f.attempt_id for f in result.failures],
                             unused=[t.attempt_id for t in result.unused],
                             allowed=self.cfg.retry.failed_allowed(self.cfg.group_size))
            self.cursor.finish(index)

    # -- the task loop ----------------------------------------------------------------------
    async def unless_draining(self, wait: Any) -> tuple[bool, Any]:
        """``(True, await wait())``, or ``(False, None)`` when the daemon starts draining
        first (`wait` is then cancelled)."""
        done, value = False, None
        async with trio.open_nursery() as n:
            async def take() -> None:
                nonlocal done, value
                value = await wait()
                done = True
                n.cancel_scope.cancel()

            async def drain() -> None:
                await self.ctx.wait_draining()
                n.cancel_scope.cancel()
            n.start_soon(take)
            n.start_soon(drain)
        return done, value

    async def acquire_unless_draining(self, sem: trio.Semaphore) -> bool:
        got, _ = await self.unless_draining(sem.acquire)
        if got and self.ctx.draining:
            sem.release()
            return False
        return got

    async def task_at(self, source: Any, index: int) -> Task | None:
        """Task number `index` of `source`; a source with ``wait_get`` (the ingested
        tasks) is awaited until it has one, or None once the daemon drains."""
        wait_get = getattr(source, "wait_get", None)
        if wait_get is None:
            return source.get(index)
        _, task = await self.unless_draining(lambda: wait_get(index))
        return task

    async def abandon_after_grace(self) -> None:
        await self.ctx.wait_draining()
        await trio.sleep(self.cfg.drain_grace_s)
        self.abandoning = True
        for scope in list(self.scopes):
            scope.cancel()

    async def run(self, source: Any) -> None:
        if self.pacing is not None and self.pacing.pool.pacer.attempts_per_step % self.cfg.group_size:
            raise ValueError(f"the sampler pool's attempts_per_step={self.pacing.pool.pacer.attempts_per_step} is not a "
                             f"multiple of group_size={self.cfg.group_size}: pacing needs attempts_per_step = "
                             "the trainer's groups_per_step x group_size")
        groups_free = trio.Semaphore(self.cfg.groups_in_flight)
        taken = 0
        async with trio.open_nursery() as outer:
            outer.start_soon(self.abandon_after_grace)
            if self.pacing is not None:
                outer.start_soon(self.pacing.release_in_order, self.out)
            async with trio.open_nursery() as groups:
                while self.cfg.max_tasks is None or taken < self.cfg.max_tasks:
                    await self.ctx.wait_unpaused()
                    if self.ctx.draining or not await self.acquire_unless_draining(groups_free):
                        break
                    index = self.cursor.take()
                    task = await self.task_at(source, index)
                    if task is None:
                        self.cursor.release(index)
                        groups_free.release()
                        if not self.ctx.draining:
                            self.log.info("task source exhausted", source=source.describe, tasks=index)
                        break
                    taken += 1
                    self.tasks_taken += 1
                    groups.start_soon(self.group, index, task, groups_free)
            # every group has ended; idle until shutdown (the supervisor would restart a returned actor)
            await self.ctx.wait_draining()
            outer.cancel_scope.cancel()

"""The environment worker actor: tasks in, rollout groups (and typed failures) out.

``run(cfg: EnvWorkerConfig, ctx, *, task_status)`` takes task after task from its
source and runs each task's G attempts concurrently (at most
``max_concurrent_attempts`` over all groups). One attempt, by what its harness
declares (``sandbox_use``, harness.protocol):

* ``"eager"``: lease a sandbox from the worker's pool (one pool per incarnation,
  containers labelled with ``Ownership.for_state_dir(daemon_dir, owner=instance_id,
  run=run_id)``; every container is removed when the pool closes), ``prepare_sandbox``
  (setup files and commands), the harness's ``run(task, sandbox, model)`` within
  ``task.limits.timeout_s + attempt_slack_s``, then ``evaluate_in_sandbox``;
* ``"lazy"``: the same, but the harness gets a `sandboxing.LazySandbox` that leases and
  prepares on its first call (no container held while the model generates);
* ``"files"`` on a task without setup commands: the harness writes into a
  `sandboxing.FileRecorder`, and the group's attempts are scored together by a
  `sandboxing.GroupScorer` (one lease, one ``exec_many``).

A scored attempt becomes a `Trajectory` holding the token record of every model call
(`AttemptRecord.trajectory`); a failure becomes a `RolloutFailed` with its kind
(`policy`), sent at once, counted in Prometheus, and retried by the `RetryPolicy`.
When every slot of the group has ended, the group (`group.GroupTracker`) is sent as
one `RolloutGroup`, or reported as incomplete.

Pacing (``model.kind = "pool"``, ``pacing = true``): a group's G slots are admitted by
the pool's staleness pacer, consecutively, before its attempts start; they are always
finished in the pacer when the group ends; groups are sent in the pool's release
order (admission order), the order the pacer's bound assumes (docs/envworkers.md).

``harness = "external"``: the harness is an `ExternalHarness` running the configured
command (``harness_config`` = an `ExternalCommand`) against the endpoint actor named by
``endpoint`` (``fleetrl.actors.endpoint``, same daemon): each attempt opens a key in
the endpoint's `AttemptRegistry`, and the `AttemptRecord` of the command's calls, closed
when it ends, is the attempt's trajectory. The worker then loads no model of its own.

Drain (shutdown): no new task is taken and no failed attempt is retried; attempts in
flight may finish for ``drain_grace_s``; then they are cancelled and each is reported
as a ``timeout`` failure "abandoned at shutdown". A group with an abandoned attempt is
never emitted and its task is not marked finished, so the checkpointed cursor
(`cursor.CursorState`) keeps it due and the next start runs it again from scratch.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

import msgspec
import trio

from fleetrl.daemon.messages import RolloutFailed, RolloutGroup, Trajectory
from fleetrl.harness.model import HFChatTokenizer
from fleetrl.harness.protocol import (
    Episode,
    Harness,
    SetupFailed,
    evaluate_in_sandbox,
    prepare_sandbox,
    sandbox_use_of,
)
from fleetrl.harness.tasks import EvaluatorOutputError, Task
from fleetrl.sandboxes import Limits, Ownership, SandboxError, WarmPolicy, open_sandbox_pool

from .config import EXTERNAL, EnvWorkerConfig, LocalModel, ModelConfig, PoolModel, SandboxSettings
from .cursor import CursorState, TaskCursor
from .group import AttemptTicket, GroupResult, GroupTracker
from .model import LocalModelClient, PoolModelClient
from .policy import episode_failure
from .sandboxing import FileRecorder, GroupScorer, LazySandbox, ScoringFailed
from .score_batches import ScoreBatcher
from .sources import open_task_source

__all__ = ["Failed", "group_id_of", "load_harness", "open_model", "run", "sandbox_limits"]

MiB = 1 << 20


def group_id_of(task_id: str, index: int, worker: str) -> str:
    """The id of the group of task number ``index`` run by worker ``worker``: the same
    on every run of that task, so a re-run after a crash or restart is a duplicate."""
    return f"{task_id}#{index}@{worker}"


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


class _Paced:
    """A group's slots in the pool's pacer: admitted ids, what to send on release."""

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        self.admitted: list[str] = []
        self.left = -1  # slots not yet released (set when they are finished)
        self.group: RolloutGroup | None = None
        self.released = trio.Event()


class Failed(msgspec.Struct, frozen=True):
    """An attempt that could not be scored: its failure kind and what happened."""

    kind: str
    detail: str


def load_harness(path: str, config: dict[str, Any]) -> Harness:
    """The harness named by ``module:attr``: an object with ``run`` is used as is (then
    ``config`` must be empty); a msgspec Struct class is built from ``config`` (checked);
    any other callable is called with ``config`` as keyword arguments."""
    mod_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"harness {path!r} cannot be loaded: {exc}") from exc
    if not isinstance(obj, type) and hasattr(obj, "run"):
        if config:
            raise ValueError(f"harness {path!r} is an object; harness_config must be empty")
        harness = obj
    elif isinstance(obj, type) and issubclass(obj, msgspec.Struct):
        unknown = sorted(set(config) - set(obj.__struct_fields__))
        if unknown:  # checked here: a harness struct need not forbid unknown fields itself
            raise ValueError(f"harness_config for {path}: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(obj.__struct_fields__)})")
        try:
            harness = msgspec.convert(config, obj)
        except msgspec.ValidationError as exc:
            raise ValueError(f"harness_config for {path}: {exc}") from exc
    elif callable(obj):
        try:
            harness = obj(**config)
        except TypeError as exc:
            raise ValueError(f"harness_config for {path}: {exc}") from exc
    else:
        raise ValueError(f"harness {path!r} is neither a harness nor a factory")
    if not isinstance(harness, Harness):
        raise ValueError(f"harness {path!r} gives a {type(harness).__name__}, which has no async run()")
    return harness


def sandbox_limits(task: Task, s: SandboxSettings) -> Limits:
    """The sandbox limits of an attempt at `task` (its own limits win over the defaults)."""
    return Limits(memory_bytes=(task.limits.memory_mb or s.memory_mb) * MiB,
                  cpus=task.limits.cpus or s.cpus, timeout_s=s.exec_timeout_s, workdir=task.workdir)


class _Metrics:
    def __init__(self, metrics: Any) -> None:
        self._m = metrics
        self.in_flight = metrics.gauge("envworker_attempts_in_flight", "Attempts running now")

    def attempt(self, outcome: str) -> None:
        self._m.counter("envworker_attempts_total", "Attempts that ended, by outcome",
                        {"outcome": outcome}).inc()

    def failure(self, reason: str, final: bool) -> None:
        self._m.counter("envworker_attempt_failures_total", "Failed attempts, by reason and whether "
                        "the slot gave up (final) or was retried", {"reason": reason,
                                                                   "final": str(final).lower()}).inc()

    def group(self, outcome: str) -> None:
        self._m.counter("envworker_groups_total", "Groups that ended, by outcome", {"outcome": outcome}).inc()

    def score_batch(self, groups: int) -> None:
        self._m.histogram("envworker_score_batch_groups", "Groups scored together in one lease and engine exec",
                          buckets=(1, 2, 4, 8, 16, 32, 64)).observe(groups)

    def reward(self, value: float) -> None:
        self._m.histogram("envworker_reward", "Rewards of scored attempts",
                          buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)).observe(value)


class _Worker:
    def __init__(self, cfg: EnvWorkerConfig, ctx: Any, *, harness: Harness, model: Any, pool: Any,
                 out: Any, failures_out: Any, cursor: TaskCursor) -> None:
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
        m = cfg.model
        self.pacer = model.pool if isinstance(m, PoolModel) and m.pacing else None
        self.skips_zero_variance = isinstance(m, PoolModel) and m.trainer_skips_zero_variance
        self.admit_lock = trio.Lock()
        self.awaiting: dict[str, _Paced] = {}
        b = cfg.score_batching
        self.score_batcher = (ScoreBatcher(pool, max_groups=b.max_groups, linger_s=b.linger_s, slots=b.slots,
                                           on_batch=self.metrics.score_batch)
                              if b.max_groups > 1 else None)

    # -- one attempt ------------------------------------------------------------------------
    def scores_by_group(self, task: Task) -> bool:
        """Whether the attempts at `task` are scored together (`sandboxing.GroupScorer`):
        a ``"files"`` harness, a task with no setup commands, ``group_scoring`` on."""
        return self.cfg.group_scoring and self.sandbox_use == "files" and not task.setup.commands

    async def attempt(self, task: Task, ticket: AttemptTicket, scorer: GroupScorer | None = None, *,
                      generated: Any = None) -> Trajectory | Failed:
        """One try. ``generated``: called when the attempt no longer needs its attempt
        slot (a group-scored attempt whose harness has returned waits for its batch
        without holding one, so generation concurrency is not spent on scoring)."""
        t0 = time.monotonic()
        model = self.model.for_attempt(ticket.attempt_id) if self.model is not None else None
        limits = sandbox_limits(task, self.cfg.sandbox)
        try:
            if scorer is not None:
                out = await self._attempt_files(task, model, scorer, generated or (lambda: None))
            elif self.cfg.lazy_sandbox and self.sandbox_use != "eager":
                out = await self._attempt_lazy(task, model, limits)
            else:
                out = await self._attempt_eager(task, model, limits)
        except SandboxError as exc:
            return Failed("sandbox_error", f"{type(exc).__name__}: {exc}")
        if isinstance(out, Failed):
            return out
        episode, reward, code = out
        record = msgspec.structs.replace(episode.record, attempt_id=ticket.attempt_id)
        metrics = {"evaluator_exit_code": float(code), "wall_s": time.monotonic() - t0,
                   "n_calls": float(len(record.calls)), "try": float(ticket.try_no)}
        if episode.harness_reward is not None:
            metrics["harness_reward"] = float(episode.harness_reward)
        return record.trajectory(group_id=ticket.group_id, reward=reward, metrics=metrics)

    async def _attempt_eager(self, task: Task, model: Any, limits: Limits) -> tuple[Episode, float, int] | Failed:
        """A sandbox leased and prepared before the harness runs, held until scored."""
        async with self.pool.lease(task.image, limits) as sb:
            try:
                await prepare_sandbox(task, sb, timeout_s=self.cfg.sandbox.setup_timeout_s)
            except SetupFailed as exc:
                return Failed("sandbox_error", f"setup failed: {exc}")
            episode = await self.run_harness(task, sb, model)
            if isinstance(episode, Failed):
                return episode
            return await self._evaluate(task, sb, episode)

    async def _attempt_lazy(self, task: Task, model: Any, limits: Limits) -> tuple[Episode, float, int] | Failed:
        """The harness gets a proxy that leases and prepares on first use."""
        async with LazySandbox(self.pool, task, limits, setup_timeout_s=self.cfg.sandbox.setup_timeout_s) as lazy:
            episode = await self.run_harness(task, lazy, model, lazy=lazy)
            if isinstance(episode, Failed):
                return episode
            try:
                sb = await lazy.get()  # a harness that never touched it: the evaluator sees the setup state
            except SetupFailed as exc:
                return Failed("sandbox_error", f"setup failed: {exc}")
            return await self._evaluate(task, sb, episode)

    async def _attempt_files(self, task: Task, model: Any, scorer: GroupScorer, generated: Any
                             ) -> tuple[Episode, float, int] | Failed:
        """A ``"files"`` harness writes into a recorder; the group is scored in one batch."""
        scorer.join()
        submitted = False
        try:
            recorder = FileRecorder()
            episode = await self.run_harness(task, recorder, model)
            if isinstance(episode, Failed):
                return episode
            submitted = True
            generated()
            scored = await scorer.score(recorder.files)
        finally:
            if not submitted:
                scorer.leave()
        if isinstance(scored, ScoringFailed):
            return Failed(scored.kind, scored.detail)
        return episode, scored.reward, scored.exit_code

    async def _evaluate(self, task: Task, sb: Any, episode: Episode) -> tuple[Episode, float, int] | Failed:
        try:
            reward, code, _ = await evaluate_in_sandbox(task, sb)
        except EvaluatorOutputError as exc:
            return Failed("evaluator_error", str(exc))
        return episode, reward, code

    async def run_harness(self, task: Task, sb: Any, model: Any, *, lazy: LazySandbox | None = None
                          ) -> Episode | Failed:
        """The harness's run within its budget, classified (an `Episode` to score, or `Failed`)."""
        budget = task.limits.timeout_s + self.cfg.attempt_slack_s
        episode: Any = None
        crash: Exception | None = None
        with trio.move_on_after(budget) as scope:
            if lazy is not None:
                lazy.budget = scope  # leasing and setup time is added back to the budget
            try:
                episode = await self.harness.run(task, sb, model)
            except SandboxError:
                raise
            except Exception as exc:  # the harness is foreign code: any error is its crash
                crash = exc
        if lazy is not None and lazy.setup_error is not None:  # even when the harness swallowed it
            return Failed("sandbox_error", f"setup failed: {lazy.setup_error}")
        if lazy is not None and lazy.sandbox_error is not None:
            raise lazy.sandbox_error
        if crash is not None:
            return Failed("harness_crash", f"{type(crash).__name__}: {crash}")
        if scope.cancelled_caught and episode is None:
            return Failed("timeout", f"harness did not return within {budget:g} s "
                                     f"(task.limits.timeout_s={task.limits.timeout_s:g} + slack)")
        if not isinstance(episode, Episode):
            return Failed("harness_crash", f"harness returned a {type(episode).__name__}, not an Episode")
        failure = episode_failure(episode.final_state, episode.error)
        if failure is not None:
            return Failed(*failure)
        return episode

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
                    self.metrics.in_flight.inc()
                    try:
                        outcome = await self.attempt(task, ticket, scorer, generated=held.release)
                    finally:
                        self.metrics.in_flight.dec()
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
        try:
            # deterministic: a task re-run after a restart gets the same id, so the trainer
            # refuses a copy of a group it already holds (exactly-once across SIGKILL)
            group_id = group_id_of(task.id, index, self.ctx.name)
            tracker = GroupTracker(group_id=group_id, task_id=task.id, group_size=self.cfg.group_size,
                                   policy=self.cfg.retry)
            paced = _Paced(group_id) if self.pacer is not None else None
            try:
                admitted = paced is None or await self.admit(paced)
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
                    self.finish_paced(paced, tracker.result().group if tracker.done else None)
            if paced is not None:
                await paced.released.wait()  # sent (when emitted) by `release_in_order`
            elif result.group is not None:
                await self.out.send(result.group)
            self.group_ended(index, task, result)
        finally:
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

    # -- pacing (model.kind = "pool") -------------------------------------------------------
    async def admit(self, paced: _Paced) -> bool:
        """Admit the group's G slots through the pool's pacer, one after another (so its
        slots hold consecutive places in the release order). False: the drain deadline
        cut the wait short (what was admitted is finished as failed by the caller)."""
        assert self.pacer is not None
        self.awaiting[paced.group_id] = paced
        scope = trio.CancelScope()
        self.scopes.add(scope)
        try:
            with scope:
                async with self.admit_lock:
                    for slot in range(self.cfg.group_size):
                        pid = f"{paced.group_id}/{slot}"
                        await self.pacer.admit(pid)
                        paced.admitted.append(pid)
        finally:
            self.scopes.discard(scope)
        return len(paced.admitted) == self.cfg.group_size

    def finish_paced(self, paced: _Paced, group: RolloutGroup | None) -> None:
        """End every admitted slot of the group in the pacer, always (cancellation too).
        The slots count as training slots only when the trainer will train the group: it
        is emitted, and not a zero-variance group the trainer skips."""
        assert self.pacer is not None
        paced.group = group
        counts = group is not None and not (self.skips_zero_variance and len(set(group.rewards)) == 1)
        paced.left = len(paced.admitted)
        if not paced.admitted:
            self.awaiting.pop(paced.group_id, None)
            paced.released.set()
        for pid in paced.admitted:
            self.pacer.finish(pid, paced.group_id, failed=not counts)

    async def release_in_order(self) -> None:
        """Consume the pool's release stream (admission order) and send each group when
        all its slots are released: the trainer receives groups in admission order,
        which is the order the pacer's bound assumes."""
        assert self.pacer is not None
        while True:
            for adm, group_id, _failed in await self.pacer.released():
                paced = self.awaiting.get(group_id) if isinstance(group_id, str) else None
                if paced is None:
                    raise RuntimeError(
                        f"the sampler pool released attempt {adm.attempt_id!r}, which this worker did not "
                        "admit: a pool's release stream has one consumer, so at most one environment worker "
                        "may pace through a pool (set model.pacing = false on the others)")
                paced.left -= 1
                if paced.left == 0:
                    del self.awaiting[group_id]
                    if paced.group is not None:
                        await self.out.send(paced.group)
                    paced.released.set()

    # -- the task loop ----------------------------------------------------------------------
    async def acquire_unless_draining(self, sem: trio.Semaphore) -> bool:
        got = False
        async with trio.open_nursery() as n:
            async def take() -> None:
                nonlocal got
                await sem.acquire()
                got = True
                n.cancel_scope.cancel()

            async def drain() -> None:
                await self.ctx.wait_draining()
                n.cancel_scope.cancel()
            n.start_soon(take)
            n.start_soon(drain)
        if got and self.ctx.draining:
            sem.release()
            return False
        return got

    async def abandon_after_grace(self) -> None:
        await self.ctx.wait_draining()
        await trio.sleep(self.cfg.drain_grace_s)
        self.abandoning = True
        for scope in list(self.scopes):
            scope.cancel()

    async def run(self, source: Any) -> None:
        if self.pacer is not None and self.pacer.pacer.attempts_per_step % self.cfg.group_size:
            raise ValueError(f"the sampler pool's attempts_per_step={self.pacer.pacer.attempts_per_step} is not a "
                             f"multiple of group_size={self.cfg.group_size}: pacing needs attempts_per_step = "
                             "the trainer's groups_per_step x group_size")
        groups_free = trio.Semaphore(self.cfg.groups_in_flight)
        taken = 0
        async with trio.open_nursery() as outer:
            outer.start_soon(self.abandon_after_grace)
            if self.pacer is not None:
                outer.start_soon(self.release_in_order)
            async with trio.open_nursery() as groups:
                while self.cfg.max_tasks is None or taken < self.cfg.max_tasks:
                    await self.ctx.wait_unpaused()
                    if self.ctx.draining or not await self.acquire_unless_draining(groups_free):
                        break
                    index = self.cursor.take()
                    task = source.get(index)
                    if task is None:
                        self.cursor.release(index)
                        groups_free.release()
                        self.log.info("task source exhausted", source=source.describe, tasks=index)
                        break
                    taken += 1
                    groups.start_soon(self.group, index, task, groups_free)
            # every group has ended; idle until shutdown (the supervisor would restart a returned actor)
            await self.ctx.wait_draining()
            outer.cancel_scope.cancel()


async def open_model(m: ModelConfig, ctx: Any) -> Any:
    """The model client of ``m``: a torch backend of this actor's own, or the pool actor's client."""
    if isinstance(m, LocalModel):
        from fleetrl.actors.samplers.torch_backend import TorchBackend, TorchBackendConfig

        bcfg = TorchBackendConfig(model_dir=m.model_dir, dtype=m.dtype, device=m.device)
        backend = await trio.to_thread.run_sync(TorchBackend, bcfg)
        tok = await trio.to_thread.run_sync(HFChatTokenizer.from_pretrained, m.tokenizer_dir or m.model_dir)
        return LocalModelClient(backend, tok, sampler_id=f"{ctx.name}-local", concurrency=m.concurrency)
    tok = await trio.to_thread.run_sync(HFChatTokenizer.from_pretrained, m.tokenizer_dir)
    return PoolModelClient(await ctx.handle(m.pool), tok, min_version=m.min_version)


def _sender(ctx: Any, name: str, key: str) -> Any:
    try:
        return ctx.sender(name)
    except KeyError:
        raise ValueError(f"{key} = {name!r} is not an actor of this daemon") from None


async def _external_harness(cfg: EnvWorkerConfig, ctx: Any) -> Harness:
    """``harness = "external"``: the command against the endpoint actor ``cfg.endpoint``,
    which runs in this daemon (waits until it has started)."""
    from fleetrl.actors.endpoint import endpoint_handle
    from fleetrl.harness.external import ExternalHarness

    assert cfg.endpoint is not None  # the config checks it
    _sender(ctx, cfg.endpoint, "endpoint").close()  # an actor of this daemon? (else a clear error)
    handle = await endpoint_handle(cfg.endpoint, instance_id=ctx.instance_id)
    ctx.log.info("external harness", argv=list(cfg.external_command().argv), endpoint=handle.base_url)
    return ExternalHarness(cfg.external_command(), registry=handle.registry, base_url=handle.base_url,
                           model_name=handle.model_name)


async def run(cfg: EnvWorkerConfig, ctx: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """The environment worker actor (see the module docstring)."""
    external = cfg.harness == EXTERNAL
    harness = None if external else load_harness(cfg.harness, cfg.harness_config)
    source = await trio.to_thread.run_sync(open_task_source, cfg.tasks, ctx.log)
    cursor = TaskCursor(ctx.restored_as(CursorState))

    async def checkpoint() -> CursorState:
        return cursor.state()
    ctx.on_checkpoint(checkpoint)
    if external:
        harness, model = await _external_harness(cfg, ctx), None
    else:
        assert cfg.model is not None  # the config checks it
        model = await open_model(cfg.model, ctx)
    out = _sender(ctx, cfg.target, "target")
    failures_out = out if cfg.failures_to in (None, cfg.target) else _sender(ctx, cfg.failures_to, "failures_to")
    ownership = Ownership.for_state_dir(ctx.daemon_dir, owner=ctx.instance_id, run=ctx.run_id)
    s = cfg.sandbox
    policy = WarmPolicy(min_warm=s.min_warm, max_warm=s.max_warm, max_containers=s.max_containers)
    async with open_sandbox_pool(ownership, policy=policy) as pool:
        worker = _Worker(cfg, ctx, harness=harness, model=model, pool=pool, out=out,
                         failures_out=failures_out, cursor=cursor)
        ctx.log.info("environment worker ready", tasks=source.describe, floor=cursor.floor,
                     group_size=cfg.group_size, max_concurrent_attempts=cfg.max_concurrent_attempts)
        task_status.started()
        await worker.run(source)

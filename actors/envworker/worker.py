"""The environment worker actor: tasks in, rollout groups (and typed failures) out.

``run(cfg: EnvWorkerConfig, ctx, *, task_status)`` takes task after task from its
source and runs each task's G attempts concurrently (at most
``max_concurrent_attempts`` over all groups, each holding one sandbox). One attempt:

1. lease a sandbox from the worker's pool (one pool per incarnation, containers
   labelled with ``Ownership.for_state_dir(daemon_dir, owner=instance_id, run=run_id)``;
   every container is removed when the pool closes);
2. ``prepare_sandbox`` (setup files and commands);
3. the harness's ``run(task, sandbox, model)`` within ``task.limits.timeout_s +
   attempt_slack_s``;
4. ``evaluate_in_sandbox``: the task's evaluator gives the reward.

A scored attempt becomes a `Trajectory` holding the token record of every model call
(`AttemptRecord.trajectory`); a failure becomes a `RolloutFailed` with its kind
(`policy`), sent at once, counted in Prometheus, and retried by the `RetryPolicy`.
When every slot of the group has ended, the group (`group.GroupTracker`) is sent as
one `RolloutGroup`, or reported as incomplete.

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

from fleetrl.daemon.messages import RolloutFailed, Trajectory
from fleetrl.harness.model import HFChatTokenizer
from fleetrl.harness.protocol import Episode, Harness, SetupFailed, evaluate_in_sandbox, prepare_sandbox
from fleetrl.harness.tasks import EvaluatorOutputError, Task
from fleetrl.sandboxes import Limits, Ownership, SandboxError, WarmPolicy, open_sandbox_pool

from .config import EXTERNAL, EnvWorkerConfig, LocalModel, ModelConfig, SandboxSettings
from .cursor import CursorState, TaskCursor
from .group import AttemptTicket, GroupTracker
from .model import LocalModelClient, PoolModelClient
from .policy import episode_failure
from .sources import open_task_source

__all__ = ["Failed", "group_id_of", "load_harness", "open_model", "run", "sandbox_limits"]

MiB = 1 << 20


def group_id_of(task_id: str, index: int, worker: str) -> str:
    """The id of the group of task number ``index`` run by worker ``worker``: the same
    on every run of that task, so a re-run after a crash or restart is a duplicate."""
    return f"{task_id}#{index}@{worker}"


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

    # -- one attempt ------------------------------------------------------------------------
    async def attempt(self, task: Task, ticket: AttemptTicket) -> Trajectory | Failed:
        t0 = time.monotonic()
        model = self.model.for_attempt(ticket.attempt_id) if self.model is not None else None
        try:
            async with self.pool.lease(task.image, sandbox_limits(task, self.cfg.sandbox)) as sb:
                try:
                    await prepare_sandbox(task, sb, timeout_s=self.cfg.sandbox.setup_timeout_s)
                except SetupFailed as exc:
                    return Failed("sandbox_error", f"setup failed: {exc}")
                budget = task.limits.timeout_s + self.cfg.attempt_slack_s
                episode = None
                with trio.move_on_after(budget):
                    try:
                        episode = await self.harness.run(task, sb, model)
                    except SandboxError:
                        raise
                    except Exception as exc:  # the harness is foreign code: any error is its crash
                        return Failed("harness_crash", f"{type(exc).__name__}: {exc}")
                if episode is None:
                    return Failed("timeout", f"harness did not return within {budget:g} s "
                                             f"(task.limits.timeout_s={task.limits.timeout_s:g} + slack)")
                if not isinstance(episode, Episode):
                    return Failed("harness_crash", f"harness returned a {type(episode).__name__}, not an Episode")
                failure = episode_failure(episode.final_state, episode.error)
                if failure is not None:
                    return Failed(*failure)
                try:
                    reward, code, _ = await evaluate_in_sandbox(task, sb)
                except EvaluatorOutputError as exc:
                    return Failed("evaluator_error", str(exc))
        except SandboxError as exc:
            return Failed("sandbox_error", f"{type(exc).__name__}: {exc}")
        record = msgspec.structs.replace(episode.record, attempt_id=ticket.attempt_id)
        metrics = {"evaluator_exit_code": float(code), "wall_s": time.monotonic() - t0,
                   "n_calls": float(len(record.calls)), "try": float(ticket.try_no)}
        if episode.harness_reward is not None:
            metrics["harness_reward"] = float(episode.harness_reward)
        return record.trajectory(group_id=ticket.group_id, reward=reward, metrics=metrics)

    async def slot(self, task: Task, tracker: GroupTracker, ticket: AttemptTicket | None) -> None:
        """Run one slot of a group: its first try and any retries."""
        while ticket is not None:
            if self.abandoning or (ticket.try_no > 1 and self.ctx.draining):
                await self.report(tracker.abandon(ticket, "shutdown began before it could run"), final=True)
                return
            scope = trio.CancelScope()
            self.scopes.add(scope)
            outcome: Trajectory | Failed | None = None
            try:
                with scope:
                    async with self.attempt_slots:
                        self.metrics.in_flight.inc()
                        try:
                            outcome = await self.attempt(task, ticket)
                        finally:
                            self.metrics.in_flight.dec()
            finally:
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
            async with trio.open_nursery() as n:
                for ticket in tracker.start():
                    n.start_soon(self.slot, task, tracker, ticket)
            result = tracker.result()
            if result.group is not None:
                await self.out.send(result.group)
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
        finally:
            done.release()

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
        groups_free = trio.Semaphore(self.cfg.groups_in_flight)
        taken = 0
        async with trio.open_nursery() as outer:
            outer.start_soon(self.abandon_after_grace)
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
    from fleetrl.actors.pool import pool_client

    tok = await trio.to_thread.run_sync(HFChatTokenizer.from_pretrained, m.tokenizer_dir)
    return PoolModelClient(await pool_client(m.pool), tok, min_version=m.min_version)


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

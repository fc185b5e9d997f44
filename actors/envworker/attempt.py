"""One attempt at a task: lease a sandbox (or not), run the harness within its budget,
score it, and classify what went wrong (`Failed`, with its kind from `policy`).

`AttemptRunner.run` is the attempt as the environment worker runs it, by what its
harness declares (``sandbox_use``, harness.protocol): ``"eager"`` leases and prepares
before the harness runs; ``"lazy"`` hands the harness a `sandboxing.LazySandbox` that
leases on first use; a ``"files"`` harness writes into a `sandboxing.FileRecorder` and
its group is scored together by a `sandboxing.GroupScorer`. A scored attempt becomes a
`Trajectory` holding the token record of every model call (and, with ``atif`` in the
config, an ATIF file of it: `atif_files`).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import trio

from fleetrl.daemon.messages import Trajectory
from fleetrl.harness.protocol import Episode, Harness, SetupFailed, evaluate_in_sandbox, prepare_sandbox
from fleetrl.harness.tasks import EvaluatorOutputError, Task
from fleetrl.sandboxes import Limits, SandboxError

from .config import EnvWorkerConfig, SandboxSettings
from .group import AttemptTicket
from .policy import episode_failure
from .sandboxing import FileRecorder, GroupScorer, LazySandbox, ScoringFailed

__all__ = ["AttemptRunner", "Failed", "sandbox_limits"]

MiB = 1 << 20


class Failed(msgspec.Struct, frozen=True):
    """An attempt that could not be scored: its failure kind and what happened."""

    kind: str
    detail: str


def sandbox_limits(task: Task, s: SandboxSettings) -> Limits:
    """The sandbox limits of an attempt at `task` (its own limits win over the defaults)."""
    return Limits(memory_bytes=(task.limits.memory_mb or s.memory_mb) * MiB,
                  cpus=task.limits.cpus or s.cpus, timeout_s=s.exec_timeout_s, workdir=task.workdir)


class AttemptRunner:
    """Runs attempts of one worker: its config, harness and sandbox pool."""

    def __init__(self, cfg: EnvWorkerConfig, harness: Harness, pool: Any, sandbox_use: str) -> None:
        self.cfg = cfg
        self.harness = harness
        self.pool = pool
        self.sandbox_use = sandbox_use
        self.atif_files: Any = None
        """An `atif_files.AtifFiles` when each scored attempt is written as an ATIF file."""

    async def run(self, task: Task, ticket: AttemptTicket, model: Any, scorer: GroupScorer | None = None, *,
                  generated: Any = None) -> Trajectory | Failed:
        """One try. ``generated``: called when the attempt no longer needs its attempt
        slot (a group-scored attempt whose harness has returned waits for its batch
        without holding one, so generation concurrency is not spent on scoring)."""
        t0 = time.monotonic()
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
        breaks = record.breaks  # each break starts a segment trained with its own context
        metrics["retokenization_breaks"] = float(sum(breaks.values()))
        for cause, n in breaks.items():
            metrics[f"retokenization_breaks/{cause}"] = float(n)
        trajectory = record.trajectory(group_id=ticket.group_id, reward=reward, metrics=metrics)
        if self.atif_files is not None:  # never fails the attempt (atif_files logs what went wrong)
            await self.atif_files.write(task, record, trajectory)
        return trajectory

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
        if getattr(episode, "timed_out", False):
            # an external program stopped at its wall clock: a hung harness cannot be told
            # from a slow one, and neither is the model's verdict (never a reward of 0)
            return Failed("timeout", episode.error or "the harness was stopped at its limit")
        failure = episode_failure(episode.final_state, episode.error)
        if failure is not None:
            return Failed(*failure)
        return episode

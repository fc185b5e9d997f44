"""The evaluator actor: held-out pass@1 of the trainer's versions, scored in Docker.

``fleetrl.actors.evaluator:run`` follows the trainer's delta store with its own torch
backend (a `WeightSync`, as a local sampler does). It evaluates the newest version at
start (on a fresh run: version 0, the warm model), whenever the trainer's announced
version (`WeightVersionAvailable` in its inbox) is ``every_versions`` past the last one
it evaluated, and, when the daemon drains, the final version. One evaluation: for each
split, one sampled completion per task of the fixed set ``generate_tasks(n, split,
seed=task_seed)`` (temperature / top_p / seed fixed), scored inside one leased sandbox
(`scoring.score_in_sandbox`: model-written code never runs on the host). With ``tasks =
"tool_lookup"``: one multi-turn rollout per task of ``generate_tool_tasks(n, split="fresh",
seed=task_seed)`` with the example harness's loop in process (`recipe.tool_eval`: the
tool reads the task's files, the answer is compared with the code; no sandbox). Each result is
one line of ``<state>/actors/<name>/eval.jsonl`` (`records.EvalRecord`). After the
final evaluation it writes the run's report (``report_dir``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

from fleetrl.actors.pool.local import AsyncStoreSource, WeightSync
from fleetrl.actors.recipe import EvalSampling, sample_completions
from fleetrl.actors.weights import LocalDirStore, StoreSource
from fleetrl.daemon.actor import ActorContext
from fleetrl.daemon.messages import WeightVersionAvailable
from fleetrl.harness.synthetic import generate_tasks
from fleetrl.harness.synthetic_tools import generate_tool_tasks
from fleetrl.sandboxes import Limits, Ownership, WarmPolicy, open_sandbox_pool

from .config import EvaluatorConfig
from .records import EvalRecord, EvalState, is_due, make_record, step_of, tool_use
from .scoring import score_in_sandbox

__all__ = ["EvaluatorStatistics", "Inbox", "run"]

MiB = 1 << 20

Inbox = WeightVersionAvailable
"""The trainer announces each new version; the evaluator decides whether it is due."""


class EvaluatorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    evaluated: tuple[int, ...]
    """Versions evaluated so far (over restarts)."""
    announced: int
    """Newest version the trainer announced (-1: none yet)."""
    pass_at_1: dict[str, float]
    """Held-out pass@1 of the newest evaluated version, by split."""


def _say(enabled: bool, line: str) -> None:
    if enabled:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)


def _headline(report_dir: Path) -> list[str]:
    """The run's headline figures from the report's summary.json (none if unreadable)."""
    import msgspec

    from fleetrl.actors.report.headline import headline
    from fleetrl.actors.report.report import SUMMARY_FILE
    from fleetrl.actors.report.summary import Summary

    try:
        summary = msgspec.json.decode((report_dir / SUMMARY_FILE).read_bytes(), type=Summary)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return []
    return headline(summary)


class _Evaluator:
    """The evaluator's state and work; also its handle (`statistics`)."""

    def __init__(self, cfg: EvaluatorConfig, ctx: ActorContext, backend: Any, pool: Any, state: EvalState) -> None:
        self.cfg = cfg
        self.announced = -1
        self.pass_at_1: dict[str, float] = {}
        self.ctx = ctx
        self.backend = backend
        self.pool = pool
        self.evaluated = list(state.evaluated)
        self.sync = WeightSync(backend, AsyncStoreSource(StoreSource(LocalDirStore(cfg.weights_dir))))
        if cfg.tasks == "tool_lookup":
            self.tasks = {"fresh": generate_tool_tasks(cfg.n, split="fresh", seed=cfg.task_seed)}
        else:
            self.tasks = {split: generate_tasks(cfg.n, split=split, seed=cfg.task_seed) for split in cfg.splits}
        self.tokenizer: Any = None
        self.sampling = EvalSampling(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                                     seed=cfg.sampling_seed, batch_size=cfg.batch_size)
        self.out = ctx.state_dir / "eval.jsonl"
        self.metrics_path = ctx.daemon_dir / "actors" / cfg.trainer / "metrics.jsonl"
        self.limits = Limits(memory_bytes=cfg.sandbox.memory_mb * MiB, cpus=cfg.sandbox.cpus,
                             timeout_s=cfg.sandbox.timeout_s)
        self.pass_gauge = {s: ctx.metrics.gauge("evaluator_pass_at_1", "Held-out sampled pass@1 of the last "
                                                "evaluated version", {"split": s}) for s in cfg.splits}
        self.version_gauge = ctx.metrics.gauge("evaluator_version", "Newest evaluated weight version")

    def state(self) -> EvalState:
        return EvalState(evaluated=tuple(self.evaluated))

    def statistics(self) -> EvaluatorStatistics:
        return EvaluatorStatistics(evaluated=tuple(self.evaluated), announced=self.announced,
                                   pass_at_1=dict(self.pass_at_1))

    def _step_of(self, version: int) -> int:
        try:
            lines = self.metrics_path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        return step_of(version, lines)

    async def newest(self) -> int:
        """Sync the backend to the newest published version; return it."""
        return (await self.sync.sync()).version

    async def evaluate(self, version: int) -> list[EvalRecord]:
        step = await trio.to_thread.run_sync(self._step_of, version)
        records = []
        for split, tasks in self.tasks.items():
            t0 = time.monotonic()
            calls: list[int] = []
            if self.cfg.tasks == "tool_lookup":
                (rewards, calls), errors, score_s = await self._tool_rollouts(tasks), 0, 0.0
            else:
                sampled = await trio.to_thread.run_sync(sample_completions, self.backend, tasks, self.sampling)
                async with self.pool.lease(limits=self.limits) as sb:
                    scores = await score_in_sandbox(sb, tasks, [text for text, _ in sampled],
                                                    parallel=self.cfg.sandbox.parallel,
                                                    timeout_s=self.cfg.sandbox.timeout_s)
                rewards, errors, score_s = list(scores.rewards), scores.errors, scores.seconds
            t1 = time.monotonic() - score_s
            rec = make_record(version=version, step=step, split=split, rewards=rewards, time=time.time(),
                              tool_calls=calls)
            records.append(rec)
            with self.out.open("ab") as fh:
                fh.write(msgspec.json.encode(rec) + b"\n")
            self.pass_gauge[split].set(rec.pass_at_1)
            self.pass_at_1[split] = rec.pass_at_1
            tools = {"tool_use": round(tool_use(rec), 4)} if rec.tool_calls else {}
            self.ctx.log.info("evaluation", version=version, step=step, split=split, n=rec.n, passed=rec.passed,
                              pass_at_1=round(rec.pass_at_1, 4), ci=[round(rec.ci_low, 4), round(rec.ci_high, 4)],
                              mean_reward=round(rec.mean_reward, 4), checker_errors=errors,
                              sample_s=round(t1 - t0, 1), score_s=round(score_s, 1), **tools)
            _say(self.cfg.progress, f"eval v{version} (step {step}) {split}: pass@1 {100 * rec.pass_at_1:.1f}% "
                                    f"[{100 * rec.ci_low:.1f}, {100 * rec.ci_high:.1f}] ({rec.passed}/{rec.n}), "
                                    f"mean reward {rec.mean_reward:.3f}")
        self.evaluated.append(version)
        self.version_gauge.set(version)
        self.ctx.report_version("evaluated", version)
        return records

    async def _tool_rollouts(self, tasks: list[Any]) -> tuple[list[float], list[int]]:
        """Each task's reward and number of tool calls."""
        from transformers import PreTrainedTokenizerFast

        from fleetrl.actors.recipe.tool_eval import sample_tool_rollouts

        if self.tokenizer is None:  # the model's own chat template, as the endpoint renders
            self.tokenizer = await trio.to_thread.run_sync(PreTrainedTokenizerFast.from_pretrained, self.cfg.model_dir)
        rollouts = await trio.to_thread.run_sync(
            lambda: sample_tool_rollouts(self.backend, tasks, self.tokenizer, self.sampling))
        return [r.reward for r in rollouts], [r.tool_calls for r in rollouts]

    async def report(self) -> None:
        if self.cfg.report_dir is None:
            return
        try:
            from fleetrl.actors.report import write_report
        except ImportError as exc:
            self.ctx.log.warning("report not written: fleetrl.actors.report is not available", error=str(exc))
            return
        try:
            page = await trio.to_thread.run_sync(write_report, self.ctx.daemon_dir, Path(self.cfg.report_dir))
        except Exception as exc:  # the run's results are on disk; a report bug must not fail the run
            self.ctx.log.error("report not written", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
            _say(self.cfg.progress, f"report not written: {type(exc).__name__}: {exc}")
            return
        self.ctx.log.info("report written", path=str(page))
        for line in _headline(page.parent):
            _say(self.cfg.progress, line)
        _say(self.cfg.progress, f"report: {page}")


async def run(cfg: EvaluatorConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[_Evaluator] = trio.TASK_STATUS_IGNORED) -> None:
    """The evaluator actor (see the module docstring)."""
    from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig

    if not Path(cfg.weights_dir).is_dir():
        raise ValueError(f"EvaluatorConfig.weights_dir {cfg.weights_dir!r} is not a directory: start the "
                         "evaluator after the trainer (after = [\"trainer\"]) and point it at the trainer's store")
    backend = await trio.to_thread.run_sync(
        lambda: TorchBackend(TorchBackendConfig(model_dir=cfg.model_dir, dtype=cfg.dtype)))
    state = ctx.restored_as(EvalState) or EvalState()
    ownership = Ownership.for_state_dir(ctx.daemon_dir, owner=ctx.instance_id, run=ctx.run_id)
    async with open_sandbox_pool(ownership, policy=WarmPolicy(min_warm=0, max_warm=1, max_containers=2)) as pool:
        ev = _Evaluator(cfg, ctx, backend, pool, state)

        async def hook() -> EvalState:
            return ev.state()

        ctx.on_checkpoint(hook)
        changed = trio.Event()
        ended = trio.Event()
        task_status.started(ev)

        async def read_inbox() -> None:
            async for msg in ctx.inbox:
                match msg:
                    case WeightVersionAvailable(version=version):
                        ev.announced = max(ev.announced, version)
                        changed.set()
                    case _:
                        ctx.log.warning("evaluator ignored a message", type=type(msg).__name__)
            ended.set()
            changed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_inbox)
            version = await ev.newest()
            if is_due(version, ev.evaluated, cfg.every_versions):
                await ev.evaluate(version)
            while not ended.is_set():
                await changed.wait()
                changed = trio.Event()
                if ended.is_set() or ctx.draining:
                    break
                if is_due(ev.announced, ev.evaluated, cfg.every_versions):
                    version = await ev.newest()
                    if version not in ev.evaluated:
                        await ev.evaluate(version)
            if cfg.final_on_drain:
                await ended.wait()  # the trainer has returned: its last version is published
                version = await ev.newest()
                if version not in ev.evaluated:
                    await ev.evaluate(version)
                await ev.report()
            else:
                await ended.wait()

"""The trainer's state and its blocking operations (run in a worker thread by the actor).

`Trainer` owns the rollout buffer, the task cursor, the budgets, the metrics file and
the checkpoint files; the model, its optimizer and the weight publisher sit in an engine
(`engine.LocalEngine` in this process, or `rank_engine.RankEngine`: supervised
torch.distributed rank processes, with ``ranks`` configured). Every method is
synchronous; the actor serialises them with one lock, so a checkpoint never sees a
half-done step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from fleetrl.actors.buffer import RolloutBuffer, StaleGroup
from fleetrl.actors.weights import LocalDirStore
from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.daemon.messages import RolloutFailed, RolloutGroup

from . import checkpoint as ck
from .alarms import Alarm, step_alarms
from .batch import Batch, build_batch
from .config import TrainerConfig
from .engine import Engine, LocalEngine
from .schedule import lr_at
from .rollout_log import RolloutLog
from .step import RowDetail, StepMetrics

__all__ = ["Trainer", "batch_cost_usd", "batch_record"]

LOCAL_CKPT_KEY = "trainer"


def batch_cost_usd(groups: Sequence[RolloutGroup]) -> float:
    """Dollars the samplers spent on ``groups``: the sum of every segment's ``cost_usd``
    (each model call's share of its sampler's measured busy time x price)."""
    return float(sum(seg.cost_usd for g in groups for t in g.trajectories for seg in t.segments))


def batch_record(batch: Batch, step: int) -> dict[str, Any]:
    """A trained batch as JSON-able rows: each row's prompt ids (its context, never in
    the loss), the tokens in the loss (``loss_mask`` true) with their sampling versions,
    its advantage and the temperature it was scored at (None: not recorded, the
    trainer's own); and the model calls left out of it, by reason."""
    rows = []
    for b in range(batch.tokens.shape[0]):
        prompt = batch.prompt_ids[batch.prefix_index[b]][: batch.prompt_lengths[batch.prefix_index[b]]]
        mask = batch.loss_mask[b]
        temp = float(batch.row_temperature[b])  # NaN: the record had no sampling settings
        rows.append({"prompt_ids": prompt.tolist(), "loss_tokens": batch.tokens[b][mask].tolist(),
                     "versions": batch.versions[b][mask].tolist(), "advantage": float(batch.advantages[b]),
                     "trajectory": int(batch.row_trajectory[b]), "temperature": None if math.isnan(temp) else temp})
    return {"step": step, "rows": rows, "rewards": batch.rewards.tolist(), "excluded_rows": batch.excluded_rows}


class Trainer:
    """Buffer, counters and checkpoint files of one trainer incarnation, and its engine."""

    def __init__(self, cfg: TrainerConfig, state_dir: Path, run_id: str, *,
                 clock: Callable[[], float] = time.monotonic,
                 on_rank_restart: Callable[[str], None] | None = None) -> None:
        """`clock`: monotonic seconds for ``time_budget_s`` (the actor passes the
        kernel's ``ctx.clock``; tests pass a fake one). `on_rank_restart(reason)` is
        called (from the step's thread) before each restart of the rank group."""
        self.cfg = cfg
        self.clock = clock
        self.state_dir = Path(state_dir)
        self.run_id = run_id
        self.engine: Engine
        if cfg.ranks is None:
            self.engine = LocalEngine(cfg, self.state_dir, run_id)
        else:
            from .rank_engine import RankEngine

            self.engine = RankEngine(cfg, self.state_dir, run_id, on_restart=on_rank_restart)
        self.store = LocalDirStore(self.state_dir / "weights")
        self.buffer = RolloutBuffer(cfg.buffer)
        self.local = CheckpointStore(self.state_dir / "checkpoints", keep=2)
        self.metrics_path = self.state_dir / "metrics.jsonl"
        self.rollouts = None if cfg.rollout_log == 0 else RolloutLog(
            self.state_dir / "rollouts", keep=cfg.rollout_log, std_normalize=cfg.advantage.std_normalize,
            leave_one_out=cfg.advantage.leave_one_out)
        self.rollout_log_failure: str | None = None
        """The last error writing the rollout log (the actor logs it and clears it)."""
        self.step = 0
        self.task_cursor = 0
        self.resumed_from: str = "fresh"
        self._applied = False
        self._elapsed_before = 0.0  # seconds run by earlier incarnations (from the checkpoint)
        self._received = [0, 0]  # groups and generated tokens received since the last metrics line
        self._no_gradient: dict[str, int] = {}  # groups refused since then, by why
        self.daemon_checkpoint_due = False
        """Set by `train`: a daemon checkpoint is due after that step (``daemon_checkpoint_every``)."""
        self.last_alarms: list[Alarm] = []
        """The alarms of the last step (`alarms.step_alarms`; the actor reports them)."""
        self.halted: str | None = None
        """Set when a step raised a fatal alarm (every token masked): no more steps."""
        self._started = self.clock()

    # -- start ------------------------------------------------------------------------
    def start(self, restored: Any) -> None:
        """Restore the newest state (the daemon's checkpoint value ``restored`` or the
        trainer's own file) and publish the current weights as the next version."""
        candidates: list[tuple[tuple[int, int], str, ck.TrainerCheckpoint]] = []
        if restored is not None:
            c = ck.decode(restored if isinstance(restored, bytes) else msgspec.convert(restored, ck.TrainerCheckpoint))
            candidates.append(((c.step, c.task_cursor), "daemon checkpoint", c))
        local, _problems = self.local.load_latest()
        if local is not None and LOCAL_CKPT_KEY in local.actors:
            c = ck.decode(local.actors[LOCAL_CKPT_KEY])
            candidates.append(((c.step, c.task_cursor), "trainer checkpoint", c))
        best = None
        if candidates:
            _, where, best = max(candidates, key=lambda x: x[0])
            self.step, self.task_cursor, self.resumed_from = best.step, best.task_cursor, where
            self._elapsed_before = best.elapsed_s
        self.engine.start(best)  # restores model, optimizer, RNG; publishes the next version
        if best is not None:
            self.buffer.restore(best.buffer)
        self._started = self.clock()

    @property
    def version(self) -> int:
        """Newest published weight version."""
        return self.engine.version

    @property
    def digest(self) -> str | None:
        """Hex digest of that version."""
        return self.engine.digest

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def optimizer(self):
        """The in-process optimizer (`LocalEngine`; rank processes hold their own)."""
        return self.engine.optimizer  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop the engine (rank processes leave their group)."""
        self.engine.close()

    # -- training ---------------------------------------------------------------------
    def ready(self) -> bool:
        return len(self.buffer) >= self.cfg.groups_per_step and not self.done and self.halted is None

    @property
    def elapsed_s(self) -> float:
        """Wall-clock seconds this trainer has run, earlier incarnations included."""
        return self._elapsed_before + (self.clock() - self._started)

    def time_left_s(self) -> float | None:
        """Seconds of ``time_budget_s`` left (never negative), or None without one."""
        budget = self.cfg.time_budget_s
        return None if budget is None else max(0.0, budget - self.elapsed_s)

    def stop_reason(self) -> str | None:
        """Why the trainer takes no more steps (a budget is spent), or None."""
        c = self.cfg
        if c.max_steps is not None and self.step >= c.max_steps:
            return f"max_steps={c.max_steps} reached"
        if self.time_left_s() == 0.0:
            return f"time_budget_s={c.time_budget_s:g} spent at step {self.step}"
        return None

    @property
    def done(self) -> bool:
        return self.stop_reason() is not None

    def lr_now(self) -> float:
        """The learning rate of the next step (`fleetrl.actors.trainer.schedule`)."""
        c = self.cfg
        frac = None if c.time_budget_s is None else self.elapsed_s / c.time_budget_s
        return lr_at(self.step, lr=c.lr, schedule=c.lr_schedule, max_steps=c.max_steps,
                     warmup_steps=c.lr_warmup_steps, min_ratio=c.lr_min_ratio, time_fraction=frac)

    def take_and_train(self) -> tuple[StepMetrics | None, list[StaleGroup]]:
        """Take a batch from the buffer and train on it, as one unit: if the step fails
        before the weights change, the groups go back into the buffer (nothing lost)."""
        batch, expired = self.buffer.take(self.cfg.groups_per_step, self.version)
        if not batch:
            return None, expired
        self._applied = False
        try:
            return self.train(batch), expired
        except BaseException:
            if not self._applied:
                self.buffer.put_back(batch)
            raise

    def note_failed(self, msg: RolloutFailed) -> None:
        """An attempt failed: indexed in the rollout log."""
        if self.rollouts is not None:
            try:
                self.rollouts.failed(msg)
            except OSError as exc:
                self.rollout_log_failure = f"{type(exc).__name__}: {exc}"

    def note_received(self, group: RolloutGroup) -> None:
        """Count a group the actor received (any outcome) for the next metrics line."""
        self._received[0] += 1
        self._received[1] += sum(t.n_generated for t in group.trajectories)

    def note_no_gradient(self, why: str) -> None:
        """Count a received group that will carry no gradient (zero variance, stale,
        duplicate, malformed), for the next metrics line."""
        self._no_gradient[why] = self._no_gradient.get(why, 0) + 1

    def train(self, groups: Sequence[RolloutGroup]) -> StepMetrics:
        """One step on ``groups`` (already taken from the buffer); publish; log; checkpoint."""
        lr = self.lr_now()
        detail: list[RowDetail] | None = None if self.rollouts is None else []
        m = self.engine.train(groups, lr=lr, step=self.step, trainer_version=self.version, detail=detail)
        cost = batch_cost_usd(groups)
        m = msgspec.structs.replace(m, lr=lr, cost_usd=cost, elapsed_s=self.elapsed_s,
                                    usd_per_rollout=cost / m.trajectories if m.trajectories else 0.0,
                                    groups_received=self._received[0], tokens_received=self._received[1],
                                    groups_without_gradient=dict(self._no_gradient))
        self.last_alarms = step_alarms(m, self.cfg.alarms)
        if self.last_alarms:
            m = msgspec.structs.replace(m, alarms=tuple(a.kind for a in self.last_alarms))
        for a in self.last_alarms:
            if a.fatal and self.halted is None:
                self.halted = f"step {a.step}: {a.message}. Fix: {a.fix}"
        if m.skipped:
            m = msgspec.structs.replace(m, version=self.version)
        else:
            self._applied = True
            self.step = m.step
        with self.metrics_path.open("ab") as fh:
            fh.write(msgspec.json.encode(m) + b"\n")
        if self.rollouts is not None:
            try:
                self.rollouts.groups(groups, detail, step=m.step, version=m.version,
                                     skipped=m.skipped_reason if m.skipped else None)
            except OSError as exc:  # the log is for people: never fail a step over it
                self.rollout_log_failure = f"{type(exc).__name__}: {exc}"
        self._received = [0, 0]
        self._no_gradient = {}
        if not m.skipped and self.step <= self.cfg.record_batches:
            out = self.state_dir / "batches" / f"step-{self.step}.json"
            out.parent.mkdir(exist_ok=True)
            batch = build_batch(groups, self.cfg.advantage)
            out.write_bytes(msgspec.json.encode(batch_record(batch, self.step)))
        every = self.cfg.daemon_checkpoint_every
        # the actor asks the daemon for a checkpoint after this step (it holds this same
        # snapshot): the trainer's own file is written only when that one fails
        self.daemon_checkpoint_due = (not m.skipped and every is not None and self.step % every == 0
                                      and not self.done)
        if not m.skipped and self.step % self.cfg.checkpoint_every == 0 and not self.daemon_checkpoint_due:
            self.write_checkpoint()
        return m

    # -- checkpoints ------------------------------------------------------------------
    def snapshot(self) -> bytes:
        model = self.engine.capture(self.step)
        return ck.encode(ck.TrainerCheckpoint(
            step=self.step, version=self.version, buffer=self.buffer.snapshot(), task_cursor=self.task_cursor,
            elapsed_s=self.elapsed_s, **msgspec.structs.asdict(model)))

    def write_checkpoint(self) -> None:
        """Write the trainer's own atomic checkpoint (temp file, fsync, rename)."""
        self.local.write(self.run_id, {LOCAL_CKPT_KEY: self.snapshot()})

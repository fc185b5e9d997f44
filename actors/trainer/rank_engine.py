"""The trainer's model in supervised rank processes: `RankEngine` (an `engine.Engine`).

The engine keeps one `RankGroup` running and turns its failures into restarts:

- a rank that dies or hangs mid-request raises `RanksFailed`; the engine kills the whole
  group, waits the restart policy's backoff (``ranks.restart``; past its intensity the
  error escapes and the trainer actor fails, so the daemon's own policy takes over), starts
  a new group from the newest sharded checkpoint it wrote, *replays* the steps trained
  since that checkpoint (same groups, same learning rates, nothing published: on CPU the
  replay is bit-exact, on GPU equal to kernel nondeterminism), and then sends the
  interrupted request again. Every group therefore reaches the weights exactly once,
  and the version sequence goes on (the first version after a restart is a full anchor).
- a rank that dies between requests is found by ``check()`` (the trainer actor calls it
  every ``ranks.watch_interval_s``) and restarted the same way;
- ``capture(step)`` asks the ranks for a sharded checkpoint at ``step`` (unless one was
  just written), which also empties the replay log.
- A request that fails on every rank alike before any collective (`BadBatch`) is raised
  as such; the group stays up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec

from fleetrl.daemon.messages import RolloutGroup
from fleetrl.daemon.restart import RestartTracker

from . import checkpoint as ck
from .config import TrainerConfig
from .engine import ModelState
from .errors import BadBatch, RanksFailed, RankStepError
from .rank_group import RankGroup
from .rank_protocol import RankError, Ready, Save, Saved, Start, Train, Trained
from .step import RowDetail, StepMetrics

__all__ = ["RankEngine", "RanksStatus"]

SHARDED_FINGERPRINT = "sharded"
"""`TrainerCheckpoint.fingerprint` of a sharded checkpoint: the model check happens when
torch.distributed.checkpoint loads it (a mismatched model fails there, named)."""


class RanksStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The rank group as /status shows it."""

    world_size: int
    pids: list[int]
    restarts: int
    """Rank-group restarts since the trainer actor started."""
    last_failure: str | None
    checkpoint_step: int | None
    """Step of the newest sharded checkpoint (where a restart resumes)."""
    replay_steps: int
    """Steps trained since that checkpoint (replayed after a restart)."""


class RankEngine:
    """See the module docstring."""

    def __init__(self, cfg: TrainerConfig, state_dir: Path, run_id: str, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 on_restart: Callable[[str], None] | None = None) -> None:
        if cfg.ranks is None:
            raise ValueError("RankEngine needs TrainerConfig.ranks")
        self.cfg = cfg
        self.state_dir = Path(state_dir)
        self.run_id = run_id
        self.clock, self.sleep, self.on_restart = clock, sleep, on_restart
        self.tracker = RestartTracker(cfg.ranks.restart)
        self.group: RankGroup | None = None
        self.pids: list[int] = []
        self.vocab_size = 0
        self.version = -1
        self.digest: str | None = None
        self.restarts = 0
        self.last_failure: str | None = None
        self.saved: tuple[int, str] | None = None  # (step, directory name) of the newest sharded checkpoint
        self.replay: list[Train] = []

    # -- engine -----------------------------------------------------------------------
    def start(self, ckpt: ck.TrainerCheckpoint | None) -> None:
        if ckpt is not None:
            if ckpt.sharded is None:
                raise ck.CheckpointError(
                    f"trainer checkpoint at step {ckpt.step} holds an in-process model; rank processes resume "
                    "only from sharded checkpoints (start a new state dir, or run without [ranks])")
            if not (self.state_dir / "sharded" / ckpt.sharded).is_dir():
                raise ck.CheckpointError(f"trainer checkpoint at step {ckpt.step} names the sharded checkpoint "
                                         f"{ckpt.sharded}, which is not in {self.state_dir / 'sharded'}")
            self.saved = (ckpt.step, ckpt.sharded)
        ready = self._launch(Start(resume=None if self.saved is None else self.saved[1], publish=True))
        self.version = -1 if ready.version is None else ready.version
        self.digest = ready.digest

    def train(self, groups: Sequence[RolloutGroup], *, lr: float, step: int, trainer_version: int,
              detail: list[RowDetail] | None = None) -> StepMetrics:
        req = Train(step=step, lr=lr, trainer_version=trainer_version, groups=list(groups), detail=detail is not None)
        reply = self._request(req, f"step {step + 1}")
        if not isinstance(reply, Trained):
            raise RankStepError(f"rank 0 answered a step with {type(reply).__name__}")
        m = msgspec.msgpack.decode(reply.metrics, type=StepMetrics)
        if detail is not None and reply.detail:
            detail.extend(msgspec.msgpack.decode(reply.detail, type=list[RowDetail]))
        if not m.skipped:
            self.replay.append(msgspec.structs.replace(req, detail=False))
            self.version = m.version
            self.digest = reply.digest
        return m

    def capture(self, step: int) -> ModelState:
        if self.saved is None or self.saved[0] != step:
            reply = self._request(Save(step=step), f"checkpoint at step {step}")
            if not isinstance(reply, Saved):
                raise RankStepError(f"rank 0 answered a checkpoint with {type(reply).__name__}")
            self.saved = (step, reply.path)
            self.replay = [r for r in self.replay if r.step >= step]
        return ModelState(fingerprint=SHARDED_FINGERPRINT, sharded=self.saved[1])

    def check(self) -> bool:
        """Restart the group now if a rank has died while idle; True if it restarted."""
        why = None if self.group is None else self.group.dead()
        if why is None:
            return False
        self._recover(f"{why} while idle (logs: {self.group.log_dir})")
        return True

    def close(self) -> None:
        if self.group is not None:
            self.group.stop()
            self.group = None

    def status(self) -> RanksStatus:
        assert self.cfg.ranks is not None
        return RanksStatus(world_size=self.cfg.ranks.world_size, pids=list(self.pids), restarts=self.restarts,
                           last_failure=self.last_failure,
                           checkpoint_step=None if self.saved is None else self.saved[0],
                           replay_steps=len(self.replay))

    # -- internals --------------------------------------------------------------------
    def _launch(self, start: Start) -> Ready:
        group = RankGroup(self.cfg, self.state_dir, self.run_id)
        ready = group.start(start)
        self.group, self.pids, self.vocab_size = group, list(ready.pids), ready.vocab_size
        return ready

    def _request(self, msg, what: str):
        """Send ``msg``; on a rank failure restart the group (backoff, replay) and send it again."""
        while True:
            if self.group is None:
                raise RanksFailed("the rank group is not running")
            try:
                reply = self.group.request(msg, what)
            except RanksFailed as exc:
                self._recover(str(exc))
                continue
            if isinstance(reply, RankError):
                if reply.kind == "BadBatch" and not reply.fatal:
                    raise BadBatch(reply.error)
                if not reply.fatal:
                    raise RankStepError(reply.error)
                dead = self.group.dead_within(2.0)
                self.group.kill()
                cause = f"{dead} during {what}; rank 0 reported: " if dead else f"{what} failed on the ranks: "
                self._recover(cause + reply.error)
                continue
            return reply

    def _recover(self, why: str) -> None:
        """Restart the group from the newest sharded checkpoint and replay the steps since."""
        while True:
            if self.group is not None:
                self.group.kill()
                self.group = None
            self.restarts += 1
            self.last_failure = why
            if self.on_restart is not None:
                self.on_restart(why)
            delay = self.tracker.crash(self.clock())
            if delay is None:
                p = self.tracker.policy
                raise RanksFailed(f"the trainer's rank group failed more than {p.intensity} times within "
                                  f"{p.period_s:g} s; last: {why}")
            self.sleep(delay)
            try:
                self._launch(Start(resume=None if self.saved is None else self.saved[1], publish=False))
                for req in self.replay:
                    assert self.group is not None
                    reply = self.group.request(msgspec.structs.replace(req, publish=False),
                                               f"replay of step {req.step + 1}")
                    if not isinstance(reply, Trained):
                        raise RanksFailed(f"replay of step {req.step + 1} answered {type(reply).__name__}")
                return
            except RanksFailed as exc:
                why = str(exc)

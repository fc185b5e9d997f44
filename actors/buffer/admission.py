"""Rollout buffer: staleness admission, zero-variance skipping, dedup, bounded capacity.

Pure logic, no I/O and no clock: the trainer actor owns one `RolloutBuffer` and calls it
between train steps.

Policy (docs/reference/trainer.md has the longer version):

* **Staleness.** A group's staleness is ``trainer_version - oldest_version``, where
  ``oldest_version`` is the oldest weight version that produced any of its tokens. A
  group is admitted only if that is ``<= max_staleness``. A group that would be too
  stale is *not* silently dropped: `offer` returns a `StaleGroup` (a typed rejection
  naming the task, the versions and the bound), which the actor counts and forwards to
  the sampler pool so it can re-queue the task and slow down (the pool's own pacer
  should make this rare). A queued group can also go stale while it waits (the trainer
  advanced); `take` re-checks and reports those as `StaleGroup(reason="expired")`
  instead of training on them. So the bound holds at *training* time, not only at
  admission.
* **Zero variance.** A group whose rewards are all equal has zero GRPO advantage and
  would only cost compute (and, with weight decay, still move the weights). With
  ``skip_zero_variance`` it is skipped and counted (`ZeroVariance`).
* **Exactly once.** A group id that is queued or was already trained is refused as a
  `Duplicate` (e.g. a producer re-sends after a restart). The ids of trained groups are
  part of the checkpoint, so this holds across crashes.
* **Bounded.** At most ``capacity`` groups are queued; `offer` on a full buffer raises
  `BufferFull` and leaves the group with the caller (the actor simply stops reading its
  bounded inbox, which blocks the producers: backpressure, nothing lost).
* **Checkpointable.** `snapshot` / `restore` round-trip the queued groups, the trained
  ids, the counters and the staleness histogram.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Annotated, Literal

import msgspec

from fleetrl.daemon.messages import RolloutGroup

from .errors import BadGroup, BufferFull

__all__ = [
    "Admitted",
    "BufferConfig",
    "BufferCounters",
    "BufferState",
    "Duplicate",
    "Outcome",
    "RolloutBuffer",
    "StaleGroup",
    "ZeroVariance",
    "staleness_of",
]


class BufferConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Admission rules of the rollout buffer."""

    max_staleness: Annotated[int, msgspec.Meta(ge=0)] = 2
    """Largest admitted ``trainer_version - oldest token version`` (0: strictly on-policy)."""
    capacity: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 256
    """Most groups queued at once; a full buffer pushes back on its producers."""
    skip_zero_variance: bool = True
    """Skip (and count) groups whose rewards are all equal: their advantages are zero."""

    def __post_init__(self) -> None:
        for name in ("max_staleness", "capacity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"BufferConfig.{name} must be an int, got {value!r}")
        if self.max_staleness < 0:
            raise ValueError(f"BufferConfig.max_staleness must be >= 0, got {self.max_staleness}")
        if self.capacity < 1:
            raise ValueError(f"BufferConfig.capacity must be >= 1, got {self.capacity}")


class Admitted(msgspec.Struct, frozen=True, tag=True):
    """The group is queued for training."""

    group_id: str
    staleness: int


class StaleGroup(msgspec.Struct, frozen=True, tag=True):
    """Typed rejection: the group is (or became) older than ``max_staleness`` allows.

    Sent to the sampler pool so it can re-queue ``task_id`` and pace sampling.
    ``reason`` is ``"too_stale"`` at admission, ``"expired"`` when it went stale in
    the queue because the trainer advanced.
    """

    group_id: str
    task_id: str
    oldest_version: int
    trainer_version: int
    max_staleness: int
    reason: Literal["too_stale", "expired"] = "too_stale"

    @property
    def staleness(self) -> int:
        return self.trainer_version - self.oldest_version


class ZeroVariance(msgspec.Struct, frozen=True, tag=True):
    """Skipped: every attempt got the same reward (zero advantage)."""

    group_id: str
    task_id: str
    reward: float


class Duplicate(msgspec.Struct, frozen=True, tag=True):
    """Refused: a group with this id is queued or was already trained."""

    group_id: str
    trained: bool


Outcome = Admitted | StaleGroup | ZeroVariance | Duplicate


class BufferCounters(msgspec.Struct, kw_only=True):
    """Running totals (checkpointed)."""

    offered: int = 0
    admitted: int = 0
    stale: int = 0
    expired: int = 0
    zero_variance: int = 0
    duplicate: int = 0
    trained: int = 0


class BufferState(msgspec.Struct, frozen=True, kw_only=True):
    """Everything `RolloutBuffer.restore` needs: queued groups in order, trained ids,
    counters and the staleness histogram of admitted groups."""

    queued: tuple[RolloutGroup, ...] = ()
    trained_ids: tuple[str, ...] = ()
    counters: BufferCounters = msgspec.field(default_factory=BufferCounters)
    staleness_hist: dict[int, int] = {}


def staleness_of(group: RolloutGroup, trainer_version: int) -> int:
    """``trainer_version - oldest token version`` (0 for a group without tokens)."""
    oldest = group.oldest_version
    return 0 if oldest is None else trainer_version - oldest


class RolloutBuffer:
    """Queued rollout groups awaiting training; see the module docstring for the policy."""

    def __init__(self, cfg: BufferConfig, state: BufferState | None = None) -> None:
        self.cfg = cfg
        self._queue: OrderedDict[str, RolloutGroup] = OrderedDict()
        self._trained: set[str] = set()
        self.counters = BufferCounters()
        self.staleness_hist: dict[int, int] = {}
        if state is not None:
            self.restore(state)

    # -- queries --------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._queue)

    @property
    def has_room(self) -> bool:
        return len(self._queue) < self.cfg.capacity

    @property
    def queued_ids(self) -> tuple[str, ...]:
        return tuple(self._queue)

    def was_trained(self, group_id: str) -> bool:
        return group_id in self._trained

    # -- admission ------------------------------------------------------------------
    def offer(self, group: RolloutGroup, trainer_version: int) -> Outcome:
        """Judge ``group`` against the trainer's current version; queue it if admitted.

        Raises `BufferFull` (group not taken) when the buffer is full, and `BadGroup`
        when the group holds tokens of a version newer than ``trainer_version``.
        """
        gid = group.group_id
        if gid in self._trained or gid in self._queue:
            self.counters.offered += 1
            self.counters.duplicate += 1
            return Duplicate(group_id=gid, trained=gid in self._trained)
        oldest = group.oldest_version
        staleness = staleness_of(group, trainer_version)
        if staleness < 0:
            raise BadGroup(
                f"group {gid!r} of task {group.task_id!r} has tokens of weight version {oldest}, "
                f"newer than the trainer's version {trainer_version}"
            )
        if staleness > self.cfg.max_staleness:
            self.counters.offered += 1
            self.counters.stale += 1
            return StaleGroup(group_id=gid, task_id=group.task_id, oldest_version=int(oldest),
                              trainer_version=trainer_version, max_staleness=self.cfg.max_staleness)
        rewards = group.rewards
        if self.cfg.skip_zero_variance and all(r == rewards[0] for r in rewards):
            self.counters.offered += 1
            self.counters.zero_variance += 1
            return ZeroVariance(group_id=gid, task_id=group.task_id,
                                reward=float(rewards[0]) if rewards else 0.0)
        if not self.has_room:
            raise BufferFull(f"rollout buffer is full ({self.cfg.capacity} groups); "
                             f"group {gid!r} was not taken")
        self.counters.offered += 1
        self.counters.admitted += 1
        self._queue[gid] = group
        self.staleness_hist[staleness] = self.staleness_hist.get(staleness, 0) + 1
        return Admitted(group_id=gid, staleness=staleness)

    def expire(self, trainer_version: int) -> list[StaleGroup]:
        """Remove and report queued groups that became too stale at ``trainer_version``."""
        out = []
        for gid, group in list(self._queue.items()):
            if staleness_of(group, trainer_version) > self.cfg.max_staleness:
                del self._queue[gid]
                self.counters.expired += 1
                out.append(StaleGroup(group_id=gid, task_id=group.task_id,
                                      oldest_version=int(group.oldest_version),
                                      trainer_version=trainer_version,
                                      max_staleness=self.cfg.max_staleness, reason="expired"))
        return out

    def take(self, n: int, trainer_version: int) -> tuple[list[RolloutGroup], list[StaleGroup]]:
        """Expire stale groups, then pop the ``n`` oldest if at least ``n`` remain.

        Returns ``(batch, expired)``; ``batch`` is empty when fewer than ``n`` are
        queued. Popped groups are recorded as trained (never admitted again): the
        caller trains them before anything can observe the buffer (the trainer holds
        its step lock), or crashes, in which case the checkpoint still holds them.
        """
        if n < 1:
            raise ValueError(f"take needs n >= 1, got {n}")
        expired = self.expire(trainer_version)
        if len(self._queue) < n:
            return [], expired
        batch = [self._queue.popitem(last=False)[1] for _ in range(n)]
        for g in batch:
            self._trained.add(g.group_id)
        self.counters.trained += n
        return batch, expired

    def put_back(self, batch: list[RolloutGroup]) -> None:
        """Undo `take` for a batch whose step failed before changing the weights: the
        groups go back to the front of the queue, in order, and are no longer trained."""
        for g in reversed(batch):
            self._trained.discard(g.group_id)
            self._queue[g.group_id] = g
            self._queue.move_to_end(g.group_id, last=False)
        self.counters.trained -= len(batch)

    # -- checkpoint -----------------------------------------------------------------
    def snapshot(self) -> BufferState:
        return BufferState(
            queued=tuple(self._queue.values()),
            trained_ids=tuple(sorted(self._trained)),
            counters=msgspec.structs.replace(self.counters),
            staleness_hist=dict(self.staleness_hist),
        )

    def restore(self, state: BufferState) -> None:
        self._queue = OrderedDict((g.group_id, g) for g in state.queued)
        self._trained = set(state.trained_ids)
        self.counters = msgspec.structs.replace(state.counters)
        self.staleness_hist = dict(state.staleness_hist)

"""Collecting the G attempts of one task into a group (pure; no I/O).

A `GroupTracker` hands out `AttemptTicket`s, one per slot at first and one more for
every retry, and is told how each ticket ended: `scored` (a `Trajectory`), `failed`
(a failure kind; the `RetryPolicy` decides whether the slot gets a new ticket) or
`abandon`ed (shutdown: never retried). Every ticket ends exactly once; a second
ending, or an ending for a ticket it never issued, raises `GroupStateError`. So every
attempt ends up in exactly one of: a scored trajectory, a retried failure, or a final
(reported) failure.

The group is complete when every slot has ended for good (scored, or failed with no
retry left, or abandoned). Only then is its `GroupResult` available:

* ``group``: the `RolloutGroup` of the scored trajectories in slot order, when no slot
  was abandoned and at most ``policy.failed_allowed(G)`` slots failed;
* otherwise ``group`` is None and the group is *incomplete*; ``unused`` holds its
  scored trajectories (reported, not trained on) and ``abandoned`` says whether
  shutdown cut it short (the worker then leaves the task to be run again).
"""

from __future__ import annotations

import msgspec

from fleetrl.daemon.messages import RolloutFailed, RolloutGroup, Trajectory

from .errors import GroupStateError
from .policy import RetryPolicy

__all__ = ["AttemptTicket", "GroupResult", "GroupStateError", "GroupTracker"]


class AttemptTicket(msgspec.Struct, frozen=True, kw_only=True):
    """One try at one slot of a group."""

    group_id: str
    task_id: str
    slot: int
    try_no: int

    @property
    def attempt_id(self) -> str:
        return f"{self.group_id}/{self.slot}.{self.try_no}"


class GroupResult(msgspec.Struct, frozen=True, kw_only=True):
    """How a group ended (see the module docstring)."""

    group_id: str
    task_id: str
    group: RolloutGroup | None
    failures: tuple[RolloutFailed, ...]
    """The final failure of each failed slot (already sent when it happened)."""
    retried: tuple[RolloutFailed, ...]
    """Failures that were retried (already sent when they happened)."""
    unused: tuple[Trajectory, ...] = ()
    """Scored trajectories of an incomplete group."""
    abandoned: bool = False

    @property
    def complete(self) -> bool:
        return self.group is not None


class GroupTracker:
    """Bookkeeping of one group's attempts (see the module docstring)."""

    def __init__(self, *, group_id: str, task_id: str, group_size: int, policy: RetryPolicy) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_id = group_id
        self.task_id = task_id
        self.group_size = group_size
        self.policy = policy
        self._open: dict[str, AttemptTicket] = {}
        self._scored: dict[int, Trajectory] = {}
        self._final: dict[int, RolloutFailed] = {}
        self._retried: list[RolloutFailed] = []
        self._abandoned = False
        self._issued = 0

    # -- tickets --------------------------------------------------------------------------
    def _issue(self, slot: int, try_no: int) -> AttemptTicket:
        t = AttemptTicket(group_id=self.group_id, task_id=self.task_id, slot=slot, try_no=try_no)
        self._open[t.attempt_id] = t
        self._issued += 1
        return t

    def start(self) -> list[AttemptTicket]:
        """The first ticket of every slot (call once)."""
        if self._issued:
            raise GroupStateError(f"group {self.group_id}: start() called twice")
        return [self._issue(slot, 1) for slot in range(self.group_size)]

    def _take(self, ticket: AttemptTicket) -> None:
        if self._open.pop(ticket.attempt_id, None) is None:
            raise GroupStateError(f"group {self.group_id}: attempt {ticket.attempt_id} is not in flight "
                                  "(ended twice, or never issued)")

    # -- endings --------------------------------------------------------------------------
    def scored(self, ticket: AttemptTicket, trajectory: Trajectory) -> None:
        """`ticket` produced `trajectory` (which must carry its ids)."""
        if (trajectory.attempt_id, trajectory.group_id, trajectory.task_id) != (
                ticket.attempt_id, self.group_id, self.task_id):
            raise GroupStateError(
                f"group {self.group_id}: trajectory of attempt {trajectory.attempt_id!r} (group "
                f"{trajectory.group_id!r}, task {trajectory.task_id!r}) reported for {ticket.attempt_id}")
        self._take(ticket)
        self._scored[ticket.slot] = trajectory

    def failed(self, ticket: AttemptTicket, kind: str, detail: str) -> tuple[RolloutFailed, AttemptTicket | None]:
        """`ticket` failed with `kind`: its `RolloutFailed` message, and the slot's next
        ticket when the policy retries it (None: the slot has failed for good)."""
        decision = self.policy.decide(kind, ticket.try_no)  # validates kind first
        self._take(ticket)
        retry = decision == "retry" and not self._abandoned
        note = (f" (try {ticket.try_no}; retrying)" if retry
                else f" (try {ticket.try_no}; giving up on slot {ticket.slot})")
        msg = RolloutFailed(attempt_id=ticket.attempt_id, task_id=self.task_id, reason=kind,  # type: ignore[arg-type]
                            detail=detail + note, group_id=self.group_id)
        if retry:
            self._retried.append(msg)
            return msg, self._issue(ticket.slot, ticket.try_no + 1)
        self._final[ticket.slot] = msg
        return msg, None

    def abandon(self, ticket: AttemptTicket, detail: str) -> RolloutFailed:
        """`ticket` was cut short by shutdown: a final ``timeout`` failure, never retried;
        the group can no longer be emitted."""
        self._take(ticket)
        self._abandoned = True
        msg = RolloutFailed(attempt_id=ticket.attempt_id, task_id=self.task_id, reason="timeout",
                            detail=f"abandoned at shutdown: {detail}", group_id=self.group_id)
        self._final[ticket.slot] = msg
        return msg

    # -- state ----------------------------------------------------------------------------
    @property
    def in_flight(self) -> tuple[AttemptTicket, ...]:
        return tuple(self._open.values())

    @property
    def done(self) -> bool:
        return not self._open and len(self._scored) + len(self._final) == self.group_size

    @property
    def issued(self) -> int:
        """Tickets issued so far (first tries and retries)."""
        return self._issued

    def result(self) -> GroupResult:
        """The group's outcome; only once `done`."""
        if not self.done:
            raise GroupStateError(f"group {self.group_id}: {len(self._open)} attempt(s) still in flight, "
                                  f"{self.group_size - len(self._scored) - len(self._final)} slot(s) open")
        failures = tuple(self._final[s] for s in sorted(self._final))
        scored = tuple(self._scored[s] for s in sorted(self._scored))
        ok = not self._abandoned and len(failures) <= self.policy.failed_allowed(self.group_size) and scored
        if ok:
            group = RolloutGroup(group_id=self.group_id, task_id=self.task_id, trajectories=scored)
            return GroupResult(group_id=self.group_id, task_id=self.task_id, group=group, failures=failures,
                               retried=tuple(self._retried))
        return GroupResult(group_id=self.group_id, task_id=self.task_id, group=None, failures=failures,
                           retried=tuple(self._retried), unused=scored, abandoned=self._abandoned)

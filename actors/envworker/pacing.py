"""Pacing an environment worker's groups through the sampler pool's staleness pacer.

A group's G slots are admitted by the pool's pacer (`fleetrl.actors.pool.pacing`),
consecutively, before its attempts start; they are always finished in the pacer when
the group ends (cancellation included); groups are sent in the pool's release order
(admission order), the order the pacer's bound assumes (docs/reference/envworkers.md).
"""

from __future__ import annotations

from typing import Any

import trio

from fleetrl.daemon.messages import RolloutGroup

__all__ = ["GroupPacing", "Paced"]


class Paced:
    """A group's slots in the pool's pacer: admitted ids, what to send on release."""

    def __init__(self, group_id: str) -> None:
        self.group_id = group_id
        self.admitted: list[str] = []
        self.left = -1  # slots not yet released (set when they are finished)
        self.group: RolloutGroup | None = None
        self.released = trio.Event()


class GroupPacing:
    """One worker's groups in one pool's pacer (see the module docstring).

    ``scopes``: the worker's set of cancel scopes that its drain deadline cancels (an
    admission wait is cut short by it)."""

    def __init__(self, pool: Any, *, group_size: int, skips_zero_variance: bool,
                 scopes: set[trio.CancelScope]) -> None:
        self.pool = pool
        self.group_size = group_size
        self.skips_zero_variance = skips_zero_variance
        self.scopes = scopes
        self.admit_lock = trio.Lock()
        self.awaiting: dict[str, Paced] = {}

    async def admit(self, paced: Paced) -> bool:
        """Admit the group's G slots through the pool's pacer, one after another (so its
        slots hold consecutive places in the release order). False: the drain deadline
        cut the wait short (what was admitted is finished as failed by the caller; the
        worker also cancels the wait itself when the drain begins)."""
        self.awaiting[paced.group_id] = paced
        scope = trio.CancelScope()
        self.scopes.add(scope)
        try:
            with scope:
                async with self.admit_lock:
                    for slot in range(self.group_size):
                        pid = f"{paced.group_id}/{slot}"
                        await self.pool.admit(pid)
                        paced.admitted.append(pid)
        finally:
            self.scopes.discard(scope)
        return len(paced.admitted) == self.group_size

    def finish_paced(self, paced: Paced, group: RolloutGroup | None) -> None:
        """End every admitted slot of the group in the pacer, always (cancellation too).
        The slots count as training slots only when the trainer will train the group: it
        is emitted, and not a zero-variance group the trainer skips."""
        paced.group = group
        counts = group is not None and not (self.skips_zero_variance and len(set(group.rewards)) == 1)
        paced.left = len(paced.admitted)
        if not paced.admitted:
            self.awaiting.pop(paced.group_id, None)
            paced.released.set()
        for pid in paced.admitted:
            self.pool.finish(pid, paced.group_id, failed=not counts)

    async def release_in_order(self, out: Any) -> None:
        """Consume the pool's release stream (admission order) and send each group when
        all its slots are released: the trainer receives groups in admission order,
        which is the order the pacer's bound assumes."""
        while True:
            for adm, group_id, _failed in await self.pool.released():
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
                        await out.send(paced.group)
                    paced.released.set()

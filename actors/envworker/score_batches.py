"""Scoring programs of several groups in one lease and one engine exec.

A `GroupScorer` scores one group (one task) with one ``exec_many``. Each engine exec
costs the host ~75 ms of dockerd/containerd/runc CPU and the batch runner a Python
start-up, whatever the batch holds; with small groups of cheap checkers that fixed cost
is about half of all scoring CPU (docs/reference/envworkers.md, "Scoring several groups at once").
`ScoreBatcher` lets the groups of one worker share it: each group's programs are a
*job*; jobs with the same image and limits are run back to back in one ``exec_many``
(the runner resets the sandbox before every program, docs/reference/sandboxes.md "Batches"), and
each job gets its own results back, in order.

When a batch runs (no timer task; the waiting jobs' own tasks do it):

* as soon as ``max_groups`` jobs of one key are queued, or
* when the oldest queued job has waited ``linger_s`` (a lone group is not held longer),

and only while fewer than ``slots`` batches run; jobs queue meanwhile, so under load
batches fill up by themselves. The job whose turn it is runs the batch in its own task
(a *leader*), taking up to ``max_groups`` of the oldest queued jobs of its key.

Failures: a lease or engine error (`SandboxError`) is every job's error in that batch.
If the leader is cancelled (the worker abandons its attempts at the drain deadline),
the other jobs of its batch get a `SandboxError` saying so. A job cancelled while
queued leaves the queue; one cancelled while its batch runs only drops its results.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import trio

from fleetrl.sandboxes import ExecSpec, SandboxError

__all__ = ["ScoreBatcher"]


class _Job:
    __slots__ = ("specs", "deadline", "taken", "done", "results", "error")

    def __init__(self, specs: Sequence[ExecSpec], deadline: float) -> None:
        self.specs = list(specs)
        self.deadline = deadline
        self.taken = False
        self.done = trio.Event()
        self.results: list[Any] | None = None
        self.error: BaseException | None = None


class ScoreBatcher:
    """Shares leases and engine execs between the scoring jobs of several groups."""

    def __init__(self, pool: Any, *, max_groups: int, linger_s: float, slots: int,
                 on_batch: Callable[[int], None] | None = None) -> None:
        if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < 1:
            raise ValueError(f"max_groups must be an int >= 1, got {max_groups!r}")
        if not isinstance(linger_s, (int, float)) or isinstance(linger_s, bool) or not 0 <= linger_s < float("inf"):
            raise ValueError(f"linger_s must be a finite number >= 0, got {linger_s!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int >= 1, got {slots!r}")
        self._pool = pool
        self._on_batch = on_batch
        self._max = max_groups
        self._linger = float(linger_s)
        self._slots = trio.Semaphore(slots)
        self._queued: dict[Hashable, list[_Job]] = {}
        self._arrived: dict[Hashable, trio.Event] = {}
        self.batches_run = 0
        """Batches started so far (a count, not a list: the batcher lives as long as the
        daemon; `on_batch` receives each batch's size)."""
        self.jobs_run = 0
        """Jobs (groups) those batches carried."""

    async def exec_many(self, image: str, limits: Any, specs: Sequence[ExecSpec]) -> list[Any]:
        """Run ``specs`` (one group's programs) in a batch with other groups' jobs of the
        same image and limits; returns their `ExecResult`s in order. Raises
        `SandboxError` when the batch's lease or exec failed."""
        if not specs:
            return []
        key = (image, limits)
        job = _Job(specs, trio.current_time() + self._linger)
        queue = self._queued.setdefault(key, [])
        queue.append(job)
        self._arrived.pop(key, trio.Event()).set()  # wake the jobs waiting for company
        try:
            while not job.taken:
                await self._wait_for_company(key, queue, job)
                if job.taken:
                    break
                async with self._slots:
                    if job.taken:
                        break
                    batch = queue[: self._max]  # the oldest first; ours may have to wait for the next
                    del queue[: self._max]
                    for j in batch:
                        j.taken = True
                    self._arrived.pop(key, trio.Event()).set()  # their waiters stop waiting for company
                    await self._run(image, limits, batch)
            await job.done.wait()
        finally:
            if not job.taken:
                queue.remove(job)
            if not queue and self._queued.get(key) is queue:
                del self._queued[key]
        if job.error is not None:
            raise job.error
        assert job.results is not None
        return job.results

    async def _wait_for_company(self, key: Hashable, queue: list[_Job], job: _Job) -> None:
        """Until the job is taken, ``max_groups`` jobs are queued, or the job's linger ends."""
        with trio.move_on_at(job.deadline):
            while not job.taken and len(queue) < self._max:
                event = self._arrived.setdefault(key, trio.Event())
                await event.wait()

    async def _run(self, image: str, limits: Any, batch: list[_Job]) -> None:
        """Lease, run every job's programs in one ``exec_many``, hand each job its results."""
        self.batches_run += 1
        self.jobs_run += len(batch)
        if self._on_batch is not None:
            self._on_batch(len(batch))
        specs = [s for j in batch for s in j.specs]
        try:
            async with self._pool.lease(image, limits) as sb:
                results = await sb.exec_many(specs, final=True)
            if len(results) != len(specs):
                raise SandboxError(f"exec_many returned {len(results)} results for {len(specs)} programs")
        except SandboxError as exc:
            for j in batch:
                j.error = exc
        except BaseException as exc:
            for j in batch:
                j.error = SandboxError(f"the scoring batch this group shared ended early: {type(exc).__name__}")
            raise
        else:
            at = 0
            for j in batch:
                j.results = list(results[at: at + len(j.specs)])
                at += len(j.specs)
        finally:
            for j in batch:
                j.done.set()

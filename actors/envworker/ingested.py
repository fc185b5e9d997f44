"""The ``ingested`` task source: tasks accepted by the ingest actor while the daemon runs,
first, then (optionally) a base source's.

The worker's cursor counts task numbers and checkpoints which are finished, so task
number i must name the same task after a restart. This source therefore decides each
number once and writes the decision down before the task runs: the schedule
``<state>/actors/WORKER/ingested-schedule.jsonl`` holds one line per decided number,
``{"i": N, "key": SHA}`` (the ingested task with that store key) or ``{"i": N, "base":
B}`` (task B of the base source), appended and fsync-ed. A number already in the
schedule always gives its recorded task; a new number gives

1. the oldest ingested task not yet scheduled (store order), if any: ingested tasks
   take priority over the base source's next task, so a task posted while a run goes is
   taken at the worker's next free group slot;
2. else the base source's next task (B = one past the last base task scheduled, or the
   number minus the ingested tasks scheduled, whichever is larger, so a run that
   switches to this source continues its base numbering);
3. else (no base, or the base is exhausted) nothing yet: `wait_get` polls the store
   every ``poll_s`` until an ingested task arrives (the worker stops waiting when the
   daemon drains).

Each ingested task runs once per worker (one group). The store is tailed
(`fleetrl.actors.ingest.store.StoreReader`): at start it is read whole, so every task
accepted before a crash is scheduled after it. Blocking file I/O happens in
`resolve`; `wait_get` runs it in a worker thread.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import trio

from fleetrl.daemon.files import fsync_dir
from fleetrl.harness.tasks import Task

__all__ = ["IngestedSource", "Schedule", "ScheduleEntry"]


class ScheduleEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One decided task number: an ingested task (``key``) or a base task (``base``)."""

    i: int
    key: str | None = None
    base: int | None = None


class Schedule:
    """Task number -> decision (pure). Later entries for a number replace earlier ones."""

    def __init__(self, entries: list[ScheduleEntry] | None = None) -> None:
        self.entries: dict[int, ScheduleEntry] = {}
        self.keys: set[str] = set()
        self.last_base = -1
        for e in entries or []:
            self.add(e)

    def add(self, entry: ScheduleEntry) -> None:
        self.entries[entry.i] = entry
        if entry.key is not None:
            self.keys.add(entry.key)
        if entry.base is not None:
            self.last_base = max(self.last_base, entry.base)

    def next_base(self, i: int) -> int:
        """The base task number for a new task number ``i``."""
        return max(self.last_base + 1, i - len(self.keys))


class IngestedSource:
    """Numbered tasks: ingested ones first, then the base source's (module docstring)."""

    def __init__(self, store_dir: str | os.PathLike[str], schedule_path: str | os.PathLike[str], *,
                 base: Any = None, poll_s: float = 1.0, log: Any = None) -> None:
        from fleetrl.actors.ingest.store import StoreReader  # the ingest actor's package

        self.store_dir = Path(store_dir)
        self.reader = StoreReader(self.store_dir)
        self.schedule_path = Path(schedule_path)
        self.base = base
        self.poll_s = poll_s
        self.log = log
        self.tasks: dict[str, Task] = {}
        self.pending: list[str] = []
        self.schedule = Schedule(self._load_schedule())
        self.describe = f"ingested({self.store_dir})" + (f" then {base.describe}" if base is not None else "")
        self._refresh()

    # -- files -------------------------------------------------------------------------------
    def _load_schedule(self) -> list[ScheduleEntry]:
        try:
            data = self.schedule_path.read_bytes()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        if end < len(data):  # cut by a crash before its fsync returned: that number was never run
            with open(self.schedule_path, "r+b") as fh:
                fh.truncate(end)
                os.fsync(fh.fileno())
        out = []
        for n, raw in enumerate(data[:end].splitlines(), start=1):
            try:
                out.append(msgspec.json.decode(raw, type=ScheduleEntry))
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                if self.log is not None:
                    self.log.warning("schedule line skipped", file=str(self.schedule_path), line=n, error=str(err))
        return out

    def _record(self, entry: ScheduleEntry) -> None:
        new = not self.schedule_path.exists()
        self.schedule_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.schedule_path, "ab") as fh:
            fh.write(msgspec.json.encode(entry) + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        if new:
            fsync_dir(self.schedule_path.parent)
        self.schedule.add(entry)

    def _refresh(self) -> None:
        for rec in self.reader.poll():
            if rec.key in self.tasks:
                continue
            self.tasks[rec.key] = rec.task
            if rec.key not in self.schedule.keys:
                self.pending.append(rec.key)
        for problem in self.reader.problems:
            if self.log is not None:
                self.log.warning("ingested task skipped", problem=problem)
        self.reader.problems.clear()

    # -- the source ----------------------------------------------------------------------------
    def resolve(self, i: int) -> Task | None:
        """Task number ``i``, deciding it if new (blocking); None: nothing to run yet."""
        self._refresh()
        entry = self.schedule.entries.get(i)
        if entry is not None:
            if entry.key is not None and entry.key in self.tasks:
                return self.tasks[entry.key]
            if entry.base is not None and self.base is not None:
                task = self.base.get(entry.base)
                if task is not None:
                    return task
            if self.log is not None:
                self.log.warning("scheduled task gone; deciding the number again", task_number=i,
                                 key=entry.key, base=entry.base)
        while self.pending:
            key = self.pending.pop(0)
            if key in self.schedule.keys:
                continue
            self._record(ScheduleEntry(i=i, key=key))
            return self.tasks[key]
        if self.base is not None:
            b = self.schedule.next_base(i)
            task = self.base.get(b)
            if task is not None:
                self._record(ScheduleEntry(i=i, base=b))
                return task
        return None

    def get(self, i: int) -> Task | None:
        """`resolve` (the synchronous `TaskSource` interface)."""
        return self.resolve(i)

    async def wait_get(self, i: int) -> Task:
        """Task number ``i``, waiting (polling the store) until there is one."""
        while True:
            task = await trio.to_thread.run_sync(self.resolve, i)
            if task is not None:
                return task
            await trio.sleep(self.poll_s)

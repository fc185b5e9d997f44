"""The ingested-task store: an append-only JSON-lines file under ``<state>/<store_dir>/``.

Layout (``store_dir`` is ``ingest`` unless configured):

* ``tasks.jsonl``: one `StoredTask` per line, in acceptance order: ``seq`` (0, 1, ...),
  ``key`` (`task_key`: SHA-256 of the task's content without its provenance
  ``source.ref``), ``origin`` (``"POST /v1/traces"`` or ``"watch:FILE"``), ``at`` (unix
  seconds) and the ``task`` (every field written).
* ``store.lock``: ``flock``-ed by the one `TaskStore` writing (the ingest actor).

Durability: `TaskStore.append` writes every new line of one request with one
``write``, then ``fsync``s the file and its directory, and only then returns; the
actor answers the request after that, so a SIGKILL (or power loss) right after the
answer loses nothing accepted. A crash in the middle of a write leaves at most one torn
line at the end (no newline, or not JSON): readers never consume a line without its
newline, and the next `TaskStore.open` cuts the torn tail off before it appends.

Duplicates: a task whose `task_key` is already stored is not added again (also across
restarts: the keys are re-read at open). A task whose id is stored with other content is
refused (the caller reports it), so a task id names one task in the store.

`StoreReader` tails the file from another actor (or process): each ``poll()`` returns the
records of the lines completed since the last one. Plain blocking I/O: call it from a
worker thread in async code.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec

from fleetrl.daemon.files import fsync_dir
from fleetrl.harness.tasks import Task

from .errors import StoreError

__all__ = ["STORE_FILE", "AppendResult", "StoreError", "StoreReader", "StoredTask", "TaskStore", "task_key"]

STORE_FILE = "tasks.jsonl"
LOCK_FILE = "store.lock"


class StoredTask(msgspec.Struct, frozen=True, kw_only=True):
    """One line of ``tasks.jsonl``."""

    seq: int
    key: str
    origin: str
    at: float
    task: Task


_ENCODER = msgspec.json.Encoder(order="deterministic")
_DECODER = msgspec.json.Decoder(StoredTask)


def task_key(task: Task) -> str:
    """SHA-256 (hex) of the task's content. ``source.ref`` (which request or file line
    it came from) is left out, so the same trace posted twice is one task."""
    if task.source is not None and task.source.ref:
        task = msgspec.structs.replace(task, source=msgspec.structs.replace(task.source, ref=""))
    return hashlib.sha256(_ENCODER.encode(task)).hexdigest()


class AppendResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one `TaskStore.append` did, task by task in input order: each index of the
    input is in exactly one of ``added`` (now stored, with its seq), ``duplicates``
    (already stored: the stored seq) or ``conflicts`` (its id is stored with other
    content: the stored seq)."""

    added: list[tuple[int, StoredTask]]
    duplicates: list[tuple[int, int]]
    conflicts: list[tuple[int, int]]


def _complete_lines(data: bytes) -> tuple[list[bytes], int]:
    """The newline-terminated lines of ``data`` and the length they cover."""
    end = data.rfind(b"\n") + 1
    return (data[:end].splitlines() if end else []), end


def _decode_lines(lines: Iterable[bytes], where: str, problems: list[str], first_line: int) -> list[StoredTask]:
    out = []
    for n, raw in enumerate(lines, start=first_line):
        if not raw.strip():
            continue
        try:
            out.append(_DECODER.decode(raw))
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            problems.append(f"{where}:{n}: unreadable stored task skipped: {err}")
    return out


class TaskStore:
    """The writer of one store directory (see the module docstring). `open` takes the
    lock, cuts a torn tail off and loads every stored key; `close` releases the lock."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.path = self.dir / STORE_FILE
        self.records: list[StoredTask] = []
        self._by_key: dict[str, int] = {}
        self._by_id: dict[str, int] = {}
        self._lock_fd: int | None = None
        self.problems: list[str] = []
        """Lines skipped at open (unreadable), and the torn tail cut off, if any."""

    def open(self) -> TaskStore:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreError(f"{self.dir} is held by another ingest store writer "
                             "(two ingest actors with the same store_dir?)") from None
        self._lock_fd = fd
        try:
            data = self.path.read_bytes() if self.path.exists() else b""
            lines, end = _complete_lines(data)
            if end < len(data):  # a write cut by a crash: never answered, so nothing accepted is lost
                with open(self.path, "r+b") as fh:
                    fh.truncate(end)
                    os.fsync(fh.fileno())
                self.problems.append(f"{self.path}: cut off a torn last line ({len(data) - end} bytes, "
                                     "a write interrupted by a crash)")
            for rec in _decode_lines(lines, str(self.path), self.problems, 1):
                self._remember(rec)
            if not self.path.exists():
                self.path.touch()
                fsync_dir(self.dir)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> TaskStore:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.records)

    def _remember(self, rec: StoredTask) -> None:
        self.records.append(rec)
        self._by_key.setdefault(rec.key, rec.seq)
        self._by_id.setdefault(rec.task.id, rec.seq)

    def seq_of_key(self, key: str) -> int | None:
        return self._by_key.get(key)

    def append(self, tasks: Iterable[Task], *, origin: str, now: float | None = None) -> AppendResult:
        """Store the tasks not stored yet, durably (written, file and directory fsync-ed)
        before returning. Duplicates within `tasks` count as duplicates of the first."""
        if self._lock_fd is None:
            raise StoreError("the store is not open")
        at = time.time() if now is None else now
        added: list[tuple[int, StoredTask]] = []
        dups: list[tuple[int, int]] = []
        conflicts: list[tuple[int, int]] = []
        keys: dict[str, int] = {}
        ids: dict[str, int] = {}
        seq = len(self.records)
        for i, task in enumerate(tasks):
            key = task_key(task)
            held = self._by_key.get(key, keys.get(key))
            if held is not None:
                dups.append((i, held))
                continue
            held = self._by_id.get(task.id, ids.get(task.id))
            if held is not None:
                conflicts.append((i, held))
                continue
            rec = StoredTask(seq=seq, key=key, origin=origin, at=at, task=task)
            keys[key] = ids[task.id] = seq
            seq += 1
            added.append((i, rec))
        if added:
            blob = b"".join(_ENCODER.encode(rec) + b"\n" for _, rec in added)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                before = os.fstat(fd).st_size
                try:
                    view = memoryview(blob)
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                except OSError:  # disk full, ...: take the lines back, nothing was acknowledged
                    os.ftruncate(fd, before)
                    raise
            finally:
                os.close(fd)
            fsync_dir(self.dir)
            for _, rec in added:
                self._remember(rec)
        return AppendResult(added=added, duplicates=dups, conflicts=conflicts)


class StoreReader:
    """Tails ``<directory>/tasks.jsonl`` (no lock; the file may not exist yet)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / STORE_FILE
        self.offset = 0
        self.lines = 0
        self.problems: list[str] = []

    def poll(self) -> list[StoredTask]:
        """The records of the lines completed since the last call (in store order)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        lines, end = _complete_lines(data)
        self.offset += end
        out = _decode_lines(lines, str(self.path), self.problems, self.lines + 1)
        self.lines += len(lines)
        return out

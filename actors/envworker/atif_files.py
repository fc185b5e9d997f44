"""Scored attempts written as ATIF files (``atif`` in the worker's config), off the Trio thread.

`AtifFiles.write` turns an attempt's `AttemptRecord` and `Trajectory` into an ATIF
document (`fleetrl.harness.atif_write.atif_from_attempt`) and writes it to
``<dir>/<attempt>.atif.json`` in a worker thread (`trio.to_thread`), atomically (a
temporary file renamed over the name). The directory holds at most ``max_files`` of
them: the files already there when the worker starts count, oldest (by modification
time) first, and each new file beyond the bound removes the oldest. A failure never
fails the attempt: an I/O error is logged as a warning, anything else (a bug in the
conversion) as an error, and the attempt goes on to its group.
"""

from __future__ import annotations

import collections
import os
import threading
from pathlib import Path
from typing import Any

import trio

from fleetrl.daemon.messages import Trajectory
from fleetrl.harness.atif_write import atif_file_name, atif_from_attempt, encode_atif
from fleetrl.harness.recording import AttemptRecord
from fleetrl.harness.tasks import Task

from .config import AtifOutput

__all__ = ["AtifFiles", "atif_dir"]

SUFFIX = ".atif.json"


def atif_dir(state_dir: Path, worker: str, out: AtifOutput) -> Path:
    """Where worker ``worker`` writes: ``out.dir`` (relative to ``state_dir``), else
    ``<state>/trajectories/<worker>``."""
    if out.dir is None:
        return Path(state_dir) / "trajectories" / worker
    return Path(state_dir) / out.dir  # an absolute out.dir replaces state_dir


class AtifFiles:
    """The ATIF files of one worker's attempts (see the module docstring)."""

    def __init__(self, directory: Path, *, max_files: int, log: Any, support: bool = False) -> None:
        self.directory = Path(directory)
        self.max_files = max_files
        self.log = log
        self.support = support
        self.written = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._kept: collections.deque[Path] | None = None  # oldest first; read from the directory at first use

    async def write(self, task: Task, record: AttemptRecord, trajectory: Trajectory) -> Path | None:
        """Write the attempt's file; its path, or None when it could not be written (logged)."""
        try:
            path = await trio.to_thread.run_sync(self._write, task, record, trajectory)
        except OSError as exc:
            self.failed += 1
            self.log.warning("could not write the attempt's ATIF file", attempt=trajectory.attempt_id,
                             dir=str(self.directory), error=f"{type(exc).__name__}: {exc}")
            return None
        except Exception as exc:  # never fail a scored attempt for its log file
            self.failed += 1
            self.log.error("could not make the attempt's ATIF file", attempt=trajectory.attempt_id,
                           error=f"{type(exc).__name__}: {exc}")
            return None
        self.written += 1
        return path

    def _existing(self) -> collections.deque[Path]:
        if self._kept is None:
            found = []
            if self.directory.is_dir():
                for p in self.directory.iterdir():
                    if p.name.endswith(SUFFIX) and p.is_file():
                        try:
                            found.append((p.stat().st_mtime_ns, p.name, p))
                        except FileNotFoundError:
                            continue
            self._kept = collections.deque(p for _, _, p in sorted(found))
        return self._kept

    def _write(self, task: Task, record: AttemptRecord, trajectory: Trajectory) -> Path:
        data = encode_atif(atif_from_attempt(record, trajectory, task=task, support=self.support))
        path = self.directory / atif_file_name(trajectory.attempt_id)
        with self._lock:
            kept = self._existing()
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            if path in kept:  # a re-run of the same attempt replaces its file
                kept.remove(path)
            kept.append(path)
            while len(kept) > self.max_files:
                kept.popleft().unlink(missing_ok=True)
        return path

"""Run one `fleetrl serve` subprocess and watch its trainer's metrics while it runs.

The daemon runs in its own session (process group) with stdout and stderr going to a
log file. While it runs, the trainer's ``metrics.jsonl`` is read as it grows: each new
step is stamped with the seconds since the start at which it appeared (what the async
benchmark measures). Optionally the run is stopped (SIGTERM: the daemon drains) once
the trainer has trained a given number of groups. On a timeout, or if the caller is
interrupted, the daemon gets SIGTERM, then a second SIGTERM (forced exit) after
``term_grace_s``, then SIGKILL; no process is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

__all__ = ["MetricsTail", "ServeResult", "StepSeen", "run_serve", "serve_command"]


class StepSeen(msgspec.Struct, frozen=True):
    at_s: float
    """Seconds after the daemon started at which the line was seen."""
    step: int
    groups: int
    """Groups trained so far (sum of ``groups`` over the lines up to this one)."""


class ServeResult(msgspec.Struct, frozen=True, kw_only=True):
    exit_code: int
    wall_s: float
    steps: tuple[StepSeen, ...]
    stopped_at_s: float | None = None
    """When the target number of groups was seen (with ``stop_at_groups``)."""
    timed_out: bool = False


class MetricsTail:
    """Reads complete new lines of a growing JSONL file (the last, partial one waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._buf = b""
        self.groups = 0

    def poll(self) -> list[tuple[dict, int]]:
        """The new complete lines, each with the groups trained up to and including it."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._offset)
                chunk = fh.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a malformed line: the report names it; the watcher only times steps
            if isinstance(row, dict):
                self.groups += int(row.get("groups", 0) or 0)
                out.append((row, self.groups))
        return out


def serve_command(config: Path, state_dir: Path) -> list[str]:
    """The real daemon: ``fleetrl serve`` through this interpreter (no PATH lookup)."""
    return [sys.executable, "-m", "fleetrl.daemon.cli", "serve", "--config", str(config),
            "--state-dir", str(state_dir)]


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _stop(proc: subprocess.Popen, term_grace_s: float) -> int:
    """SIGTERM (drain), then a second SIGTERM (forced), then SIGKILL; returns the exit code."""
    for sig, wait in ((signal.SIGTERM, term_grace_s), (signal.SIGTERM, 15.0), (signal.SIGKILL, 15.0)):
        if proc.poll() is not None:
            break
        _signal(proc, sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def run_serve(config: Path, state_dir: Path, log_path: Path, *, metrics_path: Path,
              timeout_s: float, stop_at_groups: int | None = None, term_grace_s: float = 120.0,
              poll_s: float = 0.25, cwd: Path | None = None,
              on_step: Callable[[StepSeen], None] | None = None) -> ServeResult:
    """Run the daemon until it exits (or ``stop_at_groups`` / ``timeout_s``) on a fresh
    ``state_dir``: the state an earlier run left there (the same ablation arm or bench
    run, started again) is removed first, so the run starts from step 0 and its metrics
    are its own (a kept state dir would resume the old run and its steps would be read
    as this run's)."""
    if state_dir.exists():
        shutil.rmtree(state_dir)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    tail = MetricsTail(metrics_path)
    seen: list[StepSeen] = []
    stopped_at = None
    timed_out = False
    with log_path.open("ab") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(serve_command(config, state_dir), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                start_new_session=True)
        try:
            while True:
                done = proc.poll() is not None
                for row, groups in tail.poll():
                    s = StepSeen(time.monotonic() - t0, int(row.get("step", 0) or 0), groups)
                    seen.append(s)
                    if on_step is not None:
                        on_step(s)
                    if stop_at_groups is not None and stopped_at is None and s.groups >= stop_at_groups:
                        stopped_at = s.at_s
                if done:
                    break
                timed_out = time.monotonic() - t0 > timeout_s
                if stopped_at is not None or timed_out:
                    _stop(proc, term_grace_s)
                    continue  # one more pass reads what it wrote while stopping
                time.sleep(poll_s)
        except BaseException:  # interrupted (Ctrl-C): never leave the daemon behind
            _stop(proc, term_grace_s)
            raise
        code = proc.wait()
        wall = time.monotonic() - t0
    return ServeResult(exit_code=code, wall_s=wall, steps=tuple(seen), stopped_at_s=stopped_at,
                       timed_out=timed_out)

"""Helpers shared by test folders (tests/conftest.py puts ``tests/common`` on ``sys.path``):

* `read_jsonl`: the records of a JSON-lines file a live process may still be writing (a
  line cut by a kill, or half written, is skipped).
* `wait_until`: poll a condition from a test that drives a subprocess, failing with what
  it waited for, and with the process's stderr when the process died first.
* `supervisor_for`: an in-process `Supervisor` over a config text and a fresh state dir.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["read_jsonl", "supervisor_for", "wait_until"]


def read_jsonl(path: Path) -> list[dict]:
    """The JSON records of ``path``, in order; none when it does not exist yet."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # cut by a kill, or being written right now
            pass
    return out


def wait_until(pred: Callable[[], Any], what: str, timeout: float, *,
               proc: subprocess.Popen | None = None, stderr: Path | None = None,
               interval: float = 0.5) -> Any:
    """Poll ``pred`` until it returns something true (which is returned). Fails after
    ``timeout`` seconds, or as soon as ``proc`` has exited, naming ``what`` and quoting the
    tail of ``stderr``."""

    def tail() -> str:
        return stderr.read_text(errors="replace")[-3000:] if stderr is not None and stderr.exists() else ""

    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}: {tail()}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}: {tail()}")
        time.sleep(interval)


def supervisor_for(tmp_path: Path, text: str, *, inline: bool = False, state: str = "state"):
    """``(Supervisor, StateDir)`` for the config ``text`` with a fresh state dir under
    ``tmp_path`` and a seeded rng; ``inline=True`` runs blocking calls inline (for tests
    on Trio's autojump clock)."""
    from fleetrl.daemon.config import load_config_text
    from fleetrl.daemon.state import StateDir
    from fleetrl.daemon.supervisor import Supervisor, run_inline

    cfg = load_config_text(text, source="test.toml")
    state_dir = StateDir(tmp_path / state).open()
    extra = {"run_blocking": run_inline} if inline else {}
    return Supervisor(cfg, state_dir, rng=random.Random(0), **extra), state_dir

"""What the benches that run a real `fleetrl serve` share (they run as ``python
bench/NAME.py``, so this folder is on their import path): the config derivation of
tests/e2e/tiny_config.py, and stopping a daemon with every process of its group."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["killpg", "stop_daemon", "tiny_config"]


def tiny_config() -> ModuleType:
    """tests/e2e/tiny_config.py (`derive` of configs/tiny.toml, `edit_toml` of any config)."""
    spec = importlib.util.spec_from_file_location("_tiny_config", ROOT / "tests" / "e2e" / "tiny_config.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def killpg(pgid: int, sig: int) -> None:
    """Signal a process group that may already be gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_daemon(proc: subprocess.Popen, grace_s: float, *, forced_s: float = 15.0) -> int:
    """SIGTERM (drain, ``grace_s``), a second SIGTERM (forced, ``forced_s``), SIGKILL; every
    process of its group, and SIGKILL to whatever of the group outlived it. Its exit code."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGTERM, forced_s), (signal.SIGKILL, 15.0)):
        if proc.poll() is not None:
            break
        killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    code = proc.wait()
    killpg(proc.pid, signal.SIGKILL)  # anything of its group that outlived it
    return code

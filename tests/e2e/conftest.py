"""Shared fixtures of the end-to-end tests: a warm-model cache kept between sessions
(building the warm model costs minutes of CPU) and daemon subprocesses (the `fleetrl`
binary, JSON lines and waiting come from tests/conftest.py and tests/common)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import wait_until

from fleetrl.sandboxes import state_hash


@pytest.fixture(scope="session")
def warm_cache() -> Path:
    """Warm models are cached by recipe key, so one cache serves every test session
    (``FLEETRL_E2E_CACHE``, default ``~/.cache/fleetrl/models``); a missing or damaged
    entry is rebuilt by the daemon's warm-start actor."""
    path = Path(os.environ.get("FLEETRL_E2E_CACHE", Path.home() / ".cache" / "fleetrl" / "models"))
    path.mkdir(parents=True, exist_ok=True)
    return path


class Daemon:
    """One `fleetrl serve` subprocess (stdout/stderr to files under the test's dir)."""

    def __init__(self, argv: list[str], log_dir: Path, name: str) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.err_path = log_dir / f"{name}.stderr"
        self._err = self.err_path.open("wb")
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=self._err)

    def wait_for(self, pred: Callable[[], bool], what: str, timeout: float) -> None:
        wait_until(pred, what, timeout, proc=self.proc, stderr=self.err_path)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon still running after {timeout:g} s: "
                                 f"{self.err_path.read_text(errors='replace')[-3000:]}") from None

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 60.0) -> None:
        """Send ``sig`` and wait for the exit (SIGTERM: a drain with a final evaluation
        takes minutes on a loaded machine; pass a generous ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(60)
                raise AssertionError(f"daemon did not exit within {timeout:g} s of signal {sig}: "
                                     f"{self.err_path.read_text(errors='replace')[-3000:]}") from None

    def close(self) -> None:
        self.kill()
        self._err.close()


@pytest.fixture
def daemons() -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(argv: list[str], log_dir: Path, name: str) -> Daemon:
        d = Daemon(argv, log_dir, name)
        started.append(d)
        return d

    yield start
    for d in started:
        d.close()


def containers_of(state_dir: Path) -> list[str]:
    """Sandbox containers labelled with ``state_dir`` (running or not)."""
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state_dir)}"],
                         check=True, capture_output=True, text=True).stdout
    return out.split()

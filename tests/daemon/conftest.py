"""Shared fixtures of the daemon tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.fixture
def test_actors(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Makes ``daemon_test_actors`` importable by factory path; clears its record."""
    monkeypatch.syspath_prepend(str(HERE))
    import daemon_test_actors

    daemon_test_actors.PROGRESS.clear()
    yield daemon_test_actors
    daemon_test_actors.PROGRESS.clear()


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for `fleetrl` subprocesses that can import the test actors."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture
def fleetrl_bin() -> str:
    """The `fleetrl` console script of this interpreter's environment."""
    path = Path(sys.executable).parent / "fleetrl"
    assert path.exists(), f"{path} missing: is the package installed in this venv?"
    return str(path)

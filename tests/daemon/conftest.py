"""Shared fixtures of the daemon tests (`fleetrl_bin` and `actors_module` come from
tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


@pytest.fixture
def test_actors(actors_module) -> object:
    """``daemon_test_actors``, importable by factory path, its record emptied."""
    return actors_module("daemon_test_actors", "PROGRESS")


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for `fleetrl` subprocesses that can import the test actors."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env

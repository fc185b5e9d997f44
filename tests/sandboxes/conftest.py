"""Fixtures for the sandbox tests (the Docker client and the real image come from
tests/conftest.py, with the per-test ownership and its leak check): an engine, and the
containers of an owner."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetrl.sandboxes import Engine
from fleetrl.sandboxes.sweep import LABEL_OWNER

PY = sys.executable


@pytest.fixture
def engine(docker_client) -> Engine:
    return Engine(docker_client)


def containers_of(client, owner: str) -> list:
    return client.containers.list(all=True, filters={"label": f"{LABEL_OWNER}={owner}"})


@pytest.fixture
def count_containers(docker_client):
    return lambda owner: len(containers_of(docker_client, owner))


@pytest.fixture
def host_healthy(docker_client):
    """Call after an adversarial program: the host still forks, Docker still answers."""

    def check() -> None:
        assert subprocess.run(["true"], timeout=10).returncode == 0
        assert docker_client.ping()
        with open("/proc/loadavg") as f:
            running, total = f.read().split()[3].split("/")
        assert int(total) < 30000, f"host process table nearly full: {total}"

    return check

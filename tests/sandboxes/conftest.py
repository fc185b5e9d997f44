"""Fixtures for the sandbox tests (the Docker client and the real image come from
tests/conftest.py): an engine, a fresh ownership per test, and a leak check: every test
must leave no container of its own behind (the fixture removes leftovers and then fails
the test)."""

from __future__ import annotations

import secrets
import subprocess
import sys

import pytest

from fleetrl.sandboxes import Engine, Ownership
from fleetrl.sandboxes.sweep import LABEL_OWNER

PY = sys.executable


@pytest.fixture
def engine(docker_client) -> Engine:
    return Engine(docker_client)


@pytest.fixture
def state_dir(tmp_path):
    d = tmp_path / "state"
    d.mkdir()
    return d


@pytest.fixture
def ownership(state_dir, docker_client, image):
    own = Ownership.for_state_dir(state_dir, owner=f"test-{secrets.token_hex(4)}", run="test-run")
    yield own
    left = docker_client.containers.list(all=True, filters={"label": f"{LABEL_OWNER}={own.owner}"})
    for c in left:
        c.remove(force=True)
    assert not left, f"containers left behind: {[c.short_id for c in left]}"


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

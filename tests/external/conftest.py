"""Fixtures of the external-harness tests: a fresh ownership per test (with a leak
check) and sandboxes of the real image on the real Docker engine (tests/conftest.py)."""

from __future__ import annotations

import secrets

import pytest

from fleetrl.sandboxes import Engine, Ownership, open_sandbox
from fleetrl.sandboxes.sweep import LABEL_OWNER


@pytest.fixture
def ownership(tmp_path, docker_client, image):
    own = Ownership.for_state_dir(tmp_path, owner=f"ext-{secrets.token_hex(4)}", run="ext-test")
    yield own
    left = docker_client.containers.list(all=True, filters={"label": f"{LABEL_OWNER}={own.owner}"})
    for c in left:
        c.remove(force=True)
    assert not left, f"containers left behind: {[c.short_id for c in left]}"


@pytest.fixture
def sandbox_factory(docker_client, image, ownership):
    """``async with sandbox_factory() as sb``: one fresh sandbox container."""
    def make(**kw):
        return open_sandbox(Engine(docker_client), image=image, ownership=ownership, **kw)
    return make

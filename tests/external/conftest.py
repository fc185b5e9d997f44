"""Fixtures of the external-harness tests: sandboxes of the real image on the real Docker
engine, under the per-test ownership of tests/conftest.py."""

from __future__ import annotations

import pytest

from fleetrl.sandboxes import Engine, open_sandbox


@pytest.fixture
def sandbox_factory(docker_client, image, ownership):
    """``async with sandbox_factory() as sb``: one fresh sandbox container."""
    def make(**kw):
        return open_sandbox(Engine(docker_client), image=image, ownership=ownership, **kw)
    return make

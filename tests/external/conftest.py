"""Fixtures of the external-harness tests: a real Docker engine and sandbox, the
tiny model behind the endpoint served by hypercorn on 127.0.0.1, and fake models for
the tests that do not need the real one."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import docker
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "common"))  # fakes.py

from fleetrl.actors.model import build_byte_tokenizer  # noqa: E402
from fleetrl.harness.model import HFChatTokenizer  # noqa: E402
from fleetrl.sandboxes import DEFAULT_IMAGE, Engine, Ownership, ensure_image
from fleetrl.sandboxes import open_sandbox
from fleetrl.sandboxes.sweep import LABEL_OWNER


@pytest.fixture(scope="session")
def tok() -> HFChatTokenizer:
    return HFChatTokenizer(build_byte_tokenizer())


@pytest.fixture(scope="session")
def docker_client():
    client = docker.from_env()
    try:
        client.ping()
    except docker.errors.DockerException as e:
        pytest.fail(f"Docker engine not reachable ({e}); run scripts/setup.sh (make test does)")
    return client


@pytest.fixture(scope="session")
def image(docker_client) -> str:
    ensure_image(DEFAULT_IMAGE, client=docker_client)
    return DEFAULT_IMAGE


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

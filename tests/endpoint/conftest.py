"""Fixtures of the endpoint-actor tests: a small tiny-llama with its byte tokenizer, a
Docker engine, and the in-process Supervisor with its http control plane on 127.0.0.1."""

from __future__ import annotations

import random
import secrets
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from fleetrl.actors.model import TinyLlamaSpec, create_tiny_llama, save_byte_tokenizer
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor
from fleetrl.sandboxes import DEFAULT_IMAGE, ensure_image

HERE = Path(__file__).resolve().parent

SPEC = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                     max_position_embeddings=1024, initializer_range=0.1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    d = create_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", SPEC, seed=7)
    save_byte_tokenizer(d, model_max_length=1024)
    return d


@pytest.fixture(scope="session")
def image() -> str:
    client = docker.from_env()
    try:
        client.ping()
    except docker.errors.DockerException as e:
        pytest.fail(f"Docker engine not reachable ({e}); run scripts/setup.sh (make test does)")
    ensure_image(DEFAULT_IMAGE, client=client)
    return DEFAULT_IMAGE


@pytest.fixture
def test_actors(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Makes ``endpoint_test_actors`` importable by factory path; clears its record."""
    monkeypatch.syspath_prepend(str(HERE))
    import endpoint_test_actors

    endpoint_test_actors.RECEIVED.clear()
    yield endpoint_test_actors
    endpoint_test_actors.RECEIVED.clear()


BASE = """
[daemon]
grace_s = 30.0
checkpoint_interval_s = 1000.0
[http]
host = "127.0.0.1"
port = 0
[logging]
file = false
"""


def endpoint_toml(model_dir: Path, *, name: str = "endpoint", model_name: str = "tiny",
                  context_length: int = 1024) -> str:
    return f"""
[actors.{name}]
factory = "fleetrl.actors.endpoint:run"
[actors.{name}.config]
model = {{kind = "local", model_dir = "{model_dir}"}}
model_name = "{model_name}"
context_length = {context_length}
default_max_tokens = 16
"""


def make_daemon(tmp_path: Path, actors: str) -> tuple[Supervisor, StateDir]:
    cfg = load_config_text(BASE + actors, source="test.toml")
    state = StateDir(tmp_path / f"state-{secrets.token_hex(2)}").open()
    return Supervisor(cfg, state, rng=random.Random(0)), state


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory) -> Path:
    """The tiny model with a 4096-token context (mini-swe-agent's prompts are ~3,000 bytes)."""
    spec = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         max_position_embeddings=4096, initializer_range=0.1)
    d = create_tiny_llama(tmp_path_factory.mktemp("tiny4k") / "model", spec, seed=5)
    save_byte_tokenizer(d, model_max_length=4096)
    return d

"""Fixtures of the endpoint-actor tests: the scripted test actors, a tiny model with a
4,096-token context, and the in-process Supervisor with its http control plane on
127.0.0.1 (the tiny model, the Docker engine and the image come from tests/conftest.py)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from helpers import supervisor_for

from fleetrl.actors.model import TinyLlamaSpec, create_tiny_llama, save_byte_tokenizer
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor

HERE = Path(__file__).resolve().parent


@pytest.fixture
def test_actors(actors_module) -> object:
    """``endpoint_test_actors``, importable by factory path, its record emptied."""
    return actors_module("endpoint_test_actors", "RECEIVED")


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
    return supervisor_for(tmp_path, BASE + actors, state=f"state-{secrets.token_hex(2)}")


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory) -> Path:
    """The tiny model with a 4096-token context (mini-swe-agent's prompts are ~3,000 bytes)."""
    spec = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         max_position_embeddings=4096, initializer_range=0.1)
    d = create_tiny_llama(tmp_path_factory.mktemp("tiny4k") / "model", spec, seed=5)
    save_byte_tokenizer(d, model_max_length=4096)
    return d

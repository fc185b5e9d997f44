"""Shared fixtures of the environment worker tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from fleetrl.actors.model import TinyLlamaSpec, create_tiny_llama, save_byte_tokenizer

HERE = Path(__file__).resolve().parent


class Result(msgspec.Struct):
    """What a fake sandbox's ``exec`` answers (the fields harnesses and the worker read)."""

    exit_code: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False

SPEC = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                     max_position_embeddings=1024, initializer_range=0.1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A small tiny-llama directory with its byte tokenizer."""
    d = create_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", SPEC, seed=5)
    save_byte_tokenizer(d, model_max_length=1024)
    return d


@pytest.fixture
def test_actors(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Makes ``envworker_test_actors`` importable by factory path; clears its record."""
    monkeypatch.syspath_prepend(str(HERE))
    import envworker_test_actors

    envworker_test_actors.RECEIVED.clear()
    yield envworker_test_actors
    envworker_test_actors.RECEIVED.clear()

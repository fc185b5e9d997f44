"""Shared fixtures of the environment worker tests (the tiny model comes from
tests/conftest.py)."""

from __future__ import annotations

import msgspec
import pytest


class Result(msgspec.Struct):
    """What a fake sandbox's ``exec`` answers (the fields harnesses and the worker read)."""

    exit_code: int | None
    stdout: bytes = b""
    stderr: bytes = b""
    timed_out: bool = False


@pytest.fixture
def test_actors(actors_module) -> object:
    """``envworker_test_actors``, importable by factory path, its record emptied."""
    return actors_module("envworker_test_actors", "RECEIVED")

"""Shared fixtures of the endpoint and harness tests: the byte tokenizer as a
ChatTokenizer, and the in-memory fakes (tests/common/fakes.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "common"))  # fakes.py

from fleetrl.actors.model import build_byte_tokenizer  # noqa: E402
from fleetrl.harness.model import HFChatTokenizer  # noqa: E402


@pytest.fixture(scope="session")
def hf_tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def tok(hf_tokenizer) -> HFChatTokenizer:
    return HFChatTokenizer(hf_tokenizer)

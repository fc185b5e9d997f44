"""Fixtures every test folder shares: the Docker engine, the sandbox image and a
per-test sandbox ownership with its leak check, the tiny model, the byte tokenizer, the
`fleetrl` console script, one torch thread, and importing the scripted test actors that
sit beside a test. Plain helpers (JSON lines, waiting, an in-process supervisor, the
sampler tests' tiny spec and prompts) and the fakes live in tests/common, put on
``sys.path`` here."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

COMMON = Path(__file__).resolve().parent / "common"
if str(COMMON) not in sys.path:
    sys.path.insert(0, str(COMMON))

ONE_THREAD = {"samplers", "vllm", "pool", "weights", "recipe", "trainer"}
"""Test folders of tiny-tensor work, run with one torch thread: on a shared 2-core
machine the intra-op pool's spin-waiting makes small ops many times slower."""


def pytest_collection_modifyitems(items):
    here = Path(__file__).resolve().parent
    for item in items:
        rel = Path(str(item.path)).resolve().relative_to(here)
        if rel.parts and rel.parts[0] in ONE_THREAD:
            item.add_marker(pytest.mark.usefixtures("one_torch_thread"))


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One intra-op torch thread for the test; the setting is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def docker_client():
    """A client of the real Docker engine (make test starts one)."""
    import docker

    client = docker.from_env(max_pool_size=64)
    try:
        client.ping()
    except docker.errors.DockerException as e:
        pytest.fail(f"Docker engine not reachable ({e}); run scripts/setup.sh (make test does)")
    return client


@pytest.fixture(scope="session")
def image(docker_client) -> str:
    """The sandbox base image (built once by `fleetrl sandbox build-image`; cached)."""
    from fleetrl.sandboxes import DEFAULT_IMAGE, ensure_image

    ensure_image(DEFAULT_IMAGE, client=docker_client)
    return DEFAULT_IMAGE


@pytest.fixture
def state_dir(tmp_path) -> Path:
    """A fresh state directory for the test."""
    d = tmp_path / "state"
    d.mkdir()
    return d


@pytest.fixture
def ownership(state_dir, docker_client, image):
    """A fresh sandbox ownership (its own owner label) over `state_dir`, with a leak check:
    a test must leave no container of its own behind (leftovers are removed, then the test
    fails)."""
    import secrets

    from fleetrl.sandboxes import Ownership
    from fleetrl.sandboxes.sweep import LABEL_OWNER

    own = Ownership.for_state_dir(state_dir, owner=f"test-{secrets.token_hex(4)}", run="test-run")
    yield own
    left = docker_client.containers.list(all=True, filters={"label": f"{LABEL_OWNER}={own.owner}"})
    for c in left:
        c.remove(force=True)
    assert not left, f"containers left behind: {[c.short_id for c in left]}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A small saved tiny-llama (1,024-token context) with its byte tokenizer."""
    from fleetrl.actors.model import (
        TinyLlamaSpec,
        create_tiny_llama,
        save_byte_tokenizer,
    )

    spec = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         max_position_embeddings=1024, initializer_range=0.1)
    d = create_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", spec, seed=7)
    save_byte_tokenizer(d, model_max_length=1024)
    return d


@pytest.fixture(scope="module")
def tiny_torch_backend(tiny_model_dir):
    """The real torch sampler backend over `tiny_model_dir` (one per test module)."""
    from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig

    return TorchBackend(TorchBackendConfig(model_dir=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def tiny_chat_tok(tiny_model_dir):
    """`tiny_model_dir`'s tokenizer as the endpoint's `HFChatTokenizer`."""
    from fleetrl.harness.model import HFChatTokenizer

    return HFChatTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def hf_tokenizer():
    """The byte tokenizer as transformers loads it."""
    from fleetrl.actors.model import build_byte_tokenizer

    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def tok(hf_tokenizer):
    """The byte tokenizer as a harness `ChatTokenizer`."""
    from fleetrl.harness.model import HFChatTokenizer

    return HFChatTokenizer(hf_tokenizer)


@pytest.fixture
def fleetrl_bin() -> str:
    """The `fleetrl` console script of this interpreter's environment."""
    path = Path(sys.executable).parent / "fleetrl"
    assert path.exists(), f"{path} missing: is the package installed in this venv?"
    return str(path)


@pytest.fixture
def actors_module(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> Callable[..., object]:
    """``actors_module("daemon_test_actors", "PROGRESS")``: imports the module of scripted
    test actors that sits beside the test (so a config names its factories by path) and
    empties the named records, before the test and after it."""
    import importlib

    cleared: list[tuple[object, tuple[str, ...]]] = []

    def load(name: str, *records: str) -> object:
        monkeypatch.syspath_prepend(str(request.path.parent))
        module = importlib.import_module(name)
        for record in records:
            getattr(module, record).clear()
        cleared.append((module, records))
        return module

    yield load
    for module, records in cleared:
        for record in records:
            getattr(module, record).clear()


@pytest.fixture(scope="session")
def real_vocab_model_dir(tmp_path_factory) -> Path:
    """A ``tiny-151k`` qwen3 model (seed 7): the tiny shape over the real-size
    151,936-token BPE tokenizer, fp32, about 40 MB, built once per session. Its tokenizer
    comes from the on-disk tokenizer cache (trained on the machine's first use, about
    15 s; docs/reference/models.md)."""
    from fleetrl.actors.model import create_tiny_model, tiny_spec

    return create_tiny_model(tmp_path_factory.mktemp("real-vocab") / "model", "qwen3",
                             tiny_spec("qwen3", "tiny-151k"), seed=7)

"""Shared fixtures of the trainer tests: a tiny saved model, one torch thread, and a
factory of RolloutGroups (hand-built, or sampled by the real torch backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, create_tiny_llama
from fleetrl.daemon import messages as m
from fleetrl.daemon.protocol import Tensor

SPEC = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
                     intermediate_size=128, max_position_embeddings=256, initializer_range=0.1)

HERE = Path(__file__).resolve().parent

IDENT = m.SamplerIdentity(sampler_id="s0", backend="torch", device_kind="cpu", dtype="float32")


@pytest.fixture(scope="module")
def worker():
    """tests/trainer/dist_worker.py as a module: launches real 2-rank gloo groups
    (`launch`) and gives the optimizer and step settings both sides use."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fleetrl_test_dist_worker", HERE / "dist_worker.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def feed(actors_module):
    """The scripted actors of trainer_test_actors.py, importable by the daemon, their
    feed and catch emptied before and after the test."""
    return actors_module("trainer_test_actors", "FEED", "GOT")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(create_tiny_llama(tmp_path_factory.mktemp("model") / "tiny", SPEC, seed=3))


def segment(prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float],
            support: Sequence[Sequence[tuple[int, float]]], versions: Sequence[int],
            sampler: m.SamplerIdentity = IDENT) -> m.TokenSegment:
    """A TokenSegment from plain lists; ``support[t]`` lists (id, log q^S) pairs."""
    ids = [i for row in support for i, _ in row]
    lps = [lp for row in support for _, lp in row]
    offsets = np.cumsum([0] + [len(row) for row in support]).astype(np.int64)
    return m.TokenSegment(
        prompt_ids=Tensor.from_numpy(np.asarray(prompt, dtype=np.int64)),
        token_ids=Tensor.from_numpy(np.asarray(tokens, dtype=np.int64)),
        logprobs=Tensor.from_numpy(np.asarray(logprobs, dtype=np.float32)),
        support=m.SupportCSR(ids=Tensor.from_numpy(np.asarray(ids, dtype=np.int64)),
                             logprobs=Tensor.from_numpy(np.asarray(lps, dtype=np.float32)),
                             offsets=Tensor.from_numpy(offsets)),
        versions=Tensor.from_numpy(np.asarray(versions, dtype=np.int64)),
        sampler=sampler,
        finish_reason="stop",
    )


def group_of(group_id: str, trajectories: Sequence[tuple[Sequence[m.TokenSegment], float]],
             task_id: str = "task") -> m.RolloutGroup:
    return m.RolloutGroup(group_id=group_id, task_id=task_id, trajectories=tuple(
        m.Trajectory(attempt_id=f"{group_id}-a{i}", task_id=task_id, group_id=group_id,
                     segments=tuple(segs), reward=float(r))
        for i, (segs, r) in enumerate(trajectories)))


def versioned_group(group_id: str, oldest: int, rewards: Sequence[float] = (0.0, 1.0)) -> m.RolloutGroup:
    """A small hand-built group whose oldest token version is ``oldest``."""
    seg = segment([BOS_ID, 65], [66, 67], [-0.1, -0.2],
                  [[(66, -0.1), (70, -2.35)], [(67, -0.2), (71, -1.7)]], [oldest, oldest + 1])
    return group_of(group_id, [([seg], r) for r in rewards])


def sampled_group(model_dir: str, group_id: str, prompt: Sequence[int], rewards: Sequence[float], *,
                  version: int = 0, dtype: str = "fp32", max_tokens: int = 12, top_p: float = 0.9,
                  seed: int = 0, backend=None) -> m.RolloutGroup:
    """A group sampled by the real torch backend at ``model_dir``'s weights."""
    from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig, WeightVersion
    from fleetrl.actors.samplers.base import served_identity

    be = backend or TorchBackend(TorchBackendConfig(model_dir=model_dir, dtype=dtype),
                                 version=WeightVersion(version, "x"))
    ident = served_identity(be, f"s-{dtype}")
    gens = be.generate([list(prompt)] * len(rewards),
                       m.SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=top_p, seed=seed))
    prompt_ids = Tensor.from_numpy(np.asarray(prompt, dtype=np.int64))
    trajs = []
    for gen, r in zip(gens, rewards):
        seg = m.TokenSegment(prompt_ids=prompt_ids, token_ids=gen.token_ids, logprobs=gen.logprobs,
                             support=gen.support, versions=gen.versions, sampler=ident, finish_reason="stop")
        trajs.append(([seg], r))
    return group_of(group_id, trajs, task_id=f"task-{group_id}")


@pytest.fixture
def groups():
    """The group builders, for tests (import-mode=importlib has no sibling imports)."""
    class G:
        segment = staticmethod(segment)
        group_of = staticmethod(group_of)
        versioned = staticmethod(versioned_group)
        sampled = staticmethod(sampled_group)
    return G

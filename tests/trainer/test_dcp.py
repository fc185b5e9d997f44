"""Sharded checkpoints (actors/trainer/dcp.py): a checkpoint taken on 2 FSDP2 ranks resumes
on 1 (under a process group of one, and as a plain model without any), and one taken on
1 rank resumes on 2, each giving the step the uninterrupted ranks take; RNG per rank;
uncommitted directories are ignored; a checkpoint before the first step resumes exactly."""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path

import msgspec
import pytest
import torch

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, create_tiny_llama, load_master_weights
from fleetrl.actors.trainer import dcp
from fleetrl.actors.trainer.batch import Batch, build_batch
from fleetrl.actors.trainer.errors import CheckpointError
from fleetrl.actors.trainer.fsdp import full_state, shard_model
from fleetrl.actors.trainer.step import StepMetrics, train_step

SPEC = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                     initializer_range=0.3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(create_tiny_llama(tmp_path_factory.mktemp("dcp") / "tiny", SPEC, seed=0))


def sampled_batch(tiny_dir, groups, seed: int) -> Batch:
    prompts = ([BOS_ID, *b"def f(x):"], [BOS_ID, *b"x ="])
    return build_batch([groups.sampled(tiny_dir, f"s{seed}-{i}", p, [1.0, 0.0, 0.5], seed=seed + i,
                                       dtype="bf16" if i else "fp32", max_tokens=10) for i, p in enumerate(prompts)])


@contextlib.contextmanager
def one_rank_group(tmp_path: Path):
    """A gloo process group of world size 1 in this process, and its 1-D mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_close(a: dict, b: dict) -> None:
    """Different rank counts: AdamW weights to 1e-5 relative per tensor (fp32 rounding of
    the gradient sums, amplified near eps by Adam's normalisation; see test_fsdp.py)."""
    assert list(a) == list(b)
    for k in a:
        assert float((a[k] - b[k]).norm() / a[k].norm()) < 1e-5, k


def test_checkpoints_move_between_two_ranks_and_one(worker, tiny_dir, groups, tmp_path):
    b1, b2 = sampled_batch(tiny_dir, groups, 50), sampled_batch(tiny_dir, groups, 60)
    (tmp_path / "batches.pkl").write_bytes(pickle.dumps({"b1": b1, "b2": b2}))
    root_a, root_b = tmp_path / "from2", tmp_path / "from1"
    base = {"model_dir": tiny_dir, "batches": str(tmp_path / "batches.pkl")}
    # 2 ranks: step, checkpoint, step on (the uninterrupted run)
    worker.launch({**base, "ops": [["init", {}], ["step", "b1", None], ["save", str(root_a), 1], ["rng", "a"],
                                   ["step", "b2", None], ["dump", "cont2"]]}, 2, tmp_path)
    cont2 = torch.load(tmp_path / "cont2.pt", weights_only=True)["state"]
    m_cont = msgspec.msgpack.decode((tmp_path / "cont2.rank0.metrics").read_bytes(), type=list[StepMetrics])[-1]
    step_a, path_a = dcp.latest_checkpoint(root_a)
    assert step_a == 1 and path_a.name == "step-00000001"
    assert sorted(p.name for p in path_a.glob("rng-*.bin")) == ["rng-0.bin", "rng-1.bin"]
    a_draw = [torch.load(tmp_path / f"a.rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert not torch.equal(a_draw[0], a_draw[1])  # each rank has a stream of its own

    # 2 -> 1 under a process group of one, sharded over a mesh of one
    with torch.random.fork_rng(devices=[]), one_rank_group(tmp_path) as mesh:
        model = shard_model(load_master_weights(tiny_dir), mesh=mesh)
        opt = worker.make_optimizer(model, "adamw")
        extra = dcp.load_checkpoint(path_a, model, opt)
        assert extra == {"who": b"world 2"}
        dcp.save_checkpoint(root_b, 1, model, opt, extra={"who": b"world 1"})  # for 1 -> 2 below
        assert torch.equal(torch.rand(4), a_draw[0])  # rank 0's stream continues
        m1 = train_step(model, opt, b2, step=1, **worker.step_kwargs())
        resumed1 = full_state(model)
    assert_close(cont2, resumed1)
    assert m1.loss == pytest.approx(m_cont.loss, rel=1e-5) and m1.step == 2 == m_cont.step

    # 2 -> 1 as a plain model without any process group
    with torch.random.fork_rng(devices=[]):
        plain = load_master_weights(tiny_dir)
        opt = worker.make_optimizer(plain, "adamw")
        dcp.load_checkpoint(path_a, plain, opt)
        train_step(plain, opt, b2, step=1, **worker.step_kwargs())
    assert_close(cont2, weights(plain))
    start = load_master_weights(tiny_dir).state_dict()
    assert max(float((cont2[k] - start[k]).norm() / start[k].norm()) for k in start) > 1e-4  # it moved

    # 1 -> 2: the checkpoint written by one rank, resumed on two, the same step exactly
    worker.launch({**base, "ops": [["init", {}], ["load", str(path_a)], ["rng", "d"],
                                   ["init", {}], ["load", str(root_b / "step-00000001")], ["rng", "c"],
                                   ["step", "b2", None], ["dump", "resumed2"]]}, 2, tmp_path)
    resumed2 = torch.load(tmp_path / "resumed2.pt", weights_only=True)["state"]
    assert all(torch.equal(cont2[k], resumed2[k]) for k in cont2)
    for r in (0, 1):
        # saved by two ranks: each continues its own stream; by one: both continue rank 0's
        assert torch.equal(torch.load(tmp_path / f"d.rank{r}.pt", weights_only=True), a_draw[r])
        assert torch.equal(torch.load(tmp_path / f"c.rank{r}.pt", weights_only=True), a_draw[0])


def test_a_checkpoint_before_the_first_step_resumes_exactly(worker, tiny_dir, groups, tmp_path):
    batch = sampled_batch(tiny_dir, groups, 70)
    model = load_master_weights(tiny_dir)
    opt = worker.make_optimizer(model, "adamw")
    path = dcp.save_checkpoint(tmp_path, 0, model, opt)
    assert len(opt.state) == 0  # saving did not initialise the optimizer
    train_step(model, opt, batch, step=0, **worker.step_kwargs())

    other = load_master_weights(tiny_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01)  # loading must overwrite these
    opt2 = worker.make_optimizer(other, "adamw")
    assert dcp.load_checkpoint(path, other, opt2) == {}
    assert len(opt2.state) == 0
    train_step(other, opt2, batch, step=0, **worker.step_kwargs())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))


def test_uncommitted_checkpoints_are_ignored_and_old_ones_pruned(worker, tiny_dir, tmp_path):
    model = load_master_weights(tiny_dir)
    opt = worker.make_optimizer(model, "adamw")
    assert dcp.latest_checkpoint(tmp_path / "none") is None
    for step in (1, 2, 3):
        dcp.save_checkpoint(tmp_path, step, model, opt, extra={"step": str(step).encode()}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003"]
    # a save that crashed before its commit, and one that crashed while writing
    crashed = tmp_path / "step-00000009"
    (crashed).mkdir()
    (crashed / ".metadata").write_bytes(b"partial")
    (tmp_path / ".tmp-step-00000010").mkdir()
    assert dcp.latest_checkpoint(tmp_path) == (3, tmp_path / "step-00000003")
    with pytest.raises(CheckpointError, match="not committed"):
        dcp.load_checkpoint(crashed, model, opt)
    with pytest.raises(CheckpointError, match="no such"):
        dcp.load_checkpoint(tmp_path / "step-00000004", model, opt)
    # the next save clears the crashed temporary directory and replaces a step saved twice
    dcp.save_checkpoint(tmp_path, 3, model, opt, extra={"step": b"3 again"}, keep=2)
    assert not (tmp_path / ".tmp-step-00000010").exists()
    assert dcp.load_checkpoint(tmp_path / "step-00000003", model, opt) == {"step": b"3 again"}
    with pytest.raises(ValueError, match="keep"):
        dcp.save_checkpoint(tmp_path, 4, model, opt, keep=0)


def test_a_checkpoint_of_another_model_is_refused(worker, tiny_dir, tmp_path):
    from fleetrl.actors.model import build_tiny_llama

    model = load_master_weights(tiny_dir)
    path = dcp.save_checkpoint(tmp_path, 1, model, worker.make_optimizer(model, "adamw"))
    small = build_tiny_llama(TinyLlamaSpec(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                           intermediate_size=64), seed=1).train()
    with pytest.raises(CheckpointError, match="cannot be loaded"):
        dcp.load_checkpoint(path, small, worker.make_optimizer(small, "adamw"))

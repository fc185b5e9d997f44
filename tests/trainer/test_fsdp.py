"""A train step on 2 FSDP2 ranks (real processes, gloo on 127.0.0.1) leaves the same full
parameters and metrics as one process training the whole batch, with and without
micro-batches (unequal counts per rank) and activation checkpointing; the full bf16
state gathered to rank 0 is the one `master_bf16` gives."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from fleetrl.actors.model import BOS_ID, TinyLlamaSpec, create_tiny_llama, load_master_weights
from fleetrl.actors.trainer.batch import Batch, build_batch, select_rows, split_rows
from fleetrl.actors.trainer.fsdp import full_bf16_state, full_state, is_sharded, shard_model
from fleetrl.actors.trainer.step import StepMetrics, master_bf16, train_step

SPEC = TinyLlamaSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                     initializer_range=0.3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return str(create_tiny_llama(tmp_path_factory.mktemp("fsdp") / "tiny", SPEC, seed=0))


def sampled_batch(tiny_dir, groups, seed: int = 40) -> Batch:
    prompts = ([BOS_ID, *b"def f(x):"], [BOS_ID, *b"x ="], [BOS_ID, *b"print("])
    grps = [groups.sampled(tiny_dir, f"s{seed}-{i}", p, [1.0, 0.0, 0.5, 0.0][:4 - (i % 2)], seed=seed + i,
                           dtype="bf16" if i else "fp32", max_tokens=12, version=i)
            for i, p in enumerate(prompts)]
    return build_batch(grps)


def reference(worker, tiny_dir, batch, kind, micro=None):
    """One process, unsharded, the whole batch."""
    model = load_master_weights(tiny_dir)
    opt = worker.make_optimizer(model, kind)
    m = train_step(model, opt, batch, step=0, micro_batch_tokens=micro, **worker.step_kwargs())
    return m, {k: v.detach().clone() for k, v in model.state_dict().items()}, model


def assert_close_weights(start, one, other, kind) -> None:
    """As tests/trainer/test_microbatch.py: SGD updates to 1e-5 (plus the fp32 rounding of
    the weights), AdamW weights to 1e-5 relative per tensor."""
    moved = 0.0
    for k, w in one.items():
        update = w - start[k]
        moved = max(moved, float(update.norm() / start[k].norm()))
        if kind == "sgd":
            assert float((other[k] - w).norm()) <= 1e-5 * float(update.norm()) + 1e-6 * float(w.norm()), k
        else:
            assert float((other[k] - w).norm() / w.norm()) < 1e-5, k
    assert moved > 1e-4


SAME = ("groups", "trajectories", "rows", "tokens", "reward_mean", "pass_rate", "staleness_hist",
        "tokens_by_sampler", "frac_masked_tokens", "frac_masked_sequences", "step", "skipped")
CLOSE = ("loss", "grad_norm", "mismatch_kl_k3", "log_ratio_mean", "weight_mean", "centering_norm")


def assert_same_metrics(a: StepMetrics, b: StepMetrics) -> None:
    for f in SAME:
        assert getattr(a, f) == getattr(b, f), f
    for f in CLOSE:
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-5, abs=1e-9), f
    assert set(a.mismatch_kl_by_sampler) == set(b.mismatch_kl_by_sampler)
    for k, v in a.mismatch_kl_by_sampler.items():
        assert v == pytest.approx(b.mismatch_kl_by_sampler[k], rel=1e-4, abs=1e-10), k


def read_metrics(path) -> list[StepMetrics]:
    import msgspec

    return msgspec.msgpack.decode(path.read_bytes(), type=list[StepMetrics])


def test_two_fsdp_ranks_equal_one_process(worker, tiny_dir, groups, tmp_path):
    batch = sampled_batch(tiny_dir, groups)
    shares = [select_rows(batch, rows.tolist()) for rows in np.array_split(np.arange(batch.tokens.shape[0]), 2)]
    # a budget that gives the ranks different numbers of micro-batches (idle passes)
    budget = next(t for t in range(20, 400, 4)
                  if len(split_rows(shares[0], t)) != len(split_rows(shares[1], t)) >= 2)
    (tmp_path / "batches.pkl").write_bytes(pickle.dumps({"b": batch}))
    spec = {"model_dir": tiny_dir, "batches": str(tmp_path / "batches.pkl"), "ops": [
        ["init", {"optimizer": "sgd"}], ["step", "b", None], ["dump", "sgd"],
        ["init", {"optimizer": "adamw"}], ["step", "b", budget], ["dump", "adamw_micro"],
        ["init", {"optimizer": "sgd", "activation_checkpointing": True}], ["step", "b", budget], ["dump", "ac_micro"],
    ]}
    worker.launch(spec, 2, tmp_path)
    start = load_master_weights(tiny_dir).state_dict()
    for name, kind in (("sgd", "sgd"), ("adamw_micro", "adamw"), ("ac_micro", "sgd")):
        m_ref, w_ref, model = reference(worker, tiny_dir, batch, kind)
        assert not m_ref.skipped and m_ref.frac_masked_tokens > 0
        dumped = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        (m0,), (m1,) = (read_metrics(tmp_path / f"{name}.rank{r}.metrics") for r in (0, 1))
        assert_same_metrics(m_ref, m0)
        assert_same_metrics(m0, m1)  # both ranks report the whole batch
        assert m0.loss == m1.loss and m0.grad_norm == m1.grad_norm
        state, bf16 = dumped["state"], dumped["bf16"]
        assert list(state) == list(w_ref)  # HF names, state-dict order
        assert_close_weights(start, w_ref, state, kind)
        ref_bf16 = master_bf16(model)
        assert list(bf16) == list(ref_bf16)
        assert all(v.dtype == torch.bfloat16 and torch.equal(v, state[k].to(torch.bfloat16)) for k, v in bf16.items())


def test_full_state_of_an_unsharded_model_without_a_process_group(tiny_dir):
    model = load_master_weights(tiny_dir)
    assert not is_sharded(model)
    bf16, ref = full_bf16_state(model), master_bf16(model)
    assert list(bf16) == list(ref) and all(torch.equal(bf16[k], ref[k]) for k in ref)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in full_state(model).items())


def test_a_model_without_decoder_blocks_is_refused():
    with pytest.raises(ValueError, match="model.model.layers"):
        shard_model(torch.nn.Linear(2, 2), mesh=None)

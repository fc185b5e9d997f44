"""The train step: learning direction, skipped zero-signal steps, per-sampler mismatch,
and exact resume from a checkpoint."""

from __future__ import annotations

import pytest
import torch

from fleetrl.actors.buffer import BufferConfig, RolloutBuffer
from fleetrl.actors.model import BOS_ID, load_master_weights
from fleetrl.actors.trainer import checkpoint as ck
from fleetrl.actors.trainer.batch import build_batch
from fleetrl.actors.trainer.step import build_optimizer, train_step
from fleetrl.grpo import CorrectionConfig, replay_logprobs

PROMPT = [BOS_ID, *b"def f(x):"]


def _opt(model, lr=1e-2, wd=0.0):
    return build_optimizer(model, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)


def _step(model, opt, batch, step=0, version=0, corrections=CorrectionConfig()):
    return train_step(model, opt, batch, corrections=corrections, temperature=1.0, grad_clip=1.0,
                      pass_threshold=1.0, step=step, trainer_version=version)


@torch.no_grad()
def _seq_logprobs(model, batch):
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lg = logits.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    lp, _ = replay_logprobs(lg, batch.tokens, batch.support_ids)
    return torch.where(batch.loss_mask, lp, 0.0).sum(-1)


def test_step_raises_the_rewarded_attempts_logprob(model_dir, groups):
    grp = groups.sampled(model_dir, "g", PROMPT, [1.0, 0.0, 0.0, 0.0], seed=5)
    batch = build_batch([grp])
    model = load_master_weights(model_dir)
    before = _seq_logprobs(model, batch)
    metrics = _step(model, _opt(model), batch)
    after = _seq_logprobs(model, batch)
    assert not metrics.skipped and metrics.step == 1
    assert metrics.grad_norm > 0 and metrics.tokens == batch.n_tokens
    assert metrics.reward_mean == 0.25 and metrics.pass_rate == 0.25
    assert metrics.mismatch_kl_k3 < 1e-5 and metrics.frac_masked_tokens == 0.0
    assert after[0] > before[0] + 0.05  # the rewarded attempt became more likely
    assert (after[1:] < before[1:]).all()  # the others less likely
    assert metrics.staleness_hist == {0: 1}


def test_zero_variance_batch_leaves_weights_and_optimizer_untouched(model_dir, groups):
    grp = groups.sampled(model_dir, "z", PROMPT, [1.0, 1.0, 1.0], seed=6)
    batch = build_batch([grp])
    model = load_master_weights(model_dir)
    opt = _opt(model, wd=0.1)  # weight decay would move weights on a zero gradient
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = _step(model, opt, batch, step=4)
    assert metrics.skipped and metrics.skipped_reason == "zero advantage" and metrics.step == 4
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert opt.state_dict()["state"] == {}


def test_mismatch_kl_is_reported_per_backend_and_dtype(model_dir, groups):
    fp32 = groups.sampled(model_dir, "a", PROMPT, [1.0, 0.0], seed=7, max_tokens=16)
    bf16 = groups.sampled(model_dir, "b", PROMPT, [1.0, 0.0], seed=8, dtype="bf16", max_tokens=16)
    batch = build_batch([fp32, bf16])
    model = load_master_weights(model_dir)
    metrics = _step(model, _opt(model), batch)
    by = metrics.mismatch_kl_by_sampler
    assert set(by) == {"torch/float32", "torch/bfloat16"}
    assert by["torch/float32"] < 1e-6 < by["torch/bfloat16"]
    assert metrics.tokens_by_sampler["torch/float32"] + metrics.tokens_by_sampler["torch/bfloat16"] == batch.n_tokens


def test_resume_from_checkpoint_is_bit_identical(model_dir, groups):
    b1 = build_batch([groups.sampled(model_dir, "r1", PROMPT, [1.0, 0.0, 0.5], seed=9)])
    b2 = build_batch([groups.sampled(model_dir, "r2", [BOS_ID, *b"x ="], [0.0, 1.0], seed=10)])
    queued = groups.versioned("queued", 1)
    cfg = BufferConfig(max_staleness=2)

    torch.manual_seed(123)
    model = load_master_weights(model_dir)
    opt = _opt(model, lr=3e-3, wd=0.01)
    buf = RolloutBuffer(cfg)
    buf.offer(queued, 1)
    _step(model, opt, b1)
    blob = ck.encode(ck.capture(model, opt, buf, step=1, version=1, task_cursor=7))
    rng_draw = torch.rand(3)  # the RNG moves on after the checkpoint
    _step(model, opt, b2, step=1, version=1)
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(999)  # a different process state
    model2 = load_master_weights(model_dir)
    opt2 = _opt(model2, lr=3e-3, wd=0.01)
    buf2 = RolloutBuffer(cfg)
    restored = ck.decode(blob)
    ck.restore(restored, model2, opt2, buf2)
    assert (restored.step, restored.version, restored.task_cursor) == (1, 1, 7)
    assert torch.equal(torch.rand(3), rng_draw)
    assert buf2.queued_ids == ("queued",)
    _step(model2, opt2, b2, step=1, version=1)
    resumed = model2.state_dict()
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)
    # and it really moved (the equality is not trivially true)
    assert not torch.equal(uninterrupted["model.embed_tokens.weight"],
                           load_master_weights(model_dir).state_dict()["model.embed_tokens.weight"])


def test_checkpoint_of_another_model_is_refused(model_dir, tmp_path, groups):
    from fleetrl.actors.model import TinyLlamaSpec, create_tiny_llama

    other = create_tiny_llama(tmp_path / "other", TinyLlamaSpec(hidden_size=32, num_layers=1, num_heads=2,
                                                                num_kv_heads=2, intermediate_size=64,
                                                                max_position_embeddings=64), seed=1)
    model = load_master_weights(model_dir)
    blob = ck.encode(ck.capture(model, _opt(model), RolloutBuffer(BufferConfig()), step=0, version=0,
                                task_cursor=0))
    small = load_master_weights(other)
    with pytest.raises(ck.CheckpointError, match="another model"):
        ck.restore(ck.decode(blob), small, _opt(small), RolloutBuffer(BufferConfig()))
    with pytest.raises(ck.CheckpointError, match="cannot be decoded"):
        ck.decode(b"\x93garbage")

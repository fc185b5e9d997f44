"""A model whose LM head is tied to its embedding (Qwen3-0.6B's layout): the trainer
trains the shared tensor and publishes it once, under the embedding's name, which is
what a Hugging Face checkpoint stores and what every sampler loads; a sampler follows
the published versions."""

from __future__ import annotations

import msgspec
import numpy as np
import torch

from fleetrl.actors.model import load_master_weights
from fleetrl.actors.model.tiny_models import create_tiny_model, tiny_spec
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig, WeightVersion
from fleetrl.actors.trainer.batch import build_batch
from fleetrl.actors.trainer.fsdp import published_names
from fleetrl.actors.trainer.step import build_optimizer, master_bf16, train_step
from fleetrl.daemon.messages import SamplingParams
from fleetrl.grpo import CorrectionConfig


def test_a_tied_head_is_published_once_and_a_sampler_follows_it(tmp_path, groups):
    spec = msgspec.structs.replace(tiny_spec("qwen3"), tie_word_embeddings=True)
    path = create_tiny_model(tmp_path / "tied", "qwen3", spec, seed=3)
    model = load_master_weights(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    names = published_names(model)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert "lm_head.weight" in model.state_dict()  # the state dict lists it under both names
    sampler = TorchBackend(TorchBackendConfig(model_dir=str(path)), version=WeightVersion(0, "v0"))
    sampler.load_version(master_bf16(model), WeightVersion(0, "v0"))  # refused a duplicate name before

    grp = groups.sampled(str(path), "g", [1, 72, 105], [1.0, 0.0, 0.5, 0.0], seed=2, max_tokens=6,
                         backend=sampler)
    opt = build_optimizer(model, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    met = train_step(model, opt, build_batch([grp]), corrections=CorrectionConfig(), temperature=1.0,
                     grad_clip=1.0, pass_threshold=1.0, step=0, trainer_version=0)
    assert not met.skipped
    new = master_bf16(model)
    sampler.apply_update(new, WeightVersion(1, "v1"))
    held = sampler.weights.snapshot()[0]["model.embed_tokens.weight"]
    held = held if isinstance(held, torch.Tensor) else held.values
    assert torch.equal(held.to(torch.bfloat16), new["model.embed_tokens.weight"])
    [gen] = sampler.generate([[1, 72, 105]], SamplingParams(max_tokens=3, seed=1))
    assert set(np.asarray(gen.versions.to_numpy()).tolist()) == {1}


def test_the_in_process_trainer_checkpoints_a_tied_model(tmp_path):
    """safetensors refuses tensors that share memory: the checkpoint holds the tied
    tensor once and a restore brings both names back (they are one tensor)."""
    from fleetrl.actors.buffer import BufferConfig, RolloutBuffer
    from fleetrl.actors.trainer import checkpoint as ck

    spec = msgspec.structs.replace(tiny_spec("qwen3"), tie_word_embeddings=True)
    path = create_tiny_model(tmp_path / "tied", "qwen3", spec, seed=4)
    model = load_master_weights(path)
    opt = build_optimizer(model, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.5)  # differs from the saved model
    buffer = RolloutBuffer(BufferConfig())
    data = ck.encode(ck.capture(model, opt, buffer, step=3, version=3, task_cursor=0))
    fresh = load_master_weights(path)
    ck.restore(ck.decode(data), fresh, build_optimizer(fresh, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                                                       weight_decay=0.0), RolloutBuffer(BufferConfig()))
    assert torch.equal(fresh.model.embed_tokens.weight, model.model.embed_tokens.weight)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight

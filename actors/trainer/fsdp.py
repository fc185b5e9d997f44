"""FSDP2 for the trainer's Hugging Face causal LM, and its full bf16 state for publishing.

`shard_model` applies ``torch.distributed.fsdp.fully_shard`` to each decoder block
(``model.model.layers[i]``: Llama, Qwen2, Qwen3 and Mistral keep their blocks there) and
then to the root (embeddings, final norm, LM head), with a ``MixedPrecisionPolicy`` when
dtypes are given and optional activation checkpointing per block. Parameters become
DTensors sharded on dim 0 over the mesh; the optimizer must be built afterwards.

Gradient reduction is a *sum* over ranks (`use_sum_reduction`: divide factor 1, plain
``ReduceOp.SUM``, which gloo supports where FSDP's default average or pre-multiplied
sum is not): `fleetrl.actors.trainer.step.train_step` backpropagates sums and divides
by the global normaliser itself, so FSDP must not average as well.

Publishing. Deltas are published from the *full* bf16 state gathered on rank 0
(`full_bf16_state`): rank 0 runs the same `fleetrl.actors.weights.Publisher` as the
single-process trainer over exactly the tensors `fleetrl.actors.trainer.step.master_bf16`
gives for an unsharded model (HF names, state-dict order, bf16, CPU), so the delta format,
anchors and checksums are unchanged and bit-exact by construction. This is the simplest
exact form. Encoding per shard would save the gather (each rank diffs its own slice)
but needs a merge step that maps flat shard ranges back to whole tensors and combines
per-shard checksums into the per-tensor ones samplers verify; worth it only when the
gather of one bf16 copy (2 bytes a parameter, to rank 0's CPU) is a measurable part of a
step.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["decoder_layers", "full_bf16_state", "full_state", "has_activation_checkpointing", "is_sharded",
           "published_names",
           "shard_model", "use_sum_reduction"]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of a Hugging Face causal LM (``model.model.layers``)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        arch = getattr(getattr(model, "config", None), "architectures", None) or [type(model).__name__]
        raise ValueError(f"cannot shard {arch[0]}: no decoder blocks at model.model.layers (the layout of Llama, "
                         "Qwen2, Qwen3 and Mistral causal LMs)")
    return layers


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are DTensors (sharded with FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def has_activation_checkpointing(model: nn.Module) -> bool:
    """Whether some block of ``model`` recomputes its activations in backward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(isinstance(m, CheckpointWrapper) for m in model.modules())


def use_sum_reduction(model: nn.Module) -> None:
    """Make every FSDP2 module of ``model`` sum gradients over ranks (no average)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def shard_model(model: nn.Module, *, mesh, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype | None = None, activation_checkpointing: bool = False) -> nn.Module:
    """Shard ``model`` in place with FSDP2 over the 1-D device ``mesh``; returns it.

    ``param_dtype``: the dtype blocks compute in (parameters are all-gathered in it; the
    fp32 sharded master stays fp32); ``reduce_dtype``: the dtype gradients are summed in.
    With neither, no mixed precision. ``activation_checkpointing`` wraps each block in
    torch's non-reentrant checkpoint wrapper (its state-dict names are unchanged).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = decoder_layers(model)
    kwargs = {"mesh": mesh}
    if param_dtype is not None or reduce_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for i in range(len(layers)):
        if activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            layers[i] = checkpoint_wrapper(layers[i])
        fully_shard(layers[i], **kwargs)
    fully_shard(model, **kwargs)
    use_sum_reduction(model)
    return model


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def full_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full state dict on rank 0 (CPU, master dtype, HF names, state-dict order),
    None on the other ranks. A collective for a sharded model: every rank calls it."""
    if not is_sharded(model):
        if _rank() != 0:
            return None
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if _rank() != 0:
        return None
    order = list(model.state_dict().keys())
    return {k: state[k] for k in order}


def published_names(model: nn.Module) -> list[str]:
    """The state-dict names whose tensors the trainer publishes, in state-dict order: each
    tensor once. A parameter shared by two modules (the LM head tied to the embedding, as
    in Qwen3-0.6B) is published under its first name only, the one a Hugging Face
    checkpoint stores and every sampler loads; the state dict lists it under both."""
    first = {name for name, _ in model.named_parameters()}
    shared = {name for name, _ in model.named_parameters(remove_duplicate=False)} - first
    return [k for k in model.state_dict().keys() if k not in shared]


def full_bf16_state(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The canonical bf16 weights to publish, on rank 0 (None on the others): the same
    tensors `fleetrl.actors.trainer.step.master_bf16` gives for the unsharded model
    (`published_names`). A collective for a sharded model: every rank calls it."""
    names = published_names(model)
    state = full_state(model)
    if state is None:
        return None
    return {k: state[k].detach().to("cpu", torch.bfloat16).contiguous() for k in names}

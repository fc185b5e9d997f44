"""Exact trainer checkpoints: model, optimizer, counters, RNG, buffer, task cursor -> bytes.

`capture` turns the trainer's whole state into one msgpack blob (the value the
actor's checkpoint hook returns; the daemon writes it atomically into its checkpoint
file, and the actor also writes it into its own ``checkpoints/`` every
``checkpoint_every`` steps with the daemon's `CheckpointStore`). `restore` puts it
back into a freshly built model, optimizer and buffer so that the next step is
bit-identical to the one an uninterrupted trainer would take: fp32 weights and AdamW
state are stored as raw tensors (no casts), and torch's CPU RNG state is included.

A trainer that runs as rank processes (``[ranks]``) keeps its model, optimizer and RNG in
a sharded torch.distributed checkpoint instead (`fleetrl.actors.trainer.dcp`); its
`TrainerCheckpoint` then names that directory in ``sharded`` and leaves ``model``,
``optimizer`` and ``rng`` empty.
"""

from __future__ import annotations

import hashlib
import io

import msgspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from fleetrl.actors.buffer import BufferState, RolloutBuffer

from .errors import CheckpointError
from .fsdp import published_names

__all__ = ["CheckpointError", "TrainerCheckpoint", "capture", "decode", "encode", "model_fingerprint",
           "model_parts", "restore", "restore_model"]

FORMAT = 1


class TrainerCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    """The trainer's state. ``version`` is the newest *published* weight version."""

    format: int = FORMAT
    step: int
    version: int
    fingerprint: str
    """Hash of the model's tensor names, shapes and dtypes: refuses another model."""
    model: bytes
    """safetensors bytes of the fp32 master state dict."""
    optimizer: bytes
    """``torch.save`` bytes of the optimizer's state dict (loaded with weights_only)."""
    rng: bytes
    """torch's CPU generator state."""
    buffer: BufferState
    task_cursor: int = 0
    """Groups received from the inbox so far (the position in the rollout stream)."""
    elapsed_s: float = 0.0
    """Wall-clock seconds the trainer had run when this was captured, summed over its
    restarts (what ``time_budget_s`` counts; 0 in checkpoints written before it existed)."""
    sharded: str | None = None
    """Name of the sharded checkpoint directory (under the trainer's ``sharded/``) that
    holds model, optimizer and RNG, written at ``step`` by the rank group; None: they are
    inline above."""


def model_fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in model.state_dict().items():
        h.update(f"{k}:{tuple(v.shape)}:{v.dtype};".encode())
    return h.hexdigest()[:32]


def model_parts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str | bytes]:
    """The inline model fields of a checkpoint (fingerprint, model, optimizer, rng), copied;
    a tensor shared by two modules (a tied LM head) once, under its first name
    (`fsdp.published_names`: safetensors refuses tensors that share memory)."""
    own = model.state_dict()
    state = {k: own[k].detach().cpu().contiguous() for k in published_names(model)}
    opt = io.BytesIO()
    torch.save(optimizer.state_dict(), opt)
    return dict(fingerprint=model_fingerprint(model), model=st_save(state), optimizer=opt.getvalue(),
                rng=bytes(torch.get_rng_state().numpy().tobytes()))


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer, buffer: RolloutBuffer, *,
            step: int, version: int, task_cursor: int, elapsed_s: float = 0.0) -> TrainerCheckpoint:
    """Snapshot an in-process trainer (copies: later training does not change the snapshot)."""
    return TrainerCheckpoint(step=step, version=version, buffer=buffer.snapshot(), task_cursor=task_cursor,
                             elapsed_s=elapsed_s, **model_parts(model, optimizer))


def encode(ckpt: TrainerCheckpoint) -> bytes:
    return msgspec.msgpack.encode(ckpt)


def decode(data: bytes | TrainerCheckpoint) -> TrainerCheckpoint:
    """Bytes (or an already decoded value) -> `TrainerCheckpoint`; CheckpointError if bad."""
    if isinstance(data, TrainerCheckpoint):
        return data
    try:
        ckpt = msgspec.msgpack.decode(data, type=TrainerCheckpoint)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        raise CheckpointError(f"trainer checkpoint cannot be decoded: {exc}") from None
    if ckpt.format != FORMAT:
        raise CheckpointError(f"trainer checkpoint has format {ckpt.format}, this build reads {FORMAT}")
    return ckpt


def restore(ckpt: TrainerCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            buffer: RolloutBuffer) -> None:
    """Load ``ckpt`` into ``model``, ``optimizer``, ``buffer`` and torch's RNG, exactly."""
    restore_model(ckpt, model, optimizer)
    buffer.restore(ckpt.buffer)


def restore_model(ckpt: TrainerCheckpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load ``ckpt``'s inline model, optimizer and RNG state (not the buffer), exactly."""
    fp = model_fingerprint(model)
    if ckpt.fingerprint != fp:
        raise CheckpointError(f"trainer checkpoint is of another model (fingerprint {ckpt.fingerprint}, "
                              f"this model {fp}); a new model needs a new run")
    if ckpt.sharded is not None:
        raise CheckpointError(f"trainer checkpoint at step {ckpt.step} keeps its model in the sharded "
                              f"checkpoint {ckpt.sharded}, not inline")
    tensors = st_load(ckpt.model)
    own = model.state_dict()
    with torch.no_grad():
        for k in published_names(model):  # a tied tensor is loaded once, through its first name
            own[k].copy_(tensors[k])
    try:
        opt_state = torch.load(io.BytesIO(ckpt.optimizer), weights_only=True)
        optimizer.load_state_dict(opt_state)
    except Exception as exc:  # torch raises several types for a bad state dict
        raise CheckpointError(f"trainer checkpoint: optimizer state cannot be loaded: {exc}") from exc
    torch.set_rng_state(torch.frombuffer(bytearray(ckpt.rng), dtype=torch.uint8))

"""What a train step needs from its data-parallel group: a sum over ranks.

`fleetrl.actors.trainer.step.train_step` combines the ranks' gradients and statistics
through a `Collective`: its ``world_size``, its ``rank`` and ``all_reduce_sum``. With one
process there is nothing to combine (`LocalCollective`); the trainer's ranks use
`ProcessGroupCollective` over an initialised ``torch.distributed`` process group (gloo
on CPU, nccl on GPU). Every rank must make the same calls in the same order: a
collective is a rendezvous.

`gather_bytes` builds an all-gather of byte strings on ``all_reduce_sum`` alone (each
rank writes its bytes into its own slot of a zeroed buffer; the sum is then every
rank's bytes), so the step can merge dictionaries whose keys differ between ranks
(samplers, staleness) with exactly the same result on every rank.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["Collective", "LocalCollective", "ProcessGroupCollective", "gather_bytes"]


@runtime_checkable
class Collective(Protocol):
    """The ranks of one data-parallel group, as a train step sees them."""

    @property
    def world_size(self) -> int:
        """Number of ranks (>= 1)."""
        ...

    @property
    def rank(self) -> int:
        """This process's rank, in ``[0, world_size)``."""
        ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of ``tensor`` over all ranks (same shape, dtype and device).

        Every rank passes a tensor of the same shape and dtype. The input may be
        overwritten; use the returned tensor."""
        ...


class LocalCollective:
    """A group of one: the sum over ranks is the tensor itself."""

    world_size = 1
    rank = 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __repr__(self) -> str:
        return "LocalCollective()"


class ProcessGroupCollective:
    """``torch.distributed`` ranks of ``group`` (the default group when None).

    ``device`` is where the reductions run: CPU for gloo; for nccl the rank's CUDA
    device (tensors are moved there and the result is moved back to the input's device).
    Raises ``RuntimeError`` if no process group is initialised."""

    def __init__(self, group: torch.distributed.ProcessGroup | None = None, *,
                 device: torch.device | str | None = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ProcessGroupCollective needs an initialised torch.distributed process group "
                               "(torch.distributed.init_process_group); use LocalCollective in one process")
        self._dist = dist
        self._group = group
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        if device is None:
            device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        self._device = torch.device(device)

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        work = tensor.to(self._device).contiguous()
        if work is tensor:
            work = tensor.clone()
        self._dist.all_reduce(work, op=self._dist.ReduceOp.SUM, group=self._group)
        return work.to(tensor.device)

    def __repr__(self) -> str:
        return f"ProcessGroupCollective(rank={self._rank}, world_size={self._world}, device={self._device})"


def gather_bytes(collective: Collective, data: bytes) -> list[bytes]:
    """Every rank's ``data``, in rank order, on every rank (two ``all_reduce_sum`` calls)."""
    world, rank = collective.world_size, collective.rank
    if world == 1:
        return [bytes(data)]
    lengths = torch.zeros(world, dtype=torch.int64)
    lengths[rank] = len(data)
    lengths = collective.all_reduce_sum(lengths)
    n = [int(x) for x in lengths.tolist()]
    slots = torch.zeros((world, max(max(n), 1)), dtype=torch.uint8)
    if data:
        slots[rank, :len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    slots = collective.all_reduce_sum(slots)  # each slot has one writer: no overflow
    return [bytes(slots[r, :n[r]].numpy().tobytes()) for r in range(world)]

"""Where the trainer's model lives: in the daemon's process (`LocalEngine`) or in a group
of torch.distributed rank processes (`fleetrl.actors.trainer.rank_engine.RankEngine`).

`Trainer` (core.py) owns the run's bookkeeping (buffer, task cursor, budgets, metrics,
checkpoint files) and hands every model operation to an engine with this shape:

- ``start(ckpt)``: restore the model and optimizer from a trainer checkpoint (or take
  the model directory's weights when ``ckpt`` is None) and publish them as the next
  weight version;
- ``train(groups, lr=, step=, trainer_version=)``: one step; the returned
  `StepMetrics` carries the published version and delta figures unless skipped;
- ``capture(step)``: the model part of a trainer checkpoint at ``step`` (inline tensors,
  or the directory of a sharded checkpoint written for it);
- ``close()``.

Every method is blocking; the actor runs them in a worker thread under one lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import msgspec
import torch

from fleetrl.actors.model import load_master_weights
from fleetrl.actors.weights import BlobNotFound, LocalDirStore, Publisher, PublisherConfig, StoreSource
from fleetrl.daemon.messages import RolloutGroup

from . import checkpoint as ck
from .batch import build_batch
from .config import TrainerConfig
from .step import RowDetail, StepMetrics, build_optimizer, master_bf16, train_step

__all__ = ["Engine", "LocalEngine", "ModelState", "resume_publisher"]


class ModelState(msgspec.Struct, frozen=True, kw_only=True):
    """The model part of a `TrainerCheckpoint`."""

    fingerprint: str
    model: bytes = b""
    optimizer: bytes = b""
    rng: bytes = b""
    sharded: str | None = None
    """Directory name (under the trainer's ``sharded/``) of a torch.distributed.checkpoint
    holding model, optimizer and per-rank RNG; ``model``/``optimizer`` are then empty."""


class Engine(Protocol):
    vocab_size: int
    version: int
    """Newest published weight version (-1 before ``start``)."""
    digest: str | None
    """Hex digest of that version."""

    def start(self, ckpt: ck.TrainerCheckpoint | None) -> None: ...

    def train(self, groups: Sequence[RolloutGroup], *, lr: float, step: int, trainer_version: int,
              detail: list[RowDetail] | None = None) -> StepMetrics: ...

    def capture(self, step: int) -> ModelState: ...

    def close(self) -> None: ...


def resume_publisher(store: LocalDirStore, publisher: Publisher) -> None:
    """Continue the version sequence of whatever ``store`` already holds (the next
    version is then a full anchor: there is no shadow of the last one here)."""
    try:
        last = StoreSource(store).manifest().version
    except BlobNotFound:
        return
    publisher.resume_after(last)


def publisher_for(cfg: TrainerConfig, state_dir: Path, run_id: str) -> tuple[LocalDirStore, Publisher]:
    """The trainer's weight store (``<state_dir>/weights``) and a publisher into it."""
    store = LocalDirStore(Path(state_dir) / "weights")
    return store, Publisher(store, PublisherConfig(run=run_id, window=cfg.publish_window,
                                                   anchor_every=cfg.anchor_every))


def step_kwargs(cfg: TrainerConfig) -> dict:
    """The `train_step` keyword arguments that come from the config."""
    return dict(corrections=cfg.corrections, temperature=cfg.temperature, grad_clip=cfg.grad_clip,
                pass_threshold=cfg.pass_threshold, share_prompts=cfg.share_prompts,
                micro_batch_tokens=cfg.micro_batch_tokens, logits_chunk_bytes=cfg.logits_chunk_mb << 20)


def with_version(m: StepMetrics, vm) -> StepMetrics:
    """``m`` with the published version's figures (``vm``: `VersionMetrics`)."""
    return msgspec.structs.replace(m, version=vm.version, delta_ratio=vm.ratio_vs_bf16,
                                   delta_density=vm.changed_fraction, delta_bytes=vm.delta_bytes,
                                   publish_s=vm.publish_s)


class LocalEngine:
    """The fp32 master model, AdamW and the publisher in this process, on ``cfg.device``."""

    def __init__(self, cfg: TrainerConfig, state_dir: Path, run_id: str) -> None:
        self.cfg = cfg
        try:
            device = torch.device(cfg.device)
        except RuntimeError as exc:
            raise ValueError(f"TrainerConfig.device {cfg.device!r} is not a torch device: {exc}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"TrainerConfig.device is {cfg.device!r} but CUDA is not available")
        self.model = load_master_weights(cfg.model_dir).to(device)
        self.vocab_size = int(self.model.config.vocab_size)
        self.optimizer = build_optimizer(self.model, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                         weight_decay=cfg.weight_decay)
        self.store, self.publisher = publisher_for(cfg, state_dir, run_id)
        self.version = -1
        self.digest: str | None = None

    def start(self, ckpt: ck.TrainerCheckpoint | None) -> None:
        if ckpt is not None:
            if ckpt.sharded is not None:
                raise ck.CheckpointError(
                    f"trainer checkpoint at step {ckpt.step} is sharded ({ckpt.sharded}); it resumes with "
                    "[ranks] configured (any world size), not in the daemon's process")
            ck.restore_model(ckpt, self.model, self.optimizer)
        else:
            torch.manual_seed(self.cfg.seed)
        resume_publisher(self.store, self.publisher)
        self._publish()

    def _publish(self):
        vm = self.publisher.publish(master_bf16(self.model))
        self.version = vm.version
        self.digest = None if self.publisher.digest is None else self.publisher.digest.hex()
        return vm

    def train(self, groups: Sequence[RolloutGroup], *, lr: float, step: int, trainer_version: int,
              detail: list[RowDetail] | None = None) -> StepMetrics:
        batch = build_batch(groups, self.cfg.advantage)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        m = train_step(self.model, self.optimizer, batch, step=step, trainer_version=trainer_version,
                       detail=detail, **step_kwargs(self.cfg))
        return m if m.skipped else with_version(m, self._publish())

    def capture(self, step: int) -> ModelState:
        return ModelState(**ck.model_parts(self.model, self.optimizer))

    def close(self) -> None:
        pass

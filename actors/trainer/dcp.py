"""Sharded trainer checkpoints with torch.distributed.checkpoint (DCP): atomic, reshardable.

Layout under ``root``::

    step-00000120/            a committed checkpoint (the newest ``keep`` are kept)
        .metadata             DCP's index (written by rank 0)
        __<r>_0.distcp        DCP's data, one file per saving rank
        rng-<r>.bin           rank r's torch CPU RNG state (raw bytes of torch.get_rng_state())
        extra.msgpack         rank 0's ``extra`` (a msgpack map str -> bytes)
        meta.json             {"format": 1, "step": 120, "world_size": 2, "optimizer_empty": false}
        COMMITTED             the marker, written last
    .tmp-step-00000130/       a save in progress, or one that crashed (ignored, cleared by the next save)

The DCP state is ``{"model": ..., "optim": ...}`` from
``torch.distributed.checkpoint.state_dict.get_state_dict``: keys are the model's
fully qualified parameter names (the HF names), values the ranks' shards (DTensors under
FSDP2, plain tensors otherwise), optimizer state keyed by parameter name. DCP stores
every tensor as global chunks, so `load_checkpoint` reshards onto any number of ranks,
sharded or not: the optimizer state follows (``set_state_dict``).

Atomic commit. Every rank writes into ``.tmp-step-<8 digits>/``; after a barrier (every
rank finished its files) rank 0 writes ``COMMITTED`` (a temporary file, fsync, rename),
renames the directory to ``step-<8 digits>/`` and fsyncs ``root``; a last barrier makes
every rank return only once the checkpoint is visible. `latest_checkpoint` considers only
``step-*`` directories holding the marker, so a crash at any point leaves the previous
checkpoint as the newest. The directory must be on a filesystem every rank sees (one
host, or a shared filesystem).

RNG. Each rank saves its own CPU generator state. On load, rank ``r`` restores the state
saved by rank ``r`` when the saving run had that rank, else by rank ``r mod
saved_world_size``: with the same number of ranks each rank continues its own stream
exactly; with more ranks than were saved, the extra ranks repeat a saved rank's stream
(the train step draws no random numbers: this matters only to code that does). CUDA
generator states are not saved.

An optimizer that has never stepped has no state; DCP's ``get_state_dict`` would create
zero state by a zero-learning-rate step (and count it in AdamW's ``step``). Saving records
``optimizer_empty`` and clears that state again, and loading clears it, so a checkpoint
taken before the first step resumes exactly.

Process groups: under an initialised process group every rank of it calls
`save_checkpoint` and `load_checkpoint` (world size 1 included). Without any process
group both work for a plain, unsharded model in one process (DCP's no-distributed mode;
the barriers are skipped).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import msgspec
import torch
from torch import nn

from .errors import CheckpointError

__all__ = ["CheckpointError", "MARKER", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

FORMAT = 1
MARKER = "COMMITTED"
_NAME = re.compile(r"^step-(\d{8})$")
_TMP_PREFIX = ".tmp-step-"


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def _barrier() -> None:
    dist = _dist()
    if dist is not None:
        dist.barrier()


@contextlib.contextmanager
def _single_process_ok():
    """Without a process group DCP warns that it assumes one process: that is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _committed(path: Path) -> bool:
    return path.is_dir() and _NAME.match(path.name) is not None and (path / MARKER).is_file()


def _committed_steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _NAME.match(child.name)
        if m and _committed(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: Path) -> tuple[int, Path] | None:
    """The newest committed checkpoint under ``root`` as ``(step, path)``, or None.

    Directories without the ``COMMITTED`` marker (a save that crashed, a copy in
    progress) and temporary directories are ignored."""
    found = _committed_steps(Path(root))
    return found[-1] if found else None


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, bool]:
    """DCP's state dict of model and optimizer, and whether the optimizer had no state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    empty = len(optimizer.state) == 0
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if empty:
        optimizer.state.clear()  # undo get_state_dict's zero-lr initialising step
    return {"model": model_sd, "optim": optim_sd}, empty


def save_checkpoint(root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    extra: dict[str, bytes] | None = None, keep: int = 3) -> Path:
    """Write a sharded checkpoint of ``model``, ``optimizer``, each rank's RNG and rank 0's
    ``extra`` as ``root/step-<8 digits>/``, commit it, and keep the newest ``keep``
    committed ones (older ones are deleted). Every rank calls it; returns the path.
    A checkpoint already committed at ``step`` is replaced."""
    import torch.distributed.checkpoint as dcp

    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**8:
        raise ValueError(f"save_checkpoint: step must be an int in [0, 1e8), got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"save_checkpoint: keep must be an int >= 1, got {keep!r}")
    if extra is not None and not all(isinstance(k, str) and isinstance(v, bytes | bytearray)
                                     for k, v in extra.items()):
        raise ValueError("save_checkpoint: extra must map str to bytes")
    root = Path(root)
    rank, world = _rank_world()
    name = f"step-{step:08d}"
    tmp, final = root / f"{_TMP_PREFIX}{step:08d}", root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_TMP_PREFIX}*"):  # crashed saves, this step's included
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    state, empty = _state(model, optimizer)
    with _single_process_ok():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=_dist() is None)
    _write_atomic(tmp / f"rng-{rank}.bin", bytes(torch.get_rng_state().numpy().tobytes()))
    if rank == 0:
        _write_atomic(tmp / "extra.msgpack", msgspec.msgpack.encode({k: bytes(v) for k, v in (extra or {}).items()}))
        meta = {"format": FORMAT, "step": step, "world_size": world, "optimizer_empty": empty}
        _write_atomic(tmp / "meta.json", json.dumps(meta).encode())
    _barrier()  # every rank's files are written
    if rank == 0:
        _write_atomic(tmp / MARKER, f"{name} world_size={world}\n".encode())
        if final.exists():
            old = root / f"{_TMP_PREFIX}{step:08d}.old"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        for _, path in _committed_steps(root)[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
    _barrier()  # committed before any rank returns
    return final


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, bytes]:
    """Load the committed checkpoint at ``path`` into ``model`` and ``optimizer`` (sharded
    or not, any number of ranks: DCP reshards), restore this rank's RNG (module
    docstring), and return the saved ``extra``. Every rank calls it.

    Raises `CheckpointError` for a directory that is not a committed checkpoint, or whose
    tensors do not fit this model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not (path / MARKER).is_file():
        raise CheckpointError(f"{path}: not committed (no {MARKER} marker): a save that did not finish")
    try:
        meta = json.loads((path / "meta.json").read_text())
        saved_world = int(meta["world_size"])
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: format {meta.get('format')}, this build reads {FORMAT}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}/meta.json cannot be read: {exc}") from exc
    rank, _ = _rank_world()
    state, _ = _state(model, optimizer)
    try:
        with _single_process_ok():
            dcp.load(state, checkpoint_id=str(path), no_dist=_dist() is None)
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise CheckpointError(f"{path}: cannot be loaded into this model: {exc}") from exc
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if meta.get("optimizer_empty"):
        optimizer.state.clear()
    rng = path / f"rng-{rank % saved_world}.bin"
    torch.set_rng_state(torch.frombuffer(bytearray(rng.read_bytes()), dtype=torch.uint8))
    try:
        extra = msgspec.msgpack.decode((path / "extra.msgpack").read_bytes(), type=dict[str, bytes])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(f"{path}/extra.msgpack cannot be read: {exc}") from exc
    return extra

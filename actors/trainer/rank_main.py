"""One trainer rank process: ``python -m fleetrl.actors.trainer.rank_main --spec FILE --rank R [--fd N]``.

Started by `RankGroup` (the trainer actor), ``world_size`` of them. Each joins the
torch.distributed process group (gloo on CPU, nccl on CUDA; rendezvous at the spec's
address and port), loads the model directory's fp32 master weights, shards them with
FSDP2 (`fsdp.shard_model`: one ``fully_shard`` per decoder block, then the root), and
builds AdamW over its shards. Rank 0 reads `rank_protocol` requests from the socket
whose descriptor is ``--fd`` and broadcasts each request's bytes to the other ranks, so
every rank runs the same command:

- `Start`: load a sharded checkpoint (`dcp.load_checkpoint`, any earlier world size) or
  seed the RNG; rank 0 continues the run's version sequence and, if asked, publishes the
  weights (gathered to rank 0 in bf16, `fsdp.full_bf16_state`) into ``<state_dir>/weights``;
- `Train`: every rank builds the same batch from the groups, trains on its share of the
  rows (`sharding.rank_rows`) with gradients reduced over ranks (`train_step` with a
  `ProcessGroupCollective`), and rank 0 publishes the new version;
- `Save`: a sharded checkpoint of model, optimizer and per-rank RNG (`dcp.save_checkpoint`);
- `Stop`: leave the process group and exit 0.

A request that fails the same way on every rank before any collective (a malformed
group: `BadBatch`) is answered with a non-fatal `RankError`; any other exception is
answered (by rank 0) with a fatal one and ends the process with status 1, and the
actor restarts the group. Each rank exits when its parent process is gone, and rank 0
also when the actor's end of the socket closes.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from fleetrl.actors.model import load_master_weights
from fleetrl.harness.processes import exit_with_parent

from . import dcp
from .batch import build_batch
from .collective import ProcessGroupCollective
from .engine import publisher_for, resume_publisher, step_kwargs, with_version
from .errors import BadBatch
from .fsdp import full_bf16_state, shard_model
from .rank_group import RankSpec
from .rank_protocol import FrameReader, RankError, Ready, Save, Saved, Start, Stop, Train, Trained, \
    decode_request, frame
from .sharding import rank_rows
from .step import RowDetail, build_optimizer, train_step

__all__ = ["main"]


class Rank:
    """One rank's model, optimizer and (rank 0) socket and publisher."""

    def __init__(self, spec: RankSpec, rank: int, device: torch.device, sock: socket.socket | None) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        cfg = spec.config
        assert cfg.ranks is not None
        self.cfg, self.spec, self.rank, self.device, self.sock = cfg, spec, rank, device, sock
        self.world = spec.world_size
        self.reader = FrameReader()
        mesh = init_device_mesh(device.type, (self.world,))
        model = load_master_weights(cfg.model_dir).to(device)
        self.vocab_size = int(model.config.vocab_size)
        bf16 = cfg.ranks.param_dtype == "bf16"
        self.model = shard_model(model, mesh=mesh, param_dtype=torch.bfloat16 if bf16 else None,
                                 reduce_dtype=torch.float32 if bf16 else None,
                                 activation_checkpointing=cfg.ranks.activation_checkpointing)
        self.optimizer = build_optimizer(self.model, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                         weight_decay=cfg.weight_decay)
        self.collective = ProcessGroupCollective(device=device)
        self.sharded_root = Path(spec.state_dir) / "sharded"
        self.store = self.publisher = None
        if rank == 0:
            self.store, self.publisher = publisher_for(cfg, Path(spec.state_dir), spec.run_id)
        self.version: int | None = None

    # -- transport --------------------------------------------------------------------
    def _read_request(self) -> bytes | None:
        """Rank 0: the next request's bytes from the actor (None: the actor is gone)."""
        assert self.sock is not None
        while True:
            body = self.reader.next_frame()
            if body is not None:
                return body
            data = self.sock.recv(1 << 20)
            if not data:
                return None
            self.reader.feed(data)

    def _broadcast(self, body: bytes | None) -> bytes:
        """Rank 0's ``body`` on every rank (an empty body means: the actor is gone)."""
        dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        n = torch.tensor([len(body) if body is not None else 0], dtype=torch.int64, device=dev)
        dist.broadcast(n, src=0)
        size = int(n.item())
        if size == 0:
            return b""
        if self.rank == 0:
            assert body is not None
            buf = torch.frombuffer(bytearray(body), dtype=torch.uint8).to(dev)
        else:
            buf = torch.empty(size, dtype=torch.uint8, device=dev)
        dist.broadcast(buf, src=0)
        return body if self.rank == 0 and body is not None else bytes(buf.cpu().numpy().tobytes())

    def _reply(self, msg) -> None:
        if self.rank == 0:
            assert self.sock is not None
            self.sock.sendall(frame(msg))

    # -- commands ---------------------------------------------------------------------
    def _publish(self):
        state = full_bf16_state(self.model)  # a collective: every rank takes part
        if self.rank != 0:
            return None
        assert self.publisher is not None and state is not None
        vm = self.publisher.publish(state)
        self.version = vm.version
        return vm

    def _digest(self) -> str | None:
        if self.publisher is None or self.publisher.digest is None:
            return None
        return self.publisher.digest.hex()

    def start(self, req: Start) -> Ready:
        if req.resume is not None:
            dcp.load_checkpoint(self.sharded_root / req.resume, self.model, self.optimizer)
        else:
            torch.manual_seed(self.cfg.seed)
        if self.rank == 0:
            resume_publisher(self.store, self.publisher)
        vm = self._publish() if req.publish else None
        pids: list = [None] * self.world
        dist.all_gather_object(pids, os.getpid())
        return Ready(vocab_size=self.vocab_size, version=None if vm is None else vm.version,
                     digest=self._digest() if vm is not None else None, world_size=self.world, pids=pids)

    def train(self, req: Train) -> Trained:
        batch = build_batch(req.groups, self.cfg.advantage)
        local = rank_rows(batch, self.rank, self.world)
        for group in self.optimizer.param_groups:
            group["lr"] = req.lr
        rows: list[RowDetail] | None = [] if req.detail else None
        m = train_step(self.model, self.optimizer, local, step=req.step, trainer_version=req.trainer_version,
                       collective=self.collective, detail=rows, **step_kwargs(self.cfg))
        digest = None
        if not m.skipped and req.publish:
            vm = self._publish()
            if vm is not None:
                m = with_version(m, vm)
                digest = self._digest()
        return Trained(metrics=msgspec.msgpack.encode(m), digest=digest,
                       detail=msgspec.msgpack.encode(rows) if rows else b"")

    def save(self, req: Save) -> Saved:
        path = dcp.save_checkpoint(self.sharded_root, req.step, self.model, self.optimizer,
                                   keep=self.cfg.ranks.keep_checkpoints)
        return Saved(step=req.step, path=Path(path).name)

    def serve(self) -> int:
        while True:
            body = self._broadcast(self._read_request() if self.rank == 0 else None)
            if not body:
                return 0  # the actor closed the socket
            req = decode_request(body)
            try:
                match req:
                    case Start():
                        self._reply(self.start(req))
                    case Train():
                        self._reply(self.train(req))
                    case Save():
                        self._reply(self.save(req))
                    case Stop():
                        dist.barrier()
                        return 0
            except BadBatch as exc:  # raised by build_batch on every rank alike, before any collective
                self._reply(RankError(error=f"{type(exc).__name__}: {exc}", kind=type(exc).__name__, fatal=False))
            except Exception as exc:
                traceback.print_exc()
                self._reply(RankError(error=f"rank {self.rank}: {type(exc).__name__}: {exc}",
                                      kind=type(exc).__name__, fatal=True))
                return 1


def _device(cfg_device: str, rank: int) -> torch.device:
    device = torch.device(cfg_device)
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise RuntimeError(f"TrainerConfig.device is {cfg_device!r} but CUDA is not available")
        device = torch.device("cuda", rank % count)
        torch.cuda.set_device(device)
    return device


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fleetrl.actors.trainer.rank_main")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--fd", type=int, default=None, help="rank 0: the socket to the trainer actor")
    args = ap.parse_args(argv)
    exit_with_parent(os.getppid(), interval_s=1.0)  # no rank outlives the trainer that started it
    spec = msgspec.json.decode(Path(args.spec).read_bytes(), type=RankSpec)
    cfg = spec.config
    assert cfg.ranks is not None
    threads = int(os.environ.get("FLEETRL_RANK_THREADS", "0") or 0)
    if threads:
        torch.set_num_threads(threads)
    sock = socket.socket(fileno=args.fd) if args.fd is not None else None
    device = _device(cfg.device, args.rank)
    backend = cfg.ranks.backend if cfg.ranks.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, init_method=f"tcp://{spec.master_addr}:{spec.master_port}", rank=args.rank,
                            world_size=spec.world_size, timeout=timedelta(seconds=cfg.ranks.start_timeout_s))
    print(f"rank {args.rank}/{spec.world_size} pid {os.getpid()} joined ({backend}, {device})", flush=True)
    try:
        rank = Rank(spec, args.rank, device, sock)
        return rank.serve()
    except Exception:
        traceback.print_exc()
        if sock is not None and args.rank == 0:
            try:
                err = sys.exc_info()[1]
                sock.sendall(frame(RankError(error=f"rank 0: {type(err).__name__}: {err}",
                                             kind=type(err).__name__, fatal=True)))
            except OSError:
                pass
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

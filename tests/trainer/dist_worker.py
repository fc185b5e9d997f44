"""A torch.distributed rank for the FSDP2 and DCP tests, and the launcher the tests use.

Run as ``python dist_worker.py SPEC RANK``: joins a gloo group on 127.0.0.1 (the port is
in the spec), then runs the spec's ops in order, each a list whose first item names it:

- ``["init", {"shard": bool, "optimizer": "adamw"|"sgd", "activation_checkpointing": bool}]``:
  a fresh model from ``model_dir`` (FSDP2 over all ranks when ``shard``) and optimizer,
  and the RNG seeded per rank (``1000 + rank``);
- ``["step", batch_name, micro_batch_tokens|None]``: `train_step` on this rank's rows of
  the batch (``np.array_split`` of the rows over the ranks; rank 0 holds row 0);
- ``["save", root, step]`` / ``["load", path]``: `dcp.save_checkpoint` / `load_checkpoint`;
- ``["dump", name]``: rank 0 writes ``out/name.pt``: the full fp32 state, `full_bf16_state`
  and the steps' metrics so far; every rank writes ``out/name.rank<r>.metrics`` (msgpack);
- ``["rng", name]``: every rank writes ``out/name.rank<r>.pt``: ``torch.rand(4)``.

The test modules load this file by path (`load`) for `launch` and `step_kwargs`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def step_kwargs():
    from fleetrl.grpo import CorrectionConfig

    return dict(corrections=CorrectionConfig(mask_low=0.8, mask_high=1.25, seq_mask=(0.9, 1.1)), temperature=1.15,
                grad_clip=1.0, pass_threshold=1.0, trainer_version=2)


def make_optimizer(model, kind: str):
    import torch

    from fleetrl.actors.trainer.step import build_optimizer

    if kind == "sgd":
        return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    return build_optimizer(model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: dict, world: int, workdir: Path, timeout: float = 150.0) -> None:
    """Run ``world`` ranks of ``spec`` as subprocesses; raise with their output if any fails."""
    spec = {**spec, "world": world, "port": free_port(), "out": str(workdir)}
    path = workdir / f"spec-{spec['port']}.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(spec["port"])}
    procs = [subprocess.Popen([sys.executable, str(HERE), str(path), str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(world)]
    outputs, failed = [], False
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out.decode(errors="replace")[-4000:])
            failed |= p.returncode != 0
    except subprocess.TimeoutExpired:
        failed = True
        outputs.append(f"timed out after {timeout}s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed:
        raise AssertionError("rank processes failed:\n" + "\n----\n".join(outputs))


def load():
    """This file as a module (the tests run with --import-mode=importlib)."""
    spec = importlib.util.spec_from_file_location("fleetrl_test_dist_worker", HERE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(spec_path: str, rank: int) -> int:
    import msgspec
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fleetrl.actors.model import load_master_weights
    from fleetrl.actors.trainer import dcp
    from fleetrl.actors.trainer.batch import select_rows
    from fleetrl.actors.trainer.collective import ProcessGroupCollective
    from fleetrl.actors.trainer.fsdp import full_bf16_state, full_state, shard_model
    from fleetrl.actors.trainer.step import train_step

    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    world, out = spec["world"], Path(spec["out"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        coll = ProcessGroupCollective()
        batches = pickle.loads(Path(spec["batches"]).read_bytes())
        model = opt = None
        metrics: list = []
        step = 0
        for op, *args in spec["ops"]:
            if op == "init":
                (o,) = args
                torch.manual_seed(1000 + rank)  # a stream of its own per rank
                model = load_master_weights(spec["model_dir"])
                if o.get("shard", True):
                    model = shard_model(model, mesh=mesh, activation_checkpointing=o.get("activation_checkpointing",
                                                                                         False))
                opt = make_optimizer(model, o.get("optimizer", "adamw"))
                metrics, step = [], 0
            elif op == "step":
                name, micro = args
                batch = batches[name]
                rows = np.array_split(np.arange(batch.tokens.shape[0]), world)[rank].tolist()
                local = select_rows(batch, rows) if world > 1 else batch
                m = train_step(model, opt, local, step=step, micro_batch_tokens=micro, collective=coll,
                               **step_kwargs())
                step = m.step
                metrics.append(m)
            elif op == "save":
                root, at = args
                dcp.save_checkpoint(Path(root), at, model, opt, extra={"who": f"world {world}".encode()}, keep=2)
            elif op == "load":
                (path,) = args
                extra = dcp.load_checkpoint(Path(path), model, opt)
                assert extra["who"].startswith(b"world "), extra
            elif op == "dump":
                (name,) = args
                state, bf16 = full_state(model), full_bf16_state(model)
                (out / f"{name}.rank{rank}.metrics").write_bytes(msgspec.msgpack.encode(metrics))
                if rank == 0:
                    torch.save({"state": state, "bf16": bf16}, out / f"{name}.pt")
                else:
                    assert state is None and bf16 is None
            elif op == "rng":
                (name,) = args
                torch.save(torch.rand(4), out / f"{name}.rank{rank}.pt")
            else:
                raise ValueError(f"unknown op {op!r}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))

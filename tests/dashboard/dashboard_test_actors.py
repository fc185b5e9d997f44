"""A fake trainer for the dashboard tests (``dashboard_test_actors:trainer`` via
``actors_module``): it publishes the tiny model's weights as ``versions`` versions, one
every ``every_s`` seconds, announcing each to the pool, and writes what a trainer and an
evaluator write for each: a metrics.jsonl row and, every other version, an eval.jsonl
row of the fresh split.

`by_hand_worker`: a remote environment worker spoken by hand (no Docker, no harness): it
joins the remote workers actor, says it is ready, holds the task it is given and beats
until cancelled, so the workers table has a remote worker that is ``up``."""

from __future__ import annotations

import json
import random
from typing import Any

import msgspec
import trio


class TrainerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model_dir: str
    weights_dir: str
    versions: int = 6
    every_s: float = 0.7
    pool: str = "pool"


async def trainer(cfg: TrainerConfig, ctx: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    import torch

    from fleetrl.actors.model.tiny_llama import read_state_dict
    from fleetrl.actors.weights import LocalDirStore, Publisher, PublisherConfig
    from fleetrl.daemon.messages import WeightVersionAvailable

    weights = {k: v.to(torch.bfloat16) for k, v in read_state_dict(cfg.model_dir).items()}
    pub = Publisher(LocalDirStore(cfg.weights_dir), PublisherConfig(run=ctx.run_id))
    pool = ctx.sender(cfg.pool)
    metrics = ctx.state_dir / "metrics.jsonl"
    evals = ctx.daemon_dir / "actors" / "evaluator" / "eval.jsonl"
    evals.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)

    async def publish() -> None:
        await trio.to_thread.run_sync(pub.publish, weights)
        await pool.send(WeightVersionAvailable(version=pub.version, digest=pub.digest.hex(), base=None, blobs=()))

    await publish()
    task_status.started()
    for v in range(1, cfg.versions + 1):
        await trio.sleep(cfg.every_s)
        first = next(iter(weights))
        weights[first] = (weights[first].float() + 0.01).to(torch.bfloat16)
        await publish()
        row = {"step": v, "version": v, "reward_mean": 0.3 + 0.05 * v + rng.uniform(-0.02, 0.02),
               "pass_rate": 0.2 + 0.03 * v, "grad_norm": rng.uniform(0.1, 0.5), "loss": rng.uniform(-0.1, 0.1),
               "mismatch_kl_k3": 1e-6 * v, "delta_ratio": 3.5 + rng.random(), "usd_per_rollout": 1e-6 * (1 + v),
               "staleness_hist": {"0": 6, "1": v % 3}, "tokens_per_s": 2000.0 + v,
               "mismatch_kl_by_sampler": {"torch/bfloat16": 7e-6 * v, "torch/float32": 1.5e-7 * v,
                                          "torch/float8_e4m3fn": 3e-5 * v}, "skipped": False}
        with metrics.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if v % 2 == 0:
            p = 0.3 + 0.02 * v
            with evals.open("a") as f:
                f.write(json.dumps({"version": v, "step": v, "split": "fresh", "n": 200, "passed": int(200 * p),
                                    "pass_at_1": p, "ci_low": p - 0.06, "ci_high": p + 0.06, "mean_reward": p,
                                    "time": 0.0}) + "\n")
        ctx.log.warning("a warning the events list shows", version=v)
    await ctx.wait_draining()


async def by_hand_worker(url: str, token: str, *, name: str = "by-hand",
                         task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Join the workers actor at `url` (``ws://.../workers/join``) with a worker `token`,
    be ready (a first heartbeat), then read and drop what comes (the task it holds) and
    beat until cancelled or the daemon hangs up; `task_status.started` gets the worker id
    once it is ready."""
    from trio_websocket import ConnectionClosed

    from fleetrl.actors.pool.remote_client import connect
    from fleetrl.daemon import messages as m
    from fleetrl.daemon import worker_messages as w

    codec = w.WORKERS
    async with connect(url) as ws:
        await ws.send_message(codec.encode(w.WorkerJoin(token=token, name=name, groups=1)))
        welcome = codec.decode(await ws.get_message())
        assert isinstance(welcome, w.WorkerWelcome), welcome
        assert isinstance(codec.decode(await ws.get_message()), w.HarnessShipped)

        async def beat() -> None:
            while True:
                await ws.send_message(codec.encode(m.Heartbeat(sampler_id=welcome.worker_id, sent_at=0.0)))
                await trio.sleep(min(0.5, welcome.heartbeat_s))

        try:
            async with trio.open_nursery() as n:
                n.start_soon(beat)
                task_status.started(welcome.worker_id)
                while True:
                    await ws.get_message()
        except* ConnectionClosed:  # the daemon is shutting down
            pass

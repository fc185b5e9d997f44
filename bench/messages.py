"""Message throughput of the runtime kernel, against bare Trio in the same run.

1. Pipeline: a 3-stage pipeline (source -> relay -> sink) moving N small typed
   messages. Baseline: three tasks joined by bare ``trio.open_memory_channel``s.
   Ours: the same three stages as supervised actors (fleetrl.daemon.supervisor),
   wired by ``ctx.sender`` / ``ctx.inbox`` with the same inbox capacity, each stage
   honouring pause (``ctx.paused``) per message as a real actor does. Goal: >= 0.8 of
   bare channels' messages per second.
2. Codec: msgpack encode + decode of a typical `Trajectory` (2,000 tokens, support
   K=20) through the validating ROLLOUTS codec, against msgspec's untyped msgpack
   round trip of the same message (the cost of validation at a process boundary).

Each measurement is the best of ``--repeats`` runs. Prints a table and ends with one
JSON line. Run: ``.venv/bin/python bench/messages.py [--n 50000] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from functools import partial
from typing import Any

import msgspec
import trio

from fleetrl.daemon.actor import ActorContext
from fleetrl.daemon.config import ActorSpec, Config, DaemonSection, HttpSection, RestartPolicy
from fleetrl.daemon.logs import configure_logging
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor


class Item(msgspec.Struct, frozen=True):
    seq: int
    payload: str


class StageConfig(msgspec.Struct, frozen=True):
    n: int = 0
    target: str = ""


# -- baseline: bare channels -----------------------------------------------------------
async def bare_pipeline(n: int, capacity: int) -> float:
    s1, r1 = trio.open_memory_channel[Item](capacity)
    s2, r2 = trio.open_memory_channel[Item](capacity)
    done = trio.Event()
    t0 = 0.0

    async def source() -> None:
        nonlocal t0
        t0 = time.perf_counter()
        async with s1:
            for i in range(n):
                await s1.send(Item(i, "x"))

    async def relay() -> None:
        async with r1, s2:
            async for item in r1:
                await s2.send(item)

    async def sink() -> None:
        count = 0
        async with r2:
            async for _ in r2:
                count += 1
        assert count == n
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sink)
        nursery.start_soon(relay)
        nursery.start_soon(source)
    return time.perf_counter() - t0


# -- ours: supervised actors -----------------------------------------------------------
class _Run:
    def __init__(self) -> None:
        self.go = trio.Event()
        self.done = trio.Event()
        self.t0 = 0.0
        self.t1 = 0.0
        self.count = 0


async def source(cfg: StageConfig, ctx: ActorContext, *, run: _Run,
                 task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    out = ctx.sender(cfg.target)
    task_status.started()
    await run.go.wait()
    run.t0 = time.perf_counter()
    async with out:
        for i in range(cfg.n):
            if ctx.paused:
                await ctx.wait_unpaused()
            await out.send(Item(i, "x"))


async def relay(cfg: StageConfig, ctx: ActorContext, *, run: _Run,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    out = ctx.sender(cfg.target)
    task_status.started()
    async with out:
        async for item in ctx.inbox:
            if ctx.paused:
                await ctx.wait_unpaused()
            await out.send(item)


async def sink(cfg: StageConfig, ctx: ActorContext, *, run: _Run,
               task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started()
    async for _ in ctx.inbox:
        run.count += 1
        if run.count == cfg.n:
            run.t1 = time.perf_counter()
            run.done.set()


async def supervised_pipeline(n: int, capacity: int, state_root: str) -> float:
    run = _Run()
    policy = RestartPolicy(jitter=0.0)

    def spec(name: str, fn: Any, cfg: StageConfig, after: tuple[str, ...]) -> ActorSpec:
        return ActorSpec(name=name, factory=f"bench:{name}", run=partial(fn, run=run),
                         config=cfg, after=after, inbox=capacity, restart=policy)

    cfg = Config(
        daemon=DaemonSection(checkpoint_interval_s=3600.0, grace_s=5.0),
        http=HttpSection(enabled=False),
        actors=(spec("sink", sink, StageConfig(n=n), ()),
                spec("relay", relay, StageConfig(target="sink"), ("sink",)),
                spec("source", source, StageConfig(n=n, target="relay"), ("relay",))),
    )
    with StateDir(tempfile.mkdtemp(dir=state_root)) as state:
        sup = Supervisor(cfg, state, rng=random.Random(0))
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(sup.run, handle_signals=False))
            run.go.set()
            await run.done.wait()
            sup.request_shutdown("bench done")
    assert run.count == n
    return run.t1 - run.t0


# -- codec -----------------------------------------------------------------------------
def codec_roundtrips(repeats: int, loops: int) -> tuple[float, float, int]:
    from fleetrl.daemon.examples import example_trajectory
    from fleetrl.daemon.messages import ROLLOUTS

    msg = example_trajectory()
    frame = ROLLOUTS.encode(msg)
    assert ROLLOUTS.decode(frame) == msg
    plain_enc = msgspec.msgpack.Encoder()
    plain_dec = msgspec.msgpack.Decoder()

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(loops):
                fn()
            times.append((time.perf_counter() - t) / loops)
        return min(times)

    ours = best(lambda: ROLLOUTS.decode(ROLLOUTS.encode(msg)))
    base = best(lambda: plain_dec.decode(plain_enc.encode(msg)))
    return ours, base, len(frame)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=50_000, help="messages per pipeline run")
    ap.add_argument("--capacity", type=int, default=16, help="inbox / channel capacity")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--codec-loops", type=int, default=200)
    args = ap.parse_args()
    configure_logging(level="warning")  # kernel log lines to stderr, warnings only

    bare, ours = [], []
    with tempfile.TemporaryDirectory() as root:
        for _ in range(args.repeats):  # interleaved so drift hits both alike
            bare.append(trio.run(bare_pipeline, args.n, args.capacity))
            ours.append(trio.run(supervised_pipeline, args.n, args.capacity, root))
    bare_rate = args.n / min(bare)
    ours_rate = args.n / min(ours)
    ratio = ours_rate / bare_rate
    print(f"3-stage pipeline, {args.n} messages, capacity {args.capacity}, best of {args.repeats}")
    print(f"  bare trio channels : {bare_rate:12,.0f} msg/s")
    print(f"  supervised actors  : {ours_rate:12,.0f} msg/s   ratio {ratio:.3f} (goal >= 0.8)")

    codec_ours, codec_base, frame_len = codec_roundtrips(args.repeats, args.codec_loops)
    print(f"Trajectory msgpack encode+decode ({frame_len:,} bytes/frame)")
    print(f"  untyped msgspec    : {codec_base * 1e6:10.1f} us  ({1 / codec_base:,.0f}/s)")
    print(f"  ROLLOUTS codec     : {codec_ours * 1e6:10.1f} us  ({1 / codec_ours:,.0f}/s)"
          f"   ratio {codec_base / codec_ours:.3f} of untyped speed")
    print(json.dumps({
        "bench": "messages", "n": args.n, "capacity": args.capacity, "repeats": args.repeats,
        "bare_msgs_per_s": round(bare_rate), "supervised_msgs_per_s": round(ours_rate),
        "pipeline_ratio": round(ratio, 4), "pipeline_goal": 0.8,
        "pipeline_goal_met": ratio >= 0.8,
        "trajectory_frame_bytes": frame_len,
        "trajectory_roundtrip_us": round(codec_ours * 1e6, 2),
        "trajectory_untyped_roundtrip_us": round(codec_base * 1e6, 2),
        "trajectory_roundtrips_per_s": round(1 / codec_ours),
        "codec_ratio_vs_untyped": round(codec_base / codec_ours, 4),
    }))


if __name__ == "__main__":
    main()

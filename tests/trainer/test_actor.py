"""The trainer actor under a real Supervisor: consumes groups, trains, publishes versions
a follower reaches, checkpoints, and resumes without losing or repeating a group."""

from __future__ import annotations

import json
import random
from functools import partial
from pathlib import Path

import torch
import trio
from safetensors.torch import load as st_load

from fleetrl.actors.buffer import StaleGroup
from fleetrl.actors.model import BOS_ID
from fleetrl.actors.trainer import checkpoint as ck
from fleetrl.actors.weights import Follower, LocalDirStore, StoreSource
from fleetrl.daemon.checkpoint import CheckpointStore
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.messages import RolloutFailed, SamplerMismatch
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor


BASE = """
[daemon]
grace_s = 60.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
"""


def _config(model_dir: str, **extra) -> str:
    cfg = {"model_dir": model_dir, "groups_per_step": 2, "lr": 1e-2, "checkpoint_every": 1,
           "max_staleness": 1, "stale_reports_to": "pool", **extra}
    inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in cfg.items())
    return BASE + f"""
[actors.pool]
factory = "trainer_test_actors:sink"
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
inbox = 4
config = {{{inline}}}
[actors.feeder]
factory = "trainer_test_actors:feeder"
after = ["trainer"]
"""


async def _run(state_path: Path, text: str, until_step: int) -> tuple[dict, bytes]:
    """Run a supervisor until the trainer reports ``until_step``, then drain it."""
    cfg = load_config_text(text, source="test.toml")
    state = StateDir(state_path).open()
    sup = Supervisor(cfg, state, rng=random.Random(0))
    with state, trio.fail_after(120):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            while sup.status()["actors"]["trainer"]["versions"].get("step", -1) < until_step:
                assert sup.status()["actors"]["trainer"]["state"] in ("starting", "running"), sup.status()
                await trio.sleep(0.05)
            await trio.sleep(0.2)  # let the feeder finish handing over the rest
            sup.request_shutdown("test")
        status = sup.status()
        text_metrics = sup.metrics_text()
    return status, text_metrics


def _trained_ids(state_path: Path) -> tuple[ck.TrainerCheckpoint, list[dict]]:
    ckpt, _ = CheckpointStore(state_path / "checkpoints").load_latest()
    tc = ck.decode(ckpt.actors["trainer"])
    lines = (state_path / "actors" / "trainer" / "metrics.jsonl").read_text().splitlines()
    return tc, [json.loads(x) for x in lines]


async def test_actor_trains_publishes_and_a_follower_reaches_the_digest(model_dir, groups, feed, tmp_path):
    prompt = [BOS_ID, *b"def f(x):"]
    bad = groups.segment([BOS_ID], [70], [0.0], [[(71, 0.0)]], [2])  # token not in its support
    fresh = [groups.sampled(model_dir, f"g{i}", prompt, [1.0, 0.0, 0.0], seed=20 + i) for i in range(4)]
    feed.FEED.extend([
        fresh[0],
        groups.sampled(model_dir, "flat", prompt, [1.0, 1.0], seed=30),  # zero variance
        fresh[1],                                                         # -> step 1, version 1
        fresh[0],                                                         # duplicate (trained)
        RolloutFailed(attempt_id="x", task_id="t", reason="timeout", detail="slow"),
        fresh[2], fresh[3],                                               # -> step 2, version 2
        groups.versioned("old", 0),                                       # staleness 2 > 1
        groups.group_of("broken", [([bad], 1.0), ([bad], 0.0)]),           # malformed: refused
    ])
    state_path = tmp_path / "state"
    status, metrics = await _run(state_path, _config(model_dir), until_step=2)

    tr = status["actors"]["trainer"]
    assert tr["versions"] == {"version": 2, "step": 2} and tr["restarts"] == 0
    assert b'fleetrl_trainer_version{actor="trainer"} 2.0' in metrics
    for outcome, n in (("admitted", 4), ("zero_variance", 1), ("duplicate", 1), ("too_stale", 1),
                       ("attempt_failed", 1), ("malformed", 1)):
        assert f'fleetrl_trainer_groups_total{{actor="trainer",outcome="{outcome}"}} {n}.0'.encode() in metrics
    assert b'fleetrl_trainer_mismatch_kl_by_sampler{actor="trainer",sampler="torch/float32"}' in metrics
    assert b'fleetrl_trainer_mismatch_out_of_band_by_sampler_id{actor="trainer",sampler_id="s-fp32"}' in metrics
    assert b'fleetrl_trainer_mismatch_reports_total{actor="trainer",result="sent"} 2.0' in metrics
    # the stale group was reported to the pool as a typed rejection, not dropped
    stale = [x for x in feed.GOT if isinstance(x, StaleGroup)]
    assert len(stale) == 1 and stale[0].group_id == "old" and stale[0].staleness == 2
    # and after each step the pool was told the measured mismatch of each sampler
    reports = [x for x in feed.GOT if not isinstance(x, StaleGroup)]
    assert [type(x) for x in reports] == [SamplerMismatch, SamplerMismatch]
    assert [(x.step, x.version) for x in reports] == [(1, 1), (2, 2)]
    figs = []
    for x in reports:
        [(ident, fig)] = x.by_sampler
        assert ident.sampler_id == "s-fp32" and ident.dtype == "float32" and fig.tokens > 0
        assert x.by_kind == {"torch/float32": fig} and (x.mask_low, x.mask_high) == (0.5, 5.0)
        figs.append(fig)
    # step 1 trains version-0 tokens at version 0 (fp32 sampler: no mismatch); step 2
    # trains version-0 tokens at version 1, one large step later: the staleness shows
    assert figs[0].kl_k3 < 1e-6 and figs[0].frac_out_of_band == 0.0
    assert figs[1].kl_k3 > 1e-3

    tc, lines = _trained_ids(state_path)
    assert [x["step"] for x in lines] == [1, 2] and [x["version"] for x in lines] == [1, 2]
    assert all(x["groups"] == 2 and not x["skipped"] and x["delta_density"] > 0 for x in lines)
    assert lines[0]["staleness_hist"] == {"0": 2} and lines[1]["staleness_hist"] == {"1": 2}
    assert set(tc.buffer.trained_ids) == {"g0", "g1", "g2", "g3"} and tc.buffer.queued == ()
    assert (tc.step, tc.version) == (2, 2)

    # a follower syncing from the trainer's store reaches the published digest, and its
    # bf16 weights are the checkpointed fp32 master weights rounded to bf16
    store = LocalDirStore(state_path / "actors" / "trainer" / "weights")
    source = StoreSource(store)
    manifest = source.manifest()
    follower = Follower.from_manifest(manifest)
    follower.sync(source)
    assert follower.version == manifest.version == 2
    assert follower.digest.hex() == manifest.digest and follower.verify()
    master = st_load(tc.model)
    for name, t in follower.weights.items():
        assert torch.equal(t, master[name].to(torch.bfloat16)), name


async def test_restart_resumes_without_losing_or_repeating_groups(model_dir, groups, feed, tmp_path):
    prompt = [BOS_ID, *b"x = "]
    gs = [groups.sampled(model_dir, f"r{i}", prompt, [0.0, 1.0], seed=40 + i) for i in range(4)]
    state_path = tmp_path / "state"
    feed.FEED.extend(gs[:3])  # step 1 on r0, r1; r2 stays queued
    await _run(state_path, _config(model_dir, max_staleness=3), until_step=1)
    tc1, lines1 = _trained_ids(state_path)
    assert [g.group_id for g in tc1.buffer.queued] == ["r2"]
    # lose the daemon's checkpoints: the trainer must resume from its own file
    for f in (state_path / "checkpoints").iterdir():
        f.unlink()

    feed.FEED.clear()
    feed.FEED.extend([gs[0], gs[3]])  # r0 re-sent (already trained), r3 new
    status, metrics = await _run(state_path, _config(model_dir, max_staleness=3), until_step=2)
    tc2, lines = _trained_ids(state_path)
    assert [x["step"] for x in lines] == [1, 2]
    # version sequence continues: 0, 1 published before; the restart publishes 2 (an
    # anchor of the restored weights) and the next step 3
    assert [x["version"] for x in lines] == [1, 3]
    assert status["actors"]["trainer"]["versions"]["version"] == 3
    assert sorted(tc2.buffer.trained_ids) == ["r0", "r1", "r2", "r3"] and tc2.buffer.queued == ()
    assert tc2.buffer.counters.trained == 4
    assert b'fleetrl_trainer_groups_total{actor="trainer",outcome="duplicate"} 1.0' in metrics

"""Correction alarms: a step that masks more than the configured share raises an alarm seen
in metrics.jsonl, /status, the log (so the dashboard's events) and Prometheus; a step that
masks every token halts the run with a clear error (exit code 7), within that one step."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import numpy as np
import pytest
import structlog
import trio

from fleetrl.actors.dashboard.snapshot import event_of
from fleetrl.actors.model import BOS_ID
from fleetrl.actors.trainer.alarms import ALARM_KINDS, step_alarms
from fleetrl.actors.trainer.config import CorrectionAlarms
from fleetrl.actors.trainer.step import ALL_MASKED_REASON, StepMetrics
from fleetrl.daemon import messages as m
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.faults import ExitCode
from fleetrl.daemon.protocol import Tensor
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor

BASE = """
[daemon]
grace_s = 3.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
"""


def test_step_alarms_name_each_share_over_its_threshold_and_only_those():
    cfg = CorrectionAlarms(masked_tokens=0.25, masked_sequences=0.5, excluded_rows=0.25)
    quiet = StepMetrics(step=3, tokens=100, frac_masked_tokens=0.25, frac_masked_sequences=0.5,
                        frac_excluded_rows=0.25, excluded_rows={"greedy": 1})
    assert step_alarms(quiet, cfg) == []  # at the threshold: no alarm
    loud = msgspec.structs.replace(quiet, frac_masked_tokens=0.4, frac_masked_sequences=0.6, frac_excluded_rows=0.5)
    got = step_alarms(loud, cfg)
    assert [a.kind for a in got] == ["masked_tokens", "masked_sequences", "excluded_rows"]
    assert got[0].value == 0.4 and got[0].threshold == 0.25 and "40.0%" in got[0].message and got[0].fix
    assert "1 greedy" in got[2].message and "override" in got[2].fix
    assert not any(a.fatal for a in got)
    dead = StepMetrics(step=3, tokens=50, skipped=True, skipped_reason=ALL_MASKED_REASON, frac_masked_tokens=1.0)
    [a] = step_alarms(dead, cfg)
    assert a.kind == "all_masked" and a.fatal and "every one of the step's 50 tokens" in a.message
    off = CorrectionAlarms(masked_tokens=1.0, masked_sequences=1.0, excluded_rows=1.0)
    assert step_alarms(loud, off) == [] and [a.kind for a in step_alarms(dead, off)] == ["all_masked"]
    assert set(ALARM_KINDS) == {"all_masked", "masked_tokens", "masked_sequences", "excluded_rows", "tail_mass"}
    wide = StepMetrics(step=4, tokens=10, vocabulary_tokens=10, tail_mass_mean=0.2, centering_bound_max=1.5)
    [t] = step_alarms(wide, cfg)
    assert t.kind == "tail_mass" and t.value == 0.2 and "max_support" in t.fix
    assert step_alarms(msgspec.structs.replace(wide, tail_mass_mean=0.01), cfg) == []


def _lower_sampled_token(seg: m.TokenSegment, positions: set[int], factor: float = 20.0) -> m.TokenSegment:
    """``seg`` with the sampler's q^S of the sampled token divided by ``factor`` at
    ``positions`` (the rest of the support scaled up to keep it normalised): there the
    trainer's ratio p/q is about ``factor``, past any sane band. The record stays valid."""
    off = seg.support.offsets.to_numpy()
    ids = seg.support.ids.to_numpy()
    lps = seg.support.logprobs.to_numpy().astype(np.float64).copy()
    tok = seg.token_ids.to_numpy()
    token_lp = seg.logprobs.to_numpy().astype(np.float64).copy()
    for t in positions:
        s, e = off[t], off[t + 1]
        q = np.exp(lps[s:e])
        a = int(np.argmax(ids[s:e] == tok[t]))
        qa = q[a] / factor
        rest = np.delete(np.arange(e - s), a)
        q[rest] *= (1.0 - qa) / q[rest].sum()
        q[a] = qa
        lps[s:e] = np.log(q)
        token_lp[t] = np.log(qa)
    support = m.SupportCSR(ids=seg.support.ids, logprobs=Tensor.from_numpy(lps), offsets=seg.support.offsets)
    return msgspec.structs.replace(seg, support=support, logprobs=Tensor.from_numpy(token_lp))


def _perturbed_group(groups, model_dir: str, gid: str, share: float, seed: int) -> tuple[m.RolloutGroup, int, int]:
    """A sampled group (fp32 sampler at version 0: every ratio is 1) with ``share`` of its
    tokens, chosen among positions with a choice, given a sampler log-prob 20x too low."""
    g = groups.sampled(model_dir, gid, [BOS_ID, *b"def f(x):"], [1.0, 0.0, 0.5, 0.0], seed=seed, top_p=1.0)
    total = sum(int(s.token_ids.shape[0]) for t in g.trajectories for s in t.segments)
    want = round(share * total)
    trajs, changed = [], 0
    for t in g.trajectories:
        segs = []
        for seg in t.segments:
            sizes = np.diff(seg.support.offsets.to_numpy())
            pick = {i for i in range(len(sizes)) if sizes[i] > 1}
            pick = set(sorted(pick)[:max(0, want - changed)])
            changed += len(pick)
            segs.append(_lower_sampled_token(seg, pick))
        trajs.append(msgspec.structs.replace(t, segments=tuple(segs)))
    return msgspec.structs.replace(g, trajectories=tuple(trajs)), changed, total


def _toml(v) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def _config(model_dir: str, **extra) -> str:
    cfg = {"model_dir": model_dir, "groups_per_step": 1, "lr": 1e-3, "checkpoint_every": 1, "max_staleness": 4,
           "record_batches": 5, **extra}
    return BASE + f"""
[actors.trainer]
factory = "fleetrl.actors.trainer:run"
inbox = 4
config = {_toml(cfg)}
[actors.feeder]
factory = "trainer_test_actors:feeder"
after = ["trainer"]
config = {{hold = true}}
"""


async def _serve(state_path: Path, text: str, until) -> tuple[ExitCode, dict, bytes, list[dict]]:
    """Run a supervisor until ``until(status)`` (then drain it) or until it ends by itself."""
    cfg = load_config_text(text, source="test.toml")
    state = StateDir(state_path).open()
    sup = Supervisor(cfg, state, rng=random.Random(0))
    code: list[ExitCode] = []
    with state, trio.fail_after(120), structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as n:
            async def run() -> None:
                code.append(await sup.run(handle_signals=False))
            n.start_soon(run)
            while not code and not until(sup.status()):
                await trio.sleep(0.05)
            status = sup.status()  # live: the actors' statistics
            by_itself = bool(code)
            if not by_itself:
                sup.request_shutdown("test")
        if by_itself:
            status = sup.status()
        text_metrics = sup.metrics_text()
    return code[0], status, text_metrics, logs


def _lines(state_path: Path) -> list[dict]:
    path = state_path / "actors" / "trainer" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


async def test_a_step_masking_40_percent_raises_the_alarm_in_status_events_metrics_and_prometheus(
        model_dir, groups, feed, tmp_path):
    group, changed, total = _perturbed_group(groups, model_dir, "g40", 0.4, seed=3)
    assert 0.35 < changed / total < 0.45
    same = groups.sampled(model_dir, "zv", [BOS_ID, *b"def h():"], [1.0, 1.0], seed=9)  # zero variance
    feed.FEED.extend([same, group])
    code, status, prom, logs = await _serve(tmp_path / "s", _config(model_dir, alarms={"masked_tokens": 0.25}),
                                            lambda s: s["actors"]["trainer"]["versions"].get("step", 0) >= 1)
    assert code == ExitCode.OK
    [line] = _lines(tmp_path / "s")
    assert line["alarms"] == ["masked_tokens"] and not line["skipped"] and line["groups_without_gradient"] == {"zero_variance": 1}
    assert line["frac_masked_tokens"] == pytest.approx(changed / total, abs=1e-9)
    stats = status["actors"]["trainer"]["statistics"]
    assert stats["alarms"] == {"masked_tokens": 1} and "masked_tokens" in stats["last_alarm"]
    assert stats["halted"] is None and status["halted"] is None and "excluded_rows" not in stats["alarms"]
    [warn] = [e for e in logs if e["event"] == "correction alarm"]
    assert warn["log_level"] == "warning" and warn["alarm"] == "masked_tokens" and warn["fix"]
    shown = event_of({**warn, "level": warn["log_level"], "actor": "trainer"})
    assert shown is not None and shown["event"] == "correction alarm" and shown["level"] == "warning"
    assert 'trainer_alarms_total{actor="trainer",alarm="masked_tokens"} 1.0' in prom.decode()


async def test_a_band_that_masks_every_token_halts_the_run_within_one_step(model_dir, groups, feed, tmp_path):
    """Every ratio is 1 at version 0 with an fp32 sampler, so a band [1.5, 5] masks them all:
    the first step halts the run (exit 7, /status says why), the second group is never trained."""
    sampled = [groups.sampled(model_dir, f"h{i}", [BOS_ID, *b"def g():"], [1.0, 0.0], seed=i) for i in range(2)]
    feed.FEED.extend(sampled)
    code, status, _, logs = await _serve(tmp_path / "s", _config(model_dir, corrections={"mask_low": 1.5}),
                                         lambda s: False)
    assert code == ExitCode.HALTED
    lines = _lines(tmp_path / "s")
    assert len(lines) == 1 and lines[0]["alarms"] == ["all_masked"] and lines[0]["skipped_reason"] == ALL_MASKED_REASON
    assert "training halted at step 0" in status["halted"] and "mask_low" in status["halted"]
    [err] = [e for e in logs if e["event"] == "training halted"]
    assert err["log_level"] == "error" and err["alarm"] == "all_masked"

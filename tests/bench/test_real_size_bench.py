"""bench/real_size.py in its shortened form (``--quick``): the tiny-151k model (vocabulary
151,936) through one real `fleetrl serve` with 2 FSDP2 rank processes, a torch bf16 sampler
in the daemon and a vLLM bf16 child sampler, Docker sandboxes, 2 steps; then the record's
bytes, the deltas and a checkpoint load and save. No timing is asserted: the JSON has
every key, the record is bounded at this vocabulary and at least 100x smaller than the
whole-vocabulary record, the steps were trained, both samplers generated, every rank's
peak memory was read, and nothing was left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.sandboxes import state_hash

pytestmark = [pytest.mark.slow, pytest.mark.docker]

ROOT = Path(__file__).resolve().parents[2]

TOP_KEYS = {
    "bench", "size", "quick", "device", "steps", "groups_per_step", "group_size", "max_tokens", "arms_run", "model",
    "malloc_tuning", "machine", "date", "max_support", "logits_chunk_mb", "lr", "vllm", "sampler_models",
    "samplers_per_arm", "arms", "samplers", "record", "files", "baseline_measured", "deltas", "checkpoint_probe",
    "wire_bytes_per_token", "rest_bytes_per_token", "baseline_wire_bytes_per_token", "baseline_rest_bytes_per_token",
    "ratio_wire", "ratio_rest", "wall_s",
}
ARM_KEYS = {
    "arm", "layout", "config", "state", "samplers_expected", "exit_code", "wall_s", "leftovers", "timed_out", "steps",
    "skipped_steps", "step_s", "step_s_median", "tokens_per_step", "reward_mean", "tokens_by_sampler", "delta",
    "peak_rss_mb", "rank_peak_rss_mb", "machine_peak_used_mb", "machine_total_mb", "samplers", "publish_latency",
    "publish_latency_s_median", "publish_latency_s_max", "status_polls", "rank_restarts", "rank_last_failure",
    "checkpoint", "trainer_start_s", "errors", "switch_pause_s",
}


def test_real_size_bench_quick(tmp_path):
    out = tmp_path / "real-size.json"
    proc = subprocess.run([sys.executable, "bench/real_size.py", "--quick", "--out", str(tmp_path / "work"),
                           "--json-out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == r
    assert set(r) >= TOP_KEYS, sorted(TOP_KEYS - set(r))
    assert (r["bench"], r["size"], r["quick"], r["steps"], r["arms_run"]) == ("real_size", "tiny-151k", True, 2, ["2"])
    assert r["model"]["vocab_size"] == 151_936 and r["max_support"] == 512

    # the record: bounded at this vocabulary, >= 100x smaller than the whole vocabulary listed
    rec = r["record"]
    assert rec["tokens"] > 0 and rec["support_members_max"] <= r["max_support"], rec
    assert 0 < r["wire_bytes_per_token"] <= 8192 and 0 < r["rest_bytes_per_token"] <= 8192, rec
    assert r["baseline_wire_bytes_per_token"] >= 100 * r["wire_bytes_per_token"], rec
    assert r["baseline_rest_bytes_per_token"] >= 100 * r["rest_bytes_per_token"], rec
    assert r["ratio_wire"] >= 100 and r["ratio_rest"] >= 100
    measured = r["baseline_measured"]
    assert measured["whole_vocabulary"]["members_per_token"] == 151_936 and measured["ratio"] >= 100, measured
    assert r["files"]["atif"]["bytes_per_token"] > 0 and r["files"]["rollout_log"]["bytes_per_token"] > 0

    # the run: both steps trained, both samplers generated, every rank's peak memory read
    arm = r["arms"]["arm_2"]
    assert set(arm) >= ARM_KEYS, sorted(ARM_KEYS - set(arm))
    assert "error" not in arm, arm
    assert arm["exit_code"] == 0 and arm["steps"] == 2 and not arm["timed_out"], arm
    assert len(arm["step_s"]) == 2 and all(s > 0 for s in arm["step_s"])
    assert arm["samplers_expected"] == ["torch-bf16", "vllm-bf16"]
    for sid in ("torch-bf16", "vllm-bf16"):
        assert arm["samplers"][sid]["tokens"] > 0, arm["samplers"]
        assert r["samplers"][sid]["tokens"] > 0
    assert set(arm["rank_peak_rss_mb"]) == {"rank 0", "rank 1"}, arm["peak_rss_mb"]
    assert all(v > 0 for v in arm["rank_peak_rss_mb"].values()) and arm["peak_rss_mb"]["daemon"] > 0
    assert arm["machine_peak_used_mb"] > 0
    assert [x["version"] for x in arm["publish_latency"]] == [1, 2]
    assert arm["publish_latency"][0]["latency_s"] is not None, arm["publish_latency"]  # both samplers followed v1
    assert all(b > 0 for b in arm["delta"]["bytes"]) and arm["checkpoint"]["sharded_bytes"] > 0

    # the codec at this size, and the checkpoint timed directly
    assert r["deltas"]["reencoded_equal"] and r["deltas"]["apply_GBps"] > 0 and r["deltas"]["encode_GBps"] > 0
    assert r["checkpoint_probe"]["load_s"] > 0 and r["checkpoint_probe"]["save_s"] > 0

    # nothing left behind: no process had to be killed, no sandbox container remains
    assert arm["leftovers"] == [], arm["leftovers"]
    left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(arm['state'])}"],
                          check=True, capture_output=True, text=True).stdout.split()
    assert not left, left
    assert not (tmp_path / "work").exists()  # the work directory is removed without --keep

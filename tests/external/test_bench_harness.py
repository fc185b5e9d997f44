"""bench/harness.py runs end to end at tiny sizes (the tests' model shape, a few calls and
attempts, real Docker sandboxes) and ends with one JSON line; no timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.docker
def test_harness_bench_runs_small(docker_client, image):
    proc = subprocess.run(
        [sys.executable, "bench/harness.py", "--model", "test", "--calls", "3", "--warmup", "1", "--max-tokens", "4",
         "--attempts", "4", "--concurrency", "2", "--rounds", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["bench"] == "harness" and result["model"] == "test"

    calls = result["per_call"]
    assert calls["same_tokens"]  # every endpoint call generated the baseline's tokens
    assert calls["recorded_calls"] == 3 + 1  # the warm-up and timed calls through the endpoint
    assert calls["direct_median_ms"] > 0 and calls["endpoint_median_ms"] > 0 and calls["ratio"] > 0

    att = result["attempts"]
    for path in ("builtin", "external", "preloaded"):
        r = att[path]
        assert (r["submitted"], r["failed"]) == (4, 0), r["errors"]
        assert r["tokens_per_attempt"] > 0
        assert r["reward_by_task"]["written"] == 1.0  # the harness wrote its file in the sandbox
    assert att["ratio"] > 0 and att["preloaded_ratio"] > 0 and att["preload_speedup"] > 0
    assert "attempts/s" in out and "external preloaded" in out and "overhead per call" in out
    # the bench's pool removed every container it started
    from fleetrl.sandboxes.sweep import LABEL_OWNER

    left = docker_client.containers.list(all=True, filters={"label": f"{LABEL_OWNER}={att['sandbox_owner']}"})
    assert not left

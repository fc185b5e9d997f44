"""bench/dashboard_pages.py end to end at a tiny budget: the shortened embedded default
run twice as a real `fleetrl serve` (Docker sandboxes), without pages and with 2 plain
HTTP clients doing what a dashboard page does; the run ends with a table, the ratio and
one JSON line. No timing is asserted: the structure, the steps, and that the dashboard
counted the clients' event streams while the trainer ran."""

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


def test_dashboard_pages_bench_runs_small(tmp_path):
    # the warm model cache the end-to-end tests share (tests/e2e/conftest.py)
    cache = Path(os.environ.get("FLEETRL_E2E_CACHE", Path.home() / ".cache" / "fleetrl" / "models"))
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "bench/dashboard_pages.py", "--steps", "6", "--arms", "none,streams", "--pages", "2",
         "--models", str(cache), "--out", str(out), "--timeout", "1500", "--exit-timeout", "600"],
        cwd=ROOT, capture_output=True, text=True, timeout=3600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "dashboard_pages" and (result["steps"], result["pages"]) == (6, 2)
    assert set(result) >= {"arms", "ratio_streams", "ratio_browsers", "machine"}
    assert list(result["arms"]) == ["none", "streams"] and result["ratio_browsers"] is None
    for name, arm in result["arms"].items():
        assert "error" not in arm, (name, arm)
        assert arm["exit_code"] == 0 and arm["steps"] == 6 and not arm["timed_out"], (name, arm)
        assert arm["steps_per_s"] > 0 and arm["window"][1] == 6, (name, arm)
        assert arm["refresh_ms"]["samples"] > 0 and arm["refresh_ms"]["median"] > 0, (name, arm)
        assert arm["snapshots"] > 0
    assert result["arms"]["none"]["pages_max_run"] == 0
    streams = result["arms"]["streams"]
    assert streams["pages"]["max"] >= 2 and streams["all_connected_at_step"] is not None, streams
    clients = streams["clients"]
    assert len(clients["events"]) == 2 and min(clients["events"]) > 0 and clients["rollout_lists"] > 0, clients
    assert not clients["errors"], clients
    assert result["ratio_streams"] > 0
    assert "steps/s streams / none" in proc.stdout
    # each arm's daemon ended and left no sandbox container behind
    for name in result["arms"]:
        state = out / name / "state"
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state)}"],
                              check=True, capture_output=True, text=True).stdout.split()
        assert not left, (name, left)

"""bench/peer_trl.py end to end at a tiny budget: a real `fleetrl serve` and a real TRL
GRPOTrainer train the warm model two steps each (rewards from the same checker in Docker
sandboxes), both are evaluated before and after, and the run ends with one JSON line of
figures and ratios. No timing is asserted; the counts are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fleetrl.sandboxes import state_hash

pytestmark = [pytest.mark.slow, pytest.mark.docker]

ROOT = Path(__file__).resolve().parents[2]


def test_peer_trl_bench_runs_both_systems_small(warm_cache, tmp_path):
    out = tmp_path / "peer"
    proc = subprocess.run(
        [sys.executable, "bench/peer_trl.py", "--steps", "2", "--groups", "2", "--group-size", "4", "--eval-n", "16",
         "--models", str(warm_cache), "--out", str(out), "--timeout", "900"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "peer_trl" and (result["steps"], result["groups"], result["group_size"]) == (2, 2, 4)
    for name in ("fleetrl", "trl"):
        r = result[name]
        assert r["exit_code"] == 0 and not r["timed_out"], (name, proc.stderr[-4000:])
        speed = r["speed"]
        assert speed["steps"] == 2 and speed["peak_rss_mib"] > 100  # a torch process tree was measured
        assert speed["groups_per_min"] > 0 and speed["tokens_per_s"] > 0
        assert speed["variance_groups_per_min"] <= speed["groups_per_min"] <= speed["sampled_groups_per_min"]
        assert len(r["reward_mean"]) == 2 and all(0.0 <= x <= 1.0 for x in r["reward_mean"])
        g = r["pass"]
        assert g["before"] == result["warm_pass_at_1"] and 0.0 <= g["after"] <= 1.0
        assert g["low"] <= g["gain"] <= g["high"] and g["gain"] == pytest.approx(g["after"] - g["before"])
    # fleetrl trains only groups with reward variance: every trained group has it
    assert result["fleetrl"]["speed"]["variance_groups_per_min"] == result["fleetrl"]["speed"]["groups_per_min"]
    assert set(result["ratios"]) >= {"groups_per_min", "tokens_per_s", "peak_rss_mib"}
    assert all(result["ratios"][k] > 0 for k in ("groups_per_min", "tokens_per_s", "peak_rss_mib"))
    assert "fleetrl minus TRL" in proc.stdout and "trained groups per minute, fleetrl / TRL" in proc.stdout
    # TRL's reward function scored in sandboxes, and left none behind
    trl_lines = [json.loads(x) for x in (out / "trl" / "steps.jsonl").read_text().splitlines()]
    assert [x["step"] for x in trl_lines] == [1, 2] and all(x["score_s"] > 0 for x in trl_lines)
    for state in (out / "trl" / "sandbox-state", out / "fleetrl" / "state"):
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=fleetrl.state={state_hash(state)}"],
                              check=True, capture_output=True, text=True).stdout.split()
        assert not left, (state, left)

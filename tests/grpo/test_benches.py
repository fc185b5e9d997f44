"""The grpo benches run end to end at tiny sizes and end with one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> tuple[str, dict]:
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    return proc.stdout, json.loads(lines[-1])


@pytest.mark.slow
def test_loss_speed_bench_runs_small():
    out, result = run_bench("bench/loss_speed.py", "--B", "2", "--T", "8", "--V", "300", "--K", "8",
                            "--repeats", "1", "--threads", "1")
    assert result["bench"] == "loss_speed" and result["K"] == 8
    assert result["ratio"] > 0 and result["plain_s"] > 0
    assert "goal <= 1.5x" in out


@pytest.mark.slow
def test_corrections_bench_runs_small():
    out, result = run_bench("bench/corrections.py", "--steps", "3", "--seeds", "1", "--scenarios", "fleet,fp8",
                            "--variants", "on-policy,no-corr,mask+replay+cent", "--eval-n", "16", "--groups", "3")
    table = result["results"]
    assert set(table) == {"fleet", "fp8"}
    assert set(table["fleet"]) == {"on-policy", "no-corr", "mask+replay+cent"}
    for scenario in table.values():
        assert scenario["on-policy"]["kl"] == [0.0, 0.0]  # the sampler is the trainer
        assert scenario["no-corr"]["kl"][0] > 0  # a real mismatch was simulated
        for row in scenario.values():
            assert 0.0 <= row["final_reward"][0] <= 1.0
    assert "scenario fleet" in out


@pytest.mark.slow
def test_corrections_bench_long_mode_adds_the_baseline_and_reports_collapse():
    out, result = run_bench("bench/corrections.py", "--long", "--steps", "6", "--seeds", "2", "--scenarios", "hard",
                            "--variants", "no-corr,tis", "--eval-n", "16", "--groups", "3", "--eval-every", "2")
    assert (result["mode"], result["steps"], result["eval_every"], result["baseline"]) == ("long", 6, 2, "on-policy")
    hard = result["results"]["hard"]
    assert list(hard) == ["on-policy", "no-corr", "tis"]  # the baseline first, added by --long
    assert hard["on-policy"]["final_ratio"] == hard["on-policy"]["area_ratio"] == 1.0
    for row in hard.values():
        assert len(row["collapse_steps"]) == 2 and row["collapsed"] == sum(s is not None for s in row["collapse_steps"])
        assert row["area_ratio"] > 0
    assert hard["no-corr"]["kl"][0] > 0  # staleness 8, coarse fp8 and noise: a real mismatch
    assert "(long run)" in out and "area/base" in out and "collapsed" in out


def test_corrections_bench_rejects_an_unknown_name():
    proc = subprocess.run([sys.executable, "bench/corrections.py", "--scenarios", "stale99"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "unknown scenario or variant 'stale99'" in proc.stderr


@pytest.mark.slow
def test_support_cap_bench_runs_small():
    out, result = run_bench("bench/support_cap.py", "--caps", "8,64", "--rows", "4", "--positions", "8",
                            "--hidden", "32", "--repeats", "1")
    caps = result["caps"]
    assert [c["cap"] for c in caps] == [8, 64, 151_936] and caps[-1]["baseline"]
    assert caps[0]["wire_bytes_per_token"] < caps[1]["wire_bytes_per_token"] < caps[2]["wire_bytes_per_token"]
    assert caps[2]["wire_bytes_per_token"] > 1_000_000  # the whole vocabulary listed
    assert all(c["sampler_step_s"] > 0 and c["trainer_s"] > 0 for c in caps)
    assert "x base" in out  # the table of ratios to the uncapped record


@pytest.mark.slow
def test_trainer_head_bench_runs_small():
    out, result = run_bench("bench/trainer_head.py", "--tokens", "8,32", "--hidden", "16", "--chunk-mb", "1")
    assert {(r["arm"], r["tokens"]) for r in result["rows"]} == {(a, n) for a in ("plain", "chunked") for n in (8, 32)}
    assert all(r["peak_rss_mb"] > 0 and r["seconds"] > 0 for r in result["rows"])
    assert set(result["kb_per_token"]) == {"plain", "chunked"}
    assert "memory per generated token" in out

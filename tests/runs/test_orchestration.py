"""Real `fleetrl serve` subprocesses under the ablation's orchestration, with a scripted
actor standing in for the run (tests/runs/runs_test_actors.py): arms x regimes x seeds
get their own configs and state directories, are watched while they run, stopped on
target or timeout, compared with the reference arm paired per seed, and written as
tables, JSON and plots."""

from __future__ import annotations

import copy
import json
import os
import signal
import tomllib
from pathlib import Path

import pytest
from PIL import Image

from fleetrl.actors.runs.ablate import run_ablation
from fleetrl.actors.runs.plots import COMPARISONS
from fleetrl.actors.runs.serve import run_serve
from fleetrl.actors.runs.tomlw import dumps
from fleetrl.actors.runs.variants import Regime, Variant, VariantError
from fleetrl.daemon.state import daemon_alive

pytestmark = pytest.mark.slow  # real daemon subprocesses

HERE = Path(__file__).resolve().parent
FACTORY = "runs_test_actors:scripted"


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    """The daemon subprocesses (and the config check here) import the scripted actor."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    monkeypatch.syspath_prepend(str(HERE))


def config(**script) -> dict:
    return {
        "daemon": {"state_dir": ".fleetrl", "grace_s": 20.0},
        "http": {"enabled": False},
        "logging": {"format": "json", "file": True},
        "actors": {"trainer": {"factory": FACTORY, "config": script}},
    }


def _set(**changes) -> callable:
    def transform(cfg: dict) -> dict:
        out = copy.deepcopy(cfg)
        out["actors"]["trainer"]["config"].update(changes)
        return out
    return transform


REF = Variant("a", "ref", "(a) reference", copy.deepcopy, reference=True)
BETTER = Variant("x", "better", "(x) better", _set(fresh_gain=20))
MILD = Regime("mild", "mild: as configured", copy.deepcopy)
HARD = Regime("hard", "hard: 5x the KL, collapses at step 4", _set(kl=5e-3, collapse_at=4))


def test_ablation_runs_arms_regimes_and_seeds_as_fleetrl_serve(tmp_path):
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(dumps(config(steps=10, reward_slope=0.05)))
    out, work = tmp_path / "abl", tmp_path / "work"
    lines: list[str] = []
    summary = run_ablation(cfg_path, out, [REF, BETTER], regimes=[MILD, HARD], seeds=[0, 1], steps=None,
                           eval_tasks=40, timeout_s=240, command="fleetrl ablate --config run.toml", work_dir=work,
                           log=lines.append, trainer=FACTORY, evaluator=FACTORY)
    assert summary["ok"], summary
    # layout: results under --out, runs under --work; the reference ran once per seed
    for seed in (0, 1):
        for regime in ("mild", "hard"):
            for arm in ("ref", "better"):
                rec = out / regime / f"seed-{seed}" / arm
                for f in ("config.toml", "metrics.jsonl", "eval.jsonl", "run.json"):
                    assert (rec / f).is_file(), rec / f
        assert (work / "mild" / f"seed-{seed}" / "ref" / "serve.log").is_file()
        assert not (work / "hard" / f"seed-{seed}" / "ref").exists()
        assert (work / "hard" / f"seed-{seed}" / "better" / "state" / "actors" / "trainer" / "metrics.jsonl").is_file()
        hard_ref = json.loads((out / "hard" / f"seed-{seed}" / "ref" / "run.json").read_text())
        assert hard_ref["reused_from"] == f"mild/seed-{seed}/ref" and hard_ref["regime"] == "hard"
    # seeds and evaluation size entered each run's config; the regime only the non-reference arms
    cfg = tomllib.loads((out / "hard" / "seed-1" / "better" / "config.toml").read_text())
    conf = cfg["actors"]["trainer"]["config"]
    assert (conf["seed"], conf["n"], conf["kl"], conf["fresh_gain"]) == (1, 40, 5e-3, 20)
    assert cfg["daemon"]["state_dir"] == str(work / "hard" / "seed-1" / "better" / "state")
    ref_cfg = tomllib.loads((out / "mild" / "seed-1" / "ref" / "config.toml").read_text())
    assert "kl" not in ref_cfg["actors"]["trainer"]["config"]
    # numbers: each run's own logs (seed 1 solves one more task and has 0.01 more reward)
    mild = json.loads((out / "mild" / "ablation.json").read_text())
    runs = {(r["seed"], r["key"]): r for r in mild["runs"]}
    assert runs[(1, "a")]["fresh"]["passed"] == 10 + 1 + 10 and runs[(1, "x")]["fresh"]["passed"] == 10 + 1 + 20
    assert runs[(0, "a")]["fresh"]["n"] == 40 and runs[(0, "a")]["steps"] == 10
    assert runs[(1, "a")]["reward_auc"] == pytest.approx(runs[(0, "a")]["reward_auc"] + 0.01)
    assert not any(r["collapse"]["collapsed"] for r in mild["runs"])
    (cmp_x,) = mild["comparisons"]
    assert cmp_x["key"] == "x" and cmp_x["reference"] == "a"
    fresh = cmp_x["fresh"]
    assert fresh["mean"] == pytest.approx(10 / 40) and [s["diff"] for s in fresh["seeds"]] == [0.25, 0.25]
    assert 0 < fresh["low"] <= 0.25 <= fresh["high"] < 0.5
    assert cmp_x["general"]["mean"] == 0 and cmp_x["reward_auc"]["mean"] == pytest.approx(0)
    # the hard regime: its arm collapses in both seeds, its reference does not
    hard = json.loads((out / "hard" / "ablation.json").read_text())
    (cmp_h,) = hard["comparisons"]
    assert cmp_h["collapsed_seeds"] == [0, 1] and cmp_h["reference_collapsed_seeds"] == []
    collapsed = {(r["seed"], r["key"]): r["collapse"] for r in hard["runs"]}
    assert collapsed[(0, "x")]["step"] == 6 and not collapsed[(0, "a")]["collapsed"]
    assert hard["fleet_kl"] == {"arm": "x", "mean": pytest.approx(5e-3)}
    # the mismatch multiple: the hard fleet's KL over the mild fleet's
    assert summary["mismatch_multiple"] == pytest.approx(5.0)
    top = (out / "ablation.md").read_text()
    assert "fleetrl ablate --config run.toml" in top and "**5.0x**" in top and "meets the goal" in top
    assert "## Regime mild" in top and "## Regime hard" in top
    assert "| (x) better | +25.0 [" in top  # the paired difference, in points
    assert "seed 0 (step 6), seed 1 (step 6)" in top
    assert "by sampler kind: torch/float32 25% of tokens, KL 5.00e-03; vllm/bfloat16 75% of tokens, KL 1.00e-02" in top
    for regime in ("mild", "hard"):
        for name in COMPARISONS:
            with Image.open(out / regime / name) as im:
                im.verify()
    assert any("hard/seed-1/better: step 10" in line for line in lines)

    # --resume: nothing runs again, the numbers are the same
    lines.clear()
    again = run_ablation(cfg_path, out, [REF, BETTER], regimes=[MILD, HARD], seeds=[0, 1], steps=None,
                         eval_tasks=40, timeout_s=240, command="fleetrl ablate --config run.toml", work_dir=work,
                         resume=True, log=lines.append, trainer=FACTORY, evaluator=FACTORY)
    assert not any("fleetrl serve --config" in line for line in lines)
    assert sum("finished in an earlier run" in line for line in lines) == 6
    assert again["mismatch_multiple"] == summary["mismatch_multiple"]
    assert json.loads((out / "mild" / "ablation.json").read_text())["comparisons"] == mild["comparisons"]


def test_an_arm_the_daemon_refuses_stops_before_any_run(tmp_path):
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(dumps(config(steps=1)))
    bad = Variant("z", "bad", "(z) bad", _set(no_such_field=1))
    with pytest.raises(VariantError, match=r"arm mild/seed-0/bad: the daemon refuses its config: .*no_such_field"):
        run_ablation(cfg_path, tmp_path / "abl", [REF, bad], regimes=[MILD], seeds=[0], steps=None, timeout_s=60,
                     command="x", log=lambda _: None, trainer=FACTORY, evaluator=FACTORY)
    assert not (tmp_path / "abl" / "work" / "mild" / "seed-0" / "ref" / "state").exists()
    with pytest.raises(VariantError, match="must include the reference arm"):
        run_ablation(cfg_path, tmp_path / "abl", [BETTER], regimes=[MILD], seeds=[0], steps=None, timeout_s=60,
                     command="x", log=lambda _: None, trainer=FACTORY, evaluator=FACTORY)


def _write(tmp_path: Path, **script) -> tuple[Path, Path]:
    state = tmp_path / "state"
    cfg = config(**script)
    cfg["daemon"]["state_dir"] = str(state)
    path = tmp_path / "run.toml"
    path.write_text(dumps(cfg))
    return path, state


def test_run_serve_stops_at_the_target_number_of_groups(tmp_path):
    path, state = _write(tmp_path, steps=0, interval_s=0.2, groups_per_step=4)
    stale = state / "actors" / "trainer" / "metrics.jsonl"  # an earlier run of the same arm
    stale.parent.mkdir(parents=True)
    stale.write_text('{"step": 99, "groups": 400, "skipped": false}\n')
    res = run_serve(path, state, tmp_path / "serve.log", timeout_s=240, stop_at_groups=12,
                    metrics_path=state / "actors" / "trainer" / "metrics.jsonl")
    assert res.exit_code == 0 and not res.timed_out, res  # SIGTERM: the daemon drained and exited 0
    assert res.stopped_at_s is not None
    at_target = [s for s in res.steps if s.groups >= 12]
    assert at_target and at_target[0].at_s == res.stopped_at_s
    assert [s.step for s in res.steps] == list(range(1, len(res.steps) + 1))
    assert [s.groups for s in res.steps] == [4 * s.step for s in res.steps]
    times = [s.at_s for s in res.steps]
    assert times == sorted(times)


def test_run_serve_times_out_and_leaves_no_daemon(tmp_path):
    path, state = _write(tmp_path, steps=0, interval_s=0.5)
    res = run_serve(path, state, tmp_path / "serve.log", timeout_s=8, term_grace_s=60,
                    metrics_path=state / "actors" / "trainer" / "metrics.jsonl")
    assert res.timed_out
    # drained (0), or SIGTERM arrived before the daemon had installed its handlers
    assert res.exit_code in (0, -signal.SIGTERM)
    assert not daemon_alive(str(state))

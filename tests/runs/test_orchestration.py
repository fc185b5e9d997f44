"""Real `fleetrl serve` subprocesses under the ablation's orchestration, with a scripted
actor standing in for the run (tests/runs/runs_test_actors.py): arms get their own
configs and state directories, are watched while they run, stopped on target or
timeout, and compared in a table, a markdown file and plots."""

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
from fleetrl.actors.runs.variants import Variant, VariantError
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


def _set(key: str, value) -> callable:
    def transform(cfg: dict) -> dict:
        out = copy.deepcopy(cfg)
        out["actors"]["trainer"]["config"][key] = value
        return out
    return transform


def test_ablation_runs_each_arm_as_fleetrl_serve(tmp_path):
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(dumps(config(steps=4)))
    variants = [Variant("x", "steady", "(x) steady", _set("reward_slope", 0.05)),
                Variant("y", "climbing", "(y) climbing", _set("reward_slope", 0.2))]
    out = tmp_path / "abl"
    lines: list[str] = []
    results, md = run_ablation(cfg_path, out, variants, steps=None, timeout_s=240, command="fleetrl ablate --config run.toml",
                               log=lines.append, trainer=FACTORY, evaluator=FACTORY)
    assert [r.exit_code for r in results] == [0, 0] and all(not r.error for r in results)
    steady, climbing = results
    # each arm ran its own config in its own state directory
    for name, slope in (("steady", 0.05), ("climbing", 0.2)):
        arm_cfg = tomllib.loads((out / name / "config.toml").read_text())
        assert arm_cfg["daemon"]["state_dir"] == str(out / name / "state")
        assert arm_cfg["actors"]["trainer"]["config"]["reward_slope"] == slope
        assert (out / name / "state" / "actors" / "trainer" / "metrics.jsonl").is_file()
        assert (out / name / "serve.log").is_file()
    # the numbers come from each arm's own logs
    assert steady.steps == climbing.steps == 4
    assert steady.reward_auc == pytest.approx(0.2 + 0.05 * 2.5)
    assert climbing.reward_auc == pytest.approx(0.2 + 0.2 * 2.5)
    assert steady.fresh.passed == 20 and steady.general.passed == 6
    assert steady.grad_norm_std == pytest.approx(0.05)
    assert steady.wall_s > 0
    # table, json and plots
    text = md.read_text()
    assert "fleetrl ablate --config run.toml" in text
    assert "| (y) climbing | 40.0% [30.0, 50.0] | 12.0% [2.0, 22.0] | 0.700 | 0.050 | 4 |" in text
    data = json.loads((out / "ablation.json").read_text())
    assert [a["name"] for a in data["arms"]] == ["steady", "climbing"]
    for name in COMPARISONS:
        with Image.open(out / name) as im:
            im.verify()
    assert any("steady: step 4" in line for line in lines)
    assert any(line.startswith("variant") for line in lines[-1].splitlines())


def test_an_arm_the_daemon_refuses_stops_before_any_run(tmp_path):
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(dumps(config(steps=1)))
    bad = Variant("z", "bad", "(z) bad", _set("no_such_field", 1))
    with pytest.raises(VariantError, match=r"arm bad: the daemon refuses its config: .*no_such_field"):
        run_ablation(cfg_path, tmp_path / "abl", [bad], steps=None, timeout_s=60, command="x",
                     log=lambda _: None, trainer=FACTORY, evaluator=FACTORY)
    assert not (tmp_path / "abl" / "bad" / "state").exists()


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

"""`fleetrl ablate`'s plan on configs/tiny.toml, before anything runs: every arm of
every regime and seed prepared and accepted by the daemon's loader, in the documented
layout, with one warm-model cache per seed and the reference arm run once per seed."""

from __future__ import annotations

import tomllib
from pathlib import Path

from fleetrl.actors.runs.ablate import Ablation
from fleetrl.actors.runs.variants import REGIMES, VARIANTS, pool_config, trainer_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def test_the_plan_of_both_regimes_and_two_seeds(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    plan = Ablation(config=TINY, out_dir=out, work_dir=work, variants=list(VARIANTS.values()),
                    regimes=[REGIMES["mild"], REGIMES["hard"]], seeds=[0, 1], steps=30, eval_tasks=400,
                    command="fleetrl ablate")
    assert [a.path for a in plan.arms[:10]] == [
        "mild/seed-0/sync_fp32", "mild/seed-0/async_full", "mild/seed-0/async_none", "mild/seed-0/async_mask",
        "mild/seed-0/async_tis", "hard/seed-0/sync_fp32", "hard/seed-0/async_full", "hard/seed-0/async_none",
        "hard/seed-0/async_mask", "hard/seed-0/async_tis"]
    assert len(plan.arms) == 20 and plan.budget == 30 and plan.fleet_key == "b"
    reused = [a for a in plan.arms if a.reused_from]
    assert [(a.regime, a.seed, a.reused_from) for a in reused] == [("hard", 0, "mild/seed-0/sync_fp32"),
                                                                  ("hard", 1, "mild/seed-1/sync_fp32")]
    assert reused[0].state == plan.arms[0].state and reused[0].record == out.absolute() / "hard/seed-0/sync_fp32"
    # each prepared arm's config: its seed, its regime, one warm-model cache per seed, 400 held-out tasks
    for arm in plan.arms:
        if arm.reused_from:
            continue
        cfg = tomllib.loads(arm.config.read_text())
        assert arm.config == out.absolute() / arm.path / "config.toml"
        assert cfg["daemon"]["state_dir"] == str(work.absolute() / arm.path / "state")
        models = str(work.absolute() / "shared" / f"seed-{arm.seed}" / "models")
        assert cfg["actors"]["warm_start"]["config"]["cache_dir"] == models
        assert trainer_config(cfg)["model_dir"] == models + "/tiny"
        assert trainer_config(cfg)["max_steps"] == 30 and trainer_config(cfg).get("seed", 0) == arm.seed
        assert cfg["actors"]["env"]["config"]["tasks"]["seed"] == arm.seed
        assert cfg["actors"]["evaluator"]["config"]["n"] == 400
        assert cfg["actors"]["evaluator"]["config"]["task_seed"] == 1  # the same held-out tasks everywhere
        backends = [s.get("backend", "torch") for s in pool_config(cfg)["samplers"]]
        assert ("vllm" in backends) == (arm.regime == "hard" and arm.key != "a")
        staleness = 0 if arm.key == "a" else 8 if arm.regime == "hard" else 2
        assert trainer_config(cfg)["max_staleness"] == pool_config(cfg)["max_staleness"] == staleness
    assert [s["id"] for s in plan.fleets["hard"]] == ["torch-fp32", "torch-bf16", "torch-fp8", "vllm-bf16"]
    assert not work.exists()  # nothing ran

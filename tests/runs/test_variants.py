"""The ablation arms as pure config transforms, checked on configs/tiny.toml."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pytest

from fleetrl.actors.runs.bench_async import bench_configs, measure
from fleetrl.actors.runs.serve import ServeResult, StepSeen
from fleetrl.actors.runs.variants import (EVALUATOR, VARIANTS, VariantError, actors_by_factory,
                                          apply_variant, drop_actors, pool_config, relocate,
                                          set_max_steps, synchronous, trainer_config, variant_names)

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


@pytest.fixture
def tiny() -> dict:
    return tomllib.loads(TINY.read_text())


def _walk_strings(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk_strings(v)
    elif isinstance(node, str):
        yield node


def test_a_is_homogeneous_fp32_and_synchronous(tiny):
    before = copy.deepcopy(tiny)
    a = VARIANTS["a"].transform(tiny)
    assert tiny == before  # pure: the input is untouched
    assert trainer_config(a)["max_staleness"] == 0 and pool_config(a)["max_staleness"] == 0
    samplers = pool_config(a)["samplers"]
    assert len(samplers) == 3
    assert {(s["backend"], s["dtype"]) for s in samplers} == {("torch", "fp32")}
    assert [s["id"] for s in samplers] == [s["id"] for s in pool_config(tiny)["samplers"]]
    assert trainer_config(a)["corrections"] == trainer_config(tiny)["corrections"]


def test_b_is_the_config_as_is(tiny):
    assert VARIANTS["b"].transform(tiny) == tiny


def test_c_has_no_corrections(tiny):
    tiny_seq = copy.deepcopy(tiny)
    trainer_config(tiny_seq)["corrections"]["seq_mask"] = [0.5, 2.0]
    c = VARIANTS["c"].transform(tiny_seq)
    corr = trainer_config(c)["corrections"]
    assert corr["weighting"] == "none" and corr["centering"] is False and "seq_mask" not in corr
    assert corr["normalization"] == "token"  # the loss normalisation is not a correction
    assert pool_config(c) == pool_config(tiny)
    assert trainer_config(c)["max_staleness"] == trainer_config(tiny)["max_staleness"] == 2


def test_d_is_masking_only(tiny):
    trainer_config(tiny)["corrections"].update(mask_low=0.3, mask_high=3.0)
    corr = trainer_config(VARIANTS["d"].transform(tiny))["corrections"]
    assert corr == {"normalization": "token", "mask_low": 0.3, "mask_high": 3.0,
                    "weighting": "mask", "centering": False}


def test_all_arms_keep_budget_seeds_tasks_and_model(tiny):
    def keep(c):
        return (trainer_config(c).get("seed"), trainer_config(c)["max_steps"], trainer_config(c)["lr"],
                c["actors"]["env"]["config"]["tasks"], c["actors"]["evaluator"],
                trainer_config(c)["model_dir"])

    for v in VARIANTS.values():
        assert keep(v.transform(tiny)) == keep(tiny), v


def test_relocate_moves_state_paths_and_shares_models(tiny):
    out = relocate(tiny, "/runs/x/state", shared={"models": "/runs/shared/models"})
    assert out["daemon"]["state_dir"] == "/runs/x/state"
    assert trainer_config(out)["model_dir"] == "/runs/shared/models/tiny"
    assert out["actors"]["warm_start"]["config"]["cache_dir"] == "/runs/shared/models"
    assert pool_config(out)["weights_dir"] == "/runs/x/state/actors/trainer/weights"
    assert out["actors"]["evaluator"]["config"]["report_dir"] == "/runs/x/state/report"
    assert not any(s.startswith(".fleetrl") for s in _walk_strings(out["actors"]))
    # names and import paths are not paths
    assert out["actors"]["env"]["config"]["harness"] == "fleetrl.harness.builtin:CompletionHarness"
    assert trainer_config(out)["announce_to"] == ["pool", "evaluator"]


def test_relocate_leaves_paths_outside_the_state_dir(tiny):
    trainer_config(tiny)["model_dir"] = "models/tiny"
    pool_config(tiny)["weights_dir"] = ".fleetrl-other/w"
    out = relocate(tiny, "s2")
    assert trainer_config(out)["model_dir"] == "models/tiny"
    assert pool_config(out)["weights_dir"] == ".fleetrl-other/w"


def test_relocate_normalises_the_configured_state_dir(tiny):
    tiny["daemon"]["state_dir"] = "./.fleetrl/"
    assert trainer_config(relocate(tiny, "/s"))["model_dir"] == "/s/models/tiny"


def test_apply_variant_sets_the_budget(tiny):
    out = apply_variant(tiny, VARIANTS["c"], state_dir="/s", steps=7)
    assert trainer_config(out)["max_steps"] == 7
    assert trainer_config(out)["corrections"]["weighting"] == "none"
    with pytest.raises(VariantError, match="steps must be an integer >= 1"):
        set_max_steps(tiny, 0)
    trainer_config(tiny)["time_budget_s"] = 60.0  # arms compare at one step budget, never by time
    for steps in (7, None):
        assert "time_budget_s" not in trainer_config(apply_variant(tiny, VARIANTS["b"], state_dir="/s", steps=steps))


def test_drop_evaluator_scrubs_its_name(tiny):
    out = drop_actors(tiny, EVALUATOR)
    assert actors_by_factory(out, EVALUATOR) == []
    assert trainer_config(out)["announce_to"] == ["pool"]
    tiny["actors"]["env"]["config"]["target"] = "evaluator"
    with pytest.raises(VariantError, match=r"actors\.env\.config\.target = 'evaluator'"):
        drop_actors(tiny, EVALUATOR)


def test_configs_without_the_needed_actors_are_refused(tiny):
    del tiny["actors"]["pool"]
    with pytest.raises(VariantError, match="exactly one sampler pool .* found none"):
        VARIANTS["a"].transform(tiny)
    tiny["actors"]["trainer2"] = copy.deepcopy(tiny["actors"]["trainer"])
    with pytest.raises(VariantError, match="exactly one trainer .* found trainer, trainer2"):
        VARIANTS["c"].transform(tiny)


def test_variant_names():
    assert [v.key for v in variant_names("a,async_none, d")] == ["a", "c", "d"]
    with pytest.raises(VariantError, match="unknown variant 'e'"):
        variant_names("a,e")
    with pytest.raises(VariantError, match="listed twice"):
        variant_names("a,sync_fp32")


def test_bench_configs(tiny):
    sync, asyn, groups, steps = bench_configs(tiny, groups=None)
    assert groups == 40 and steps == 5  # five steps of configs/tiny.toml's 8 groups
    for c in (sync, asyn):
        assert actors_by_factory(c, EVALUATOR) == []
        assert trainer_config(c)["max_steps"] == 5
        assert [s["dtype"] for s in pool_config(c)["samplers"]] == ["fp32", "bf16", "fp8"]
    assert trainer_config(sync)["max_staleness"] == pool_config(sync)["max_staleness"] == 0
    assert trainer_config(asyn)["max_staleness"] == 2
    assert set_max_steps(synchronous(drop_actors(tiny, EVALUATOR)), 240) == set_max_steps(sync, 240)
    assert "time_budget_s" not in trainer_config(sync) and "time_budget_s" not in trainer_config(asyn)
    assert bench_configs(tiny, groups=20)[3] == 3
    with pytest.raises(VariantError, match="at least two steps' worth"):
        bench_configs(tiny, groups=12)


def test_measure_from_the_first_step():
    res = ServeResult(exit_code=0, wall_s=60.0, steps=(StepSeen(20.0, 1, 32), StepSeen(30.0, 2, 64),
                                                       StepSeen(41.0, 3, 96)))
    assert measure(res, 96) == (21.0, 41.0)
    assert measure(res, 64) == (10.0, 30.0)
    assert measure(res, 97) == (None, None)
    assert measure(ServeResult(exit_code=1, wall_s=1.0, steps=()), 32) == (None, None)

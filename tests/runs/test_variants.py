"""The ablation's arms, regimes and seeds as pure config transforms, checked on
configs/tiny.toml (and each arm's config accepted by the daemon's loader)."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pytest

from fleetrl.actors.runs.bench_async import bench_configs, measure
from fleetrl.actors.runs.serve import ServeResult, StepSeen
from fleetrl.actors.runs.tomlw import dumps
from fleetrl.actors.runs.variants import (ENVWORKER, EVALUATOR, REGIMES, VARIANTS, VariantError, actors_by_factory,
                                          apply_seed, apply_variant, drop_actors, hard_fleet, parse_seeds,
                                          pool_config, regime_names, relocate, set_eval_tasks, set_max_steps,
                                          synchronous, trainer_config, variant_names)

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


def test_e_is_tis_only(tiny):
    trainer_config(tiny)["corrections"].update(tis_cap=3.0, seq_mask=[0.9, 1.1])
    e = VARIANTS["e"].transform(tiny)
    assert trainer_config(e)["corrections"] == {"normalization": "token", "tis_cap": 3.0, "weighting": "tis",
                                                "centering": False}
    assert pool_config(e) == pool_config(tiny)
    assert [v.key for v in VARIANTS.values() if v.reference] == ["a"]


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
    assert [v.key for v in variant_names("a,async_none, d,async_tis")] == ["a", "c", "d", "e"]
    with pytest.raises(VariantError, match="unknown variant 'f'"):
        variant_names("a,f")
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


# -- regimes ------------------------------------------------------------------------------

def test_mild_is_the_config_as_is(tiny):
    assert REGIMES["mild"].transform(tiny) == tiny


def test_hard_adds_vllm_coarsens_fp8_and_raises_staleness(tiny):
    before = copy.deepcopy(tiny)
    hard = REGIMES["hard"].transform(tiny)
    assert tiny == before  # pure
    samplers = pool_config(hard)["samplers"]
    assert [s["id"] for s in samplers] == ["torch-fp32", "torch-bf16", "torch-fp8", "vllm-bf16"]
    by_id = {s["id"]: s for s in samplers}
    assert by_id["torch-fp8"]["fp8_scheme"] == "tensor" and by_id["torch-fp8"]["dtype"] == "fp8"
    vllm = by_id["vllm-bf16"]
    assert (vllm["backend"], vllm["dtype"], vllm["process"], vllm["model_dir"]) == (
        "vllm", "bf16", True, ".fleetrl/models/tiny")
    assert "fp8_scheme" not in vllm and "device" not in vllm
    assert by_id["torch-fp32"] == pool_config(tiny)["samplers"][0]  # the rest of the fleet is kept
    assert trainer_config(hard)["max_staleness"] == pool_config(hard)["max_staleness"] == 8
    assert pool_config(hard)["wait_for_processes"] is True
    assert trainer_config(hard)["publish_window"] == 8
    # room for the samplers to run 8 versions ahead: 9 steps of 64 attempts
    assert hard["actors"]["env"]["config"]["max_concurrent_attempts"] == 9 * 64
    assert trainer_config(hard)["corrections"] == trainer_config(tiny)["corrections"]


def test_hard_adds_a_coarse_fp8_sampler_when_there_is_none(tiny):
    pool_config(tiny)["samplers"] = [s for s in pool_config(tiny)["samplers"] if s["dtype"] != "fp8"]
    pool_config(tiny)["samplers"][0]["device"] = "cuda:1"
    samplers = pool_config(hard_fleet(tiny))["samplers"]
    fp8 = [s for s in samplers if s.get("dtype") == "fp8"]
    assert len(fp8) == 1 and fp8[0]["id"] == "torch-fp8-tensor" and fp8[0]["fp8_scheme"] == "tensor"
    assert fp8[0]["device"] == "cuda:1" and fp8[0]["backend"] == "torch"


def test_hard_keeps_a_vllm_sampler_and_makes_it_a_child_process(tiny):
    pool_config(tiny)["samplers"].append({"id": "vllm-bf16", "model_dir": ".fleetrl/models/tiny",
                                          "backend": "vllm", "dtype": "bf16"})
    samplers = pool_config(hard_fleet(tiny))["samplers"]
    vllm = [s for s in samplers if s.get("backend") == "vllm"]
    assert len(vllm) == 1 and vllm[0]["process"] is True and len(samplers) == 4


def test_hard_refuses_a_model_vllm_cannot_run(tiny, tmp_path):
    tiny["actors"]["warm_start"]["config"]["recipe"] = {"model": {"hidden_size": 192, "num_heads": 4, "num_kv_heads": 4}}
    with pytest.raises(VariantError, match=r"head size 48 \(the warm_start recipe.*does not substitute"):
        hard_fleet(tiny)
    # a model no warm_start builds: its config.json says
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 128, "num_attention_heads": 8}')
    for s in pool_config(tiny)["samplers"]:
        s["model_dir"] = str(model)
    with pytest.raises(VariantError, match=rf"head size 16 \({model}/config.json\)"):
        hard_fleet(tiny)
    (model / "config.json").write_text('{"hidden_size": 128, "num_attention_heads": 2}')
    assert pool_config(hard_fleet(tiny))["samplers"][-1]["model_dir"] == str(model)
    for s in pool_config(tiny)["samplers"]:
        s["model_dir"] = str(tmp_path / "missing")
    with pytest.raises(VariantError, match="cannot tell whether vLLM runs the model"):
        hard_fleet(tiny)


def test_hard_needs_local_samplers_and_the_control_plane(tiny):
    tiny["http"]["enabled"] = False
    with pytest.raises(VariantError, match=r"needs \[http\] enabled = true"):
        hard_fleet(tiny)
    pool_config(tiny)["samplers"] = []
    with pytest.raises(VariantError, match="the pool has none"):
        hard_fleet(tiny)


def test_the_reference_arm_ignores_the_regime(tiny):
    hard = REGIMES["hard"]
    a_mild = apply_variant(tiny, VARIANTS["a"], state_dir="/s", steps=5)
    a_hard = apply_variant(tiny, VARIANTS["a"], state_dir="/s", steps=5, regime=hard)
    assert a_hard == a_mild
    assert {(s["backend"], s["dtype"]) for s in pool_config(a_hard)["samplers"]} == {("torch", "fp32")}
    assert trainer_config(a_hard)["max_staleness"] == 0
    c_hard = apply_variant(tiny, VARIANTS["c"], state_dir="/s", steps=5, regime=hard)
    assert trainer_config(c_hard)["max_staleness"] == 8 and trainer_config(c_hard)["corrections"]["weighting"] == "none"
    assert pool_config(c_hard)["samplers"][-1]["backend"] == "vllm"


@pytest.mark.parametrize("regime", ["mild", "hard"])
def test_every_arm_of_every_regime_is_a_config_the_daemon_accepts(tiny, tmp_path, regime):
    from fleetrl.daemon.config import load_config

    for v in VARIANTS.values():
        cfg = apply_variant(apply_seed(tiny, 1), v, state_dir=str(tmp_path / v.name), steps=3,
                            shared={"models": str(tmp_path / "models")}, regime=REGIMES[regime])
        path = tmp_path / f"{regime}-{v.name}.toml"
        path.write_text(dumps(cfg))
        load_config(path)


def test_regime_names():
    assert [r.key for r in regime_names("hard, mild")] == ["hard", "mild"]
    with pytest.raises(VariantError, match=r"unknown regime 'wild' \(known: mild, hard\)"):
        regime_names("mild,wild")
    with pytest.raises(VariantError, match="listed twice"):
        regime_names("hard,hard")


# -- seeds and evaluation size ------------------------------------------------------------

def test_a_seed_shifts_the_task_stream_the_trainer_and_the_warm_model(tiny):
    assert apply_seed(tiny, 0) == tiny
    trainer_config(tiny)["seed"] = 10
    s3 = apply_seed(tiny, 3)
    assert trainer_config(s3)["seed"] == 13
    assert s3["actors"]["env"]["config"]["tasks"] == {"kind": "synthetic", "seed": 3}
    assert s3["actors"]["warm_start"]["config"]["recipe"] == {"init_seed": 3}
    # the held-out sets are the same in every seed
    assert s3["actors"]["evaluator"] == tiny["actors"]["evaluator"]
    assert pool_config(s3) == pool_config(tiny)


def test_a_task_file_has_no_seed(tiny):
    tiny["actors"]["env"]["config"]["tasks"] = {"kind": "jsonl", "path": "t.jsonl"}
    assert apply_seed(tiny, 2)["actors"]["env"]["config"]["tasks"] == {"kind": "jsonl", "path": "t.jsonl"}


def test_seed_errors(tiny):
    with pytest.raises(VariantError, match="seed must be an integer >= 0"):
        apply_seed(tiny, -1)
    trainer_config(tiny)["seed"] = "x"
    with pytest.raises(VariantError, match=r"actors\.trainer\.config\.seed: expected an integer"):
        apply_seed(tiny, 1)
    del tiny["actors"]["trainer"]
    with pytest.raises(VariantError, match="no trainer"):
        apply_seed(tiny, 1)


def test_set_eval_tasks(tiny):
    out = set_eval_tasks(tiny, 400)
    assert out["actors"]["evaluator"]["config"]["n"] == 400 and tiny["actors"]["evaluator"]["config"]["n"] == 200
    with pytest.raises(VariantError, match="evaluation tasks must be an integer >= 1"):
        set_eval_tasks(tiny, 0)
    assert set_eval_tasks(drop_actors(tiny, EVALUATOR), 400) == drop_actors(tiny, EVALUATOR)


@pytest.mark.parametrize("spec, seeds", [("1", [0]), ("3", [0, 1, 2]), ("0,1", [0, 1]), ("4,", [4]),
                                         ("2..4", [2, 3, 4]), (" 5..5 ", [5])])
def test_parse_seeds(spec, seeds):
    assert parse_seeds(spec) == seeds


@pytest.mark.parametrize("spec, message", [("0", "a count must be >= 1"), ("x", "expected a count"),
                                           ("1,1", "listed twice"), ("3..1", "the range is empty"),
                                           ("-1,2", "must be >= 0"), ("", "expected a count")])
def test_parse_seeds_errors(spec, message):
    with pytest.raises(VariantError, match=message):
        parse_seeds(spec)


def test_envworker_factory_name_is_the_configs():
    assert actors_by_factory(tomllib.loads(TINY.read_text()), ENVWORKER) == ["env"]

"""GPU readiness, checked on CPU: configs/gpu.toml decodes into a rank-process trainer on
CUDA with vLLM bf16 and fp8 samplers, and bench/gpu_check.py (what bench/gpu_check.sh runs
on a lent GPU) runs end to end on CPU, small: trainer step, bf16 and fp8 torch samplers
following the delta stream, the figures it prints."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import msgspec

from fleetrl.actors.pool.config import PoolConfig
from fleetrl.actors.trainer import TrainerConfig
from fleetrl.daemon.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_config_is_a_rank_trainer_on_cuda_with_vllm_bf16_and_fp8_samplers():
    actors = {a.name: a for a in load_config(ROOT / "configs" / "gpu.toml").actors}
    trainer = actors["trainer"].config
    assert isinstance(trainer, TrainerConfig)
    assert trainer.device == "cuda" and trainer.ranks is not None and trainer.ranks.param_dtype == "bf16"
    assert trainer.micro_batch_tokens is not None
    pool = actors["pool"].config
    assert isinstance(pool, PoolConfig)
    assert {(s.backend, s.dtype, s.device) for s in pool.samplers} == {("vllm", "bf16", "cuda"), ("vllm", "fp8", "cuda")}
    assert {s.model_dir for s in pool.samplers} == {trainer.model_dir}


def test_gpu_check_runs_on_cpu_and_reports_every_figure(capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    out = mod.main(["--device", "cpu", "--hidden", "128", "--layers", "2", "--heads", "2", "--kv-heads", "1",
                    "--head-dim", "64", "--intermediate", "256", "--steps", "2", "--groups", "2", "--attempts", "2",
                    "--max-tokens", "4"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert msgspec.json.decode(last) == msgspec.json.decode(msgspec.json.encode(out))
    assert out["family"] == "qwen3" and set(out["samplers"]) == {"bf16", "fp8"}
    for figures in out["samplers"].values():
        assert 0 <= figures["mismatch_kl_k3"] < 1e-2 and figures["decode_tokens_per_s"] > 0
        assert math.isfinite(figures["delta_apply_s"]) and math.isfinite(figures["version_load_s"])
    # fp8 weights are further from the trainer than bf16 ones
    assert out["samplers"]["fp8"]["mismatch_kl_k3"] > out["samplers"]["bf16"]["mismatch_kl_k3"]
    assert out["trainer"]["step_s"] > 0 and 0 < out["delta"]["bytes"] < out["delta"]["bf16_bytes"]

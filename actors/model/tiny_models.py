"""Tiny random models of every supported family, over the byte tokenizer.

`create_tiny_model(dir, family, spec=..., seed=...)` writes a directory that
transformers, vLLM and fleetrl's torch sampler load: a seeded random model of the
family (`families.FAMILIES`) saved with `save_pretrained`, next to the byte tokenizer
and its chat template (`byte_tokenizer`). `fleetrl model init` (`cli`) calls it.

Unlike `tiny_llama.build_tiny_llama`, every bias and norm scale is drawn at random too
(transformers initialises biases to 0 and norm scales to 1), so a forward that drops a
bias or a q/k norm gives different log-probs and the tests comparing forwards see it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from .families import FAMILIES, config_class
from .tiny_llama import TinyLlamaSpec, save_tiny_llama

__all__ = ["SIZES", "TinyModelSpec", "build_tiny_model", "create_tiny_model", "family_config", "tiny_spec"]


class TinyModelSpec(TinyLlamaSpec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Shape of a tiny model of any family: `TinyLlamaSpec`'s fields (and its checks)
    plus the two options some families add. Errors name the field."""

    head_dim: int | None = None
    """Size of one attention head; None: hidden_size / num_heads. Families llama, qwen3
    and mistral take any even value (qwen3 models usually set it explicitly, with
    num_heads * head_dim != hidden_size); vLLM's CPU build needs 32, 64, 80, 96, ..."""
    sliding_window: int | None = None
    """mistral only: each query attends to itself and the sliding_window - 1 keys before
    it; None attends to the whole prefix, like llama."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ValueError(
                f"TinyModelSpec.head_dim must be an even number >= 2 (rotary embeddings rotate pairs), "
                f"got {self.head_dim}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"TinyModelSpec.sliding_window must be >= 1 or None, got {self.sliding_window}")


SIZES: Mapping[str, Mapping[str, TinyModelSpec]] = MappingProxyType({
    "tiny": MappingProxyType({
        # The embedded recipe's shape (hidden 192, 4 layers, 3 heads of 64), varied per
        # family so that each exercises its own option.
        "llama": TinyModelSpec(),
        "qwen2": TinyModelSpec(num_kv_heads=1),
        "qwen3": TinyModelSpec(num_heads=4, num_kv_heads=2, head_dim=64),
        "mistral": TinyModelSpec(num_kv_heads=1, sliding_window=1024),
    }),
})
"""Size name -> family -> the spec `fleetrl model init --size` builds."""


def tiny_spec(family: str, size: str = "tiny") -> TinyModelSpec:
    """The spec of `size` for `family`; ValueError naming the known ones otherwise."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; supported: {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; known sizes: {', '.join(SIZES)}")
    return SIZES[size][family]


def family_config(family: str, spec: TinyLlamaSpec) -> Any:
    """The transformers config of a `family` model shaped by `spec` over the byte vocabulary."""
    cls = config_class(family)  # ValueError for an unknown family
    head_dim = getattr(spec, "head_dim", None)
    window = getattr(spec, "sliding_window", None)
    if window is not None and family != "mistral":
        raise ValueError(f"TinyModelSpec.sliding_window applies to the mistral family only, not {family!r}")
    default_head = spec.hidden_size // spec.num_heads
    if family == "qwen2" and head_dim not in (None, default_head):
        raise ValueError(
            f"TinyModelSpec.head_dim={head_dim}: qwen2 models have head size hidden_size / num_heads = {default_head}"
        )
    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    if family != "qwen2":
        common["head_dim"] = head_dim or default_head
    extra: dict[str, Any] = {
        "llama": dict(attention_bias=False, mlp_bias=False),
        "qwen2": dict(use_sliding_window=False),
        "qwen3": dict(attention_bias=False, use_sliding_window=False),
        "mistral": dict(sliding_window=window),
    }[family]
    config = cls(**common, **extra)
    config.architectures = [FAMILIES[family].architecture]
    return config


def build_tiny_model(family: str, spec: TinyLlamaSpec, *, seed: int) -> torch.nn.Module:
    """A randomly initialised fp32 model of `family`, in eval mode; the same family, spec
    and seed give identical weights. Biases and norm scales are random too (module
    docstring). The global torch RNG is left as it was: the init draws from a forked RNG."""
    from transformers import AutoModelForCausalLM

    config = family_config(family, spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, spec.initializer_range)
                elif name.endswith("norm.weight"):
                    param.normal_(1.0, spec.initializer_range)
    return model.to(torch.float32).eval()


def create_tiny_model(directory: str | os.PathLike[str], family: str, spec: TinyLlamaSpec | None = None, *,
                      seed: int) -> Path:
    """Build a seeded random tiny model of `family` (default spec: ``SIZES["tiny"]``) and
    save it with the byte tokenizer and chat template into `directory` (atomically,
    replacing it); returns the path."""
    if spec is None:
        spec = tiny_spec(family)
    return save_tiny_llama(build_tiny_model(family, spec, seed=seed), directory)

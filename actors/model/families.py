"""The model families fleetrl supports, and reading a model directory's config.

A user's model is a local Hugging Face causal-LM directory. Its ``config.json`` names
the model class in ``architectures``; that entry decides the family, and with it what
the trainer (transformers' `AutoModelForCausalLM`), the torch sampler's forward
(`fleetrl.actors.samplers.llama_forward`) and vLLM must each do. A directory whose
entry is not in `ARCHITECTURES` is refused when it is loaded (`read_model_config`),
with a `ModelDirError` naming the entry and the config path, never mid-run.

Families (docs/reference/models.md):

* ``llama``: `LlamaForCausalLM`. RMSNorm, rotary embeddings, SwiGLU, grouped-query
  attention; optional biases on all four attention projections (``attention_bias``).
* ``qwen2``: `Qwen2ForCausalLM`. Llama plus biases on the q/k/v projections (always),
  optional sliding-window layers (``use_sliding_window``, ``max_window_layers``).
* ``qwen3``: `Qwen3ForCausalLM`. Llama plus a per-head RMSNorm of queries and keys
  (``q_norm``, ``k_norm``) before the rotary embedding, an explicit ``head_dim``.
* ``mistral``: `MistralForCausalLM`. Llama with a sliding attention window on every
  layer (``sliding_window``; ``None`` behaves like Llama).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .errors import ModelDirError

__all__ = ["ARCHITECTURES", "FAMILIES", "Family", "config_class", "family_of", "read_model_config"]


@dataclass(frozen=True)
class Family:
    """One supported architecture: its family name, the class named in
    ``architectures``, and the ``model_type`` its config carries."""

    name: str
    architecture: str
    model_type: str
    summary: str


FAMILIES: Mapping[str, Family] = MappingProxyType({
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama", "RMSNorm, rotary, SwiGLU, grouped-query attention"),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", "Llama with q/k/v projection biases"),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", "Llama with per-head q/k RMSNorm and an explicit head_dim"),
        Family("mistral", "MistralForCausalLM", "mistral", "Llama with a sliding attention window"),
    )
})
"""Family name -> `Family`."""

ARCHITECTURES: Mapping[str, str] = MappingProxyType({f.architecture: f.name for f in FAMILIES.values()})
"""``architectures`` entry of a config.json -> family name."""


def config_class(family: str) -> type[Any]:
    """The transformers config class of `family` (a key of `FAMILIES`)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }
    try:
        return classes[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; supported: {', '.join(FAMILIES)}") from None


def _supported() -> str:
    return ", ".join(f"{f.architecture} ({f.name})" for f in FAMILIES.values())


def family_of(raw: Mapping[str, Any], where: str) -> Family:
    """The family of a decoded config.json (`where` names it in errors).

    The single ``architectures`` entry decides; a config without one falls back to its
    ``model_type``. Raises ModelDirError naming the entry when it is not supported, or
    when ``model_type`` contradicts it.
    """
    archs = raw.get("architectures")
    model_type = raw.get("model_type")
    if archs is None:
        family = next((f for f in FAMILIES.values() if f.model_type == model_type), None)
        if family is None:
            raise ModelDirError(
                f"{where}: no 'architectures' entry and model_type {model_type!r} is not a supported family; "
                f"supported architectures: {_supported()}"
            )
        return family
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise ModelDirError(f"{where}: 'architectures' must list exactly one model class name, got {archs!r}")
    arch = archs[0]
    name = ARCHITECTURES.get(arch)
    if name is None:
        raise ModelDirError(
            f"{where}: architectures entry {arch!r} is not supported by fleetrl; supported: {_supported()}"
        )
    family = FAMILIES[name]
    if model_type != family.model_type:
        raise ModelDirError(
            f"{where}: architectures entry {arch!r} needs model_type {family.model_type!r}, "
            f"but the config says {model_type!r}"
        )
    return family


def read_model_config(directory: str | os.PathLike[str]) -> Any:
    """The transformers config saved in `directory`, checked to be a supported family.

    Raises ModelDirError when the directory has no config.json, the file is not a JSON
    object, its ``architectures`` entry is not supported (the message names the entry
    and the file), or transformers cannot read it. The family is ``config.model_type``.
    """
    path = Path(directory)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelDirError(f"{path}: no config.json (not a saved model directory)")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"{config_path}: cannot be read as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelDirError(f"{config_path}: must hold a JSON object, got {type(raw).__name__}")
    family = family_of(raw, str(config_path))
    try:
        return config_class(family.name).from_pretrained(path)
    except Exception as exc:  # transformers raises several types for a bad config
        raise ModelDirError(f"{config_path}: cannot be read as a {family.architecture} config: {exc}") from exc

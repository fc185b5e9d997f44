"""Loading a model directory of any supported family: its tensors, a transformers
model in eval mode, or a trainer's fp32 master copy.

Every loader first checks the directory's config (`families.read_model_config`), so an
unsupported architecture fails here, naming its ``architectures`` entry, before any
weight is read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from .construction import MODEL_CONSTRUCTION
from .errors import ModelDirError
from .families import read_model_config

__all__ = ["load_master_weights", "load_model", "read_state_dict"]


def read_state_dict(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The saved tensors of `directory` by their Hugging Face names (as stored, on CPU).

    With tied embeddings there is no `lm_head.weight` (a saved copy is dropped); readers use the embedding.
    """
    path = Path(directory)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelDirError(f"{path}: no *.safetensors weight file")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file).items():
            if name in tensors:
                raise ModelDirError(f"{file}: tensor {name!r} is also in another weight file")
            tensors[name] = tensor
    if "lm_head.weight" in tensors and _tied(path):
        # some transformers releases save the tied head as well; it is the embedding
        del tensors["lm_head.weight"]
    return tensors


def _tied(path: Path) -> bool:
    """Whether the directory's config.json ties the LM head to the embedding."""
    import json

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def load_model(directory: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Load a saved model of a supported family through `AutoModelForCausalLM`, in
    `dtype`, in eval mode. Raises ModelDirError for an unsupported or broken directory."""
    from transformers import AutoModelForCausalLM

    path = Path(directory)
    config = read_model_config(path)
    if not sorted(path.glob("*.safetensors")):
        raise ModelDirError(f"{path}: no *.safetensors weight file")
    with MODEL_CONSTRUCTION:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    return model.eval()


def load_master_weights(directory: str | os.PathLike[str]) -> torch.nn.Module:
    """Load a saved model as fp32 master weights for a trainer (train mode, grads on)."""
    model = load_model(directory, dtype=torch.float32)
    model.train()
    for param in model.parameters():
        param.requires_grad_(True)
    return model

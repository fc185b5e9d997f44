"""fleetrl.actors.model: model directories of the supported families, tiny random models
of each, and the byte-level tokenizer they share.

`read_model_config(dir)` checks a directory's ``architectures`` entry against
`ARCHITECTURES` (llama, qwen2, qwen3, mistral) and raises `ModelDirError` naming it
when it is not supported; `load_master_weights(dir)` gives a trainer its fp32 copy
through transformers' `AutoModelForCausalLM`. `create_tiny_model(dir, family, seed=...)`
(and `create_tiny_llama`, the embedded recipe's model) writes a directory that
transformers, vLLM and fleetrl's torch sampler backend all load.
"""

from fleetrl.actors.model.byte_tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    build_byte_tokenizer,
    save_byte_tokenizer,
)
from fleetrl.actors.model.errors import ModelDirError, ModelError
from fleetrl.actors.model.families import ARCHITECTURES, FAMILIES, Family, read_model_config
from fleetrl.actors.model.loading import load_master_weights, load_model, read_state_dict
from fleetrl.actors.model.tiny_llama import (
    TinyLlamaSpec,
    build_tiny_llama,
    create_tiny_llama,
    llama_config,
    load_tiny_llama,
    read_llama_config,
    save_tiny_llama,
)
from fleetrl.actors.model.tiny_models import (
    SIZES,
    TinyModelSpec,
    build_tiny_model,
    create_tiny_model,
    family_config,
    tiny_spec,
)

__all__ = [
    "ARCHITECTURES",
    "BOS_ID",
    "EOS_ID",
    "FAMILIES",
    "PAD_ID",
    "SIZES",
    "VOCAB_SIZE",
    "Family",
    "ModelDirError",
    "ModelError",
    "TinyLlamaSpec",
    "TinyModelSpec",
    "build_byte_tokenizer",
    "build_tiny_llama",
    "build_tiny_model",
    "create_tiny_llama",
    "create_tiny_model",
    "family_config",
    "llama_config",
    "load_master_weights",
    "load_model",
    "load_tiny_llama",
    "read_llama_config",
    "read_model_config",
    "read_state_dict",
    "save_byte_tokenizer",
    "save_tiny_llama",
    "tiny_spec",
]

"""fleetrl.actors.model: the tiny Llama-architecture model and its byte-level tokenizer.

`create_tiny_llama(dir, spec, seed=...)` writes a directory that transformers, vLLM and
fleetrl's torch sampler backend all load; `load_master_weights(dir)` gives a trainer
its fp32 copy.
"""

from fleetrl.actors.model.byte_tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    build_byte_tokenizer,
    save_byte_tokenizer,
)
from fleetrl.actors.model.tiny_llama import (
    ModelDirError,
    TinyLlamaSpec,
    build_tiny_llama,
    create_tiny_llama,
    llama_config,
    load_master_weights,
    load_tiny_llama,
    read_llama_config,
    read_state_dict,
    save_tiny_llama,
)

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "ModelDirError",
    "TinyLlamaSpec",
    "build_byte_tokenizer",
    "build_tiny_llama",
    "create_tiny_llama",
    "llama_config",
    "load_master_weights",
    "load_tiny_llama",
    "read_llama_config",
    "read_state_dict",
    "save_byte_tokenizer",
    "save_tiny_llama",
]

"""fleetrl.actors.model: model directories of the supported families, random models of
each (tiny, or at Qwen3-0.6B's size), the byte-level tokenizer of the tiny models and the
real-size (151,936-id) BPE tokenizer of the others.

`read_model_config(dir)` checks a directory's ``architectures`` entry against
`ARCHITECTURES` (llama, qwen2, qwen3, mistral) and raises `ModelDirError` naming it
when it is not supported; `load_master_weights(dir)` gives a trainer its fp32 copy
through transformers' `AutoModelForCausalLM`. `create_tiny_model(dir, family, seed=...)`
(and `create_tiny_llama`, the embedded recipe's model) writes a directory that
transformers, vLLM and fleetrl's torch sampler backend all load; `SIZES` lists the sizes
(``tiny``, ``tiny-151k``, ``0.6b``) and `load_bpe_tokenizer` gives the real-size tokenizer
(trained once on the Python standard library, then cached on disk).
"""

from fleetrl.actors.model.byte_tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    build_byte_tokenizer,
    save_byte_tokenizer,
)
from fleetrl.actors.model.bpe_tokenizer import REAL_VOCAB_SIZE, BpeRecipe, load_bpe_tokenizer, save_bpe_tokenizer
from fleetrl.actors.model.errors import (
    BpeTokenizerError,
    CorpusError,
    ModelDirError,
    ModelError,
    TokenizerCacheError,
)
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
    parameter_count,
    sizes_of,
    tiny_spec,
)
from fleetrl.actors.model.vocabularies import VOCABULARIES, Vocabulary

__all__ = [
    "ARCHITECTURES",
    "BOS_ID",
    "EOS_ID",
    "FAMILIES",
    "PAD_ID",
    "REAL_VOCAB_SIZE",
    "SIZES",
    "VOCABULARIES",
    "VOCAB_SIZE",
    "BpeRecipe",
    "BpeTokenizerError",
    "CorpusError",
    "Family",
    "ModelDirError",
    "ModelError",
    "TokenizerCacheError",
    "TinyLlamaSpec",
    "TinyModelSpec",
    "Vocabulary",
    "build_byte_tokenizer",
    "build_tiny_llama",
    "build_tiny_model",
    "create_tiny_llama",
    "create_tiny_model",
    "family_config",
    "llama_config",
    "load_bpe_tokenizer",
    "load_master_weights",
    "load_model",
    "load_tiny_llama",
    "read_llama_config",
    "read_model_config",
    "parameter_count",
    "read_state_dict",
    "save_bpe_tokenizer",
    "save_byte_tokenizer",
    "save_tiny_llama",
    "sizes_of",
    "tiny_spec",
]

"""The real-size tokenizer: a byte-level BPE with exactly 151,936 token ids.

A stand-in with the vocabulary *size* of Qwen3 (its embedding has 151,936 rows), not
Qwen3's tokens: it is trained here, offline, with the `tokenizers` library, on the
Python standard library's sources (`stdlib_corpus`), and written with its own ChatML-like
chat layout (`chatml`). Models of the sizes ``tiny-151k`` and ``0.6b`` carry it, so
fleetrl's samplers, trainer and deltas see a real vocabulary's tensor shapes.

Layout of the ids (`BpeRecipe.vocab_size` = 151,936):

* ``0 .. 255``: the 256 byte symbols of byte-level BPE (`pre_tokenizers.ByteLevel`; in
  the trainer's order, so an id is not the byte's value as in the byte tokenizer), so
  any text encodes and round-trips exactly;
* then the learned merges, most frequent first, up to ``vocab_size - 5``;
* when the corpus cannot yield that many merges, filler tokens ``<|unused_N|>`` (N
  from 0) complete the regular vocabulary: plain tokens that no text encodes to but
  that decode to their own spelling (the standard library of CPython 3.11 yields about
  207,000 tokens, so none are needed there);
* the last five ids: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (the eos),
  ``<tool_call>``, ``</tool_call>`` (`chatml.ADDED_TOKENS`).

Text is first split by `PRETOKENIZE_PATTERN` (words with their leading space,
identifiers with underscores, single digits, runs of punctuation, runs of whitespace),
then mapped to byte symbols; merges never cross those pieces. Training is deterministic
(`tokenizers` breaks count ties by token ids; the same bytes came out across runs and
thread counts), so one corpus gives one tokenizer; the result is cached on disk by the
hash of its recipe (`tokenizer_cache`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from .chatml import ADDED_TOKENS, CHAT_TEMPLATE, END_OF_TEXT, IM_END, SPECIAL_TOKENS
from .errors import BpeTokenizerError
from .stdlib_corpus import corpus_digest, corpus_files, read_corpus, stdlib_root
from .tokenizer_cache import cached_build
from .tokenizer_files import save_fast_tokenizer

__all__ = [
    "BUILD_FORMAT",
    "END_OF_TEXT_ID",
    "IM_END_ID",
    "IM_START_ID",
    "PRETOKENIZE_PATTERN",
    "REAL_VOCAB_SIZE",
    "TOOL_CALL_CLOSE_ID",
    "TOOL_CALL_OPEN_ID",
    "BpeRecipe",
    "BpeTokenizerError",
    "bpe_tokenizer_file",
    "load_bpe_tokenizer",
    "save_bpe_tokenizer",
    "train_bpe_tokenizer",
]

REAL_VOCAB_SIZE: Final = 151_936
"""Token ids of the real-size tokenizer: the rows of Qwen3-0.6B's embedding."""
END_OF_TEXT_ID: Final = REAL_VOCAB_SIZE - len(ADDED_TOKENS)
IM_START_ID: Final = END_OF_TEXT_ID + 1
IM_END_ID: Final = END_OF_TEXT_ID + 2
TOOL_CALL_OPEN_ID: Final = END_OF_TEXT_ID + 3
TOOL_CALL_CLOSE_ID: Final = END_OF_TEXT_ID + 4

PRETOKENIZE_PATTERN: Final = (
    r" ?[\p{L}\p{M}_]+"  # a word or identifier, with its leading space
    r"|\p{N}"  # one digit: numbers are spelled digit by digit
    r"| ?[^\s\p{L}\p{M}\p{N}_]+[\r\n]*"  # a run of punctuation, with its leading space and trailing newlines
    r"|\s*[\r\n]+"  # line breaks, with the blanks before them
    r"|\s+(?!\S)"  # blanks, except the last one before a word (it goes with the word)
    r"|\s+"
)
"""How text is cut into pieces before byte-level BPE (merges stay inside a piece)."""

FILLER: Final = "<|unused_{}|>"
"""Spelling of the filler tokens that complete a vocabulary the corpus cannot reach."""

BUILD_FORMAT: Final = 1
"""Version of the build procedure; part of the cache key, raised whenever the code
below would build different tokens from the same corpus."""


@dataclass(frozen=True)
class BpeRecipe:
    """What decides the tokens: the corpus and the number of ids.

    ``corpus_root`` None is the running interpreter's standard library; tests train a
    small vocabulary on a folder of their own.
    """

    vocab_size: int = REAL_VOCAB_SIZE
    corpus_root: Path | None = None

    def __post_init__(self) -> None:
        least = 256 + len(ADDED_TOKENS)
        if self.vocab_size < least:
            raise ValueError(f"BpeRecipe.vocab_size must be >= {least} (the byte symbols and the added tokens), "
                             f"got {self.vocab_size}")

    def files(self) -> list[Path]:
        """The corpus files, in training order."""
        return corpus_files(self.corpus_root)

    def key(self, files: list[Path]) -> str:
        """The cache key: SHA-256 over the build format, the `tokenizers` version, the
        vocabulary size, the added tokens, the split pattern and the corpus digest."""
        recipe = {
            "format": BUILD_FORMAT,
            "tokenizers": tokenizers.__version__,
            "vocab_size": self.vocab_size,
            "added_tokens": list(ADDED_TOKENS),
            "pattern": PRETOKENIZE_PATTERN,
            "filler": FILLER,
            "corpus": corpus_digest(files, self.corpus_root),
        }
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode("utf-8")).hexdigest()[:32]


def _empty_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _fill(data: dict[str, Any], n_regular: int) -> int:
    """Append filler tokens to the serialized tokenizer `data` until its BPE vocabulary
    has `n_regular` tokens; returns how many were added."""
    vocab: dict[str, int] = data["model"]["vocab"]
    added = 0
    k = 0
    while len(vocab) < n_regular:
        token = FILLER.format(k)
        k += 1
        if token in vocab:  # the split pattern keeps "<|" and words apart, but never reuse a token
            continue
        vocab[token] = len(vocab)
        added += 1
    return added


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = REAL_VOCAB_SIZE, *,
                        length: int | None = None) -> tuple[Tokenizer, dict[str, int]]:
    """Train the tokenizer on `texts` (see the module docstring for the layout) and
    return it with counts: ``merges`` learned, ``filled`` filler tokens, ``vocab_size``.

    Raises BpeTokenizerError if the result does not have exactly `vocab_size` ids with
    the added tokens last."""
    n_regular = vocab_size - len(ADDED_TOKENS)
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=n_regular, min_frequency=0, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer, length=length)
    data = json.loads(tok.to_str())
    merges = len(data["model"]["merges"])
    filled = _fill(data, n_regular)
    if filled:
        tok = Tokenizer.from_str(json.dumps(data))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS[len(SPECIAL_TOKENS):]])
    _check_layout(tok, vocab_size, "the freshly trained tokenizer")
    return tok, {"merges": merges, "filled": filled, "vocab_size": vocab_size}


def _check_layout(tok: Tokenizer, vocab_size: int, what: str) -> None:
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise BpeTokenizerError(f"{what} has {size} token ids, expected {vocab_size}")
    first = vocab_size - len(ADDED_TOKENS)
    for i, token in enumerate(ADDED_TOKENS):
        if tok.token_to_id(token) != first + i:
            raise BpeTokenizerError(f"{what}: {token} has id {tok.token_to_id(token)}, expected {first + i}")


def bpe_tokenizer_file(recipe: BpeRecipe | None = None, *, cache_root: str | os.PathLike[str] | None = None,
                       on_build: Callable[[], None] | None = None) -> Path:
    """The cached ``tokenizer.json`` of `recipe` (default: the real-size one), trained and
    cached first when the cache has no whole entry for it; `on_build` is called just
    before a training starts (the CLI says that it will take a while)."""
    recipe = recipe or BpeRecipe()
    files = recipe.files()

    def build(folder: Path) -> dict[str, Any]:
        if on_build is not None:
            on_build()
        started = time.perf_counter()
        tok, counts = train_bpe_tokenizer(read_corpus(files), recipe.vocab_size, length=len(files))
        seconds = time.perf_counter() - started
        tok.save(os.fspath(folder / "tokenizer.json"))
        return {**counts, "train_seconds": round(seconds, 2), "corpus_files": len(files),
                "corpus_root": os.fspath(recipe.corpus_root or stdlib_root()), "python": platform.python_version(),
                "tokenizers": tokenizers.__version__}

    return cached_build(recipe.key(files), build, root=cache_root) / "tokenizer.json"


def load_bpe_tokenizer(recipe: BpeRecipe | None = None, *, model_max_length: int = 4096,
                       cache_root: str | os.PathLike[str] | None = None,
                       on_build: Callable[[], None] | None = None) -> Any:
    """The tokenizer of `recipe` as a transformers `PreTrainedTokenizerFast` with the chat
    template: eos ``<|im_end|>``, pad ``<|endoftext|>``, no bos, left padding."""
    from transformers import PreTrainedTokenizerFast

    recipe = recipe or BpeRecipe()
    path = bpe_tokenizer_file(recipe, cache_root=cache_root, on_build=on_build)
    try:
        tok = Tokenizer.from_file(os.fspath(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a bad file
        raise BpeTokenizerError(f"{path}: cannot be loaded as a tokenizer: {exc}") from exc
    _check_layout(tok, recipe.vocab_size, os.fspath(path))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    eos_id = recipe.vocab_size - len(ADDED_TOKENS) + ADDED_TOKENS.index(IM_END)
    if len(fast) != recipe.vocab_size or fast.eos_token_id != eos_id:
        raise BpeTokenizerError(f"{path}: transformers sees {len(fast)} ids and eos id {fast.eos_token_id}; "
                                f"expected {recipe.vocab_size} ids with {IM_END} at {eos_id}")
    return fast


def save_bpe_tokenizer(directory: str | os.PathLike[str], model_max_length: int = 4096, *,
                       recipe: BpeRecipe | None = None, cache_root: str | os.PathLike[str] | None = None) -> None:
    """Write the tokenizer of `recipe` (default: the real-size one) with its chat template
    into `directory` (``tokenizer.json``, ``tokenizer_config.json``), loadable by
    transformers' AutoTokenizer and by vLLM."""
    fast = load_bpe_tokenizer(recipe, model_max_length=model_max_length, cache_root=cache_root)
    save_fast_tokenizer(fast, directory, CHAT_TEMPLATE)

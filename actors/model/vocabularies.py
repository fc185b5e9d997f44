"""The vocabularies `fleetrl model init` writes models over: their ids and their writer.

A model's config must agree with its tokenizer (``vocab_size``, the pad, bos and eos
ids); a `Vocabulary` carries those numbers as constants, so a config is built without
training or loading the tokenizer, and ``save(directory, model_max_length)`` writes the
tokenizer files next to the weights.

* ``byte``: the 259-token byte tokenizer (`byte_tokenizer`), bos ``<bos>``, eos ``<eos>``.
* ``bpe-151936``: the real-size byte-level BPE (`bpe_tokenizer`, trained once and cached),
  no bos, eos ``<|im_end|>``, pad ``<|endoftext|>``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from . import bpe_tokenizer, byte_tokenizer

__all__ = ["VOCABULARIES", "Vocabulary", "vocabulary"]


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer's size and special ids, and the function that writes its files."""

    name: str
    size: int
    pad_id: int
    bos_id: int | None
    eos_id: int
    save: Callable[[str | os.PathLike[str], int], None]
    """``save(directory, model_max_length)`` writes the tokenizer and its chat template."""
    summary: str


VOCABULARIES: Mapping[str, Vocabulary] = MappingProxyType({
    v.name: v
    for v in (
        Vocabulary("byte", byte_tokenizer.VOCAB_SIZE, byte_tokenizer.PAD_ID, byte_tokenizer.BOS_ID,
                   byte_tokenizer.EOS_ID, byte_tokenizer.save_byte_tokenizer,
                   "259 ids: the 256 bytes, <pad>, <bos>, <eos>"),
        Vocabulary("bpe-151936", bpe_tokenizer.REAL_VOCAB_SIZE, bpe_tokenizer.END_OF_TEXT_ID, None,
                   bpe_tokenizer.IM_END_ID, bpe_tokenizer.save_bpe_tokenizer,
                   "151,936 ids: byte-level BPE trained on the Python standard library, ChatML-like specials"),
    )
})
"""Vocabulary name -> `Vocabulary`."""


def vocabulary(name: str) -> Vocabulary:
    """The vocabulary called `name`; ValueError naming the known ones otherwise."""
    try:
        return VOCABULARIES[name]
    except KeyError:
        raise ValueError(f"unknown vocabulary {name!r}; known: {', '.join(VOCABULARIES)}") from None

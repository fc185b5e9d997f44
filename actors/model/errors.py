"""Errors of loading and building models.

Every error of `fleetrl.actors.model` derives from `ModelError`; where callers catch a
builtin (ValueError, RuntimeError) it stays a second base."""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["BpeTokenizerError", "CorpusError", "ModelDirError", "ModelError", "TokenizerCacheError"]


class ModelError(FleetrlError):
    """Root of the errors of `fleetrl.actors.model`."""


class ModelDirError(ModelError, ValueError):
    """A model directory is missing, incomplete, or holds an architecture fleetrl does not
    support (the message names its `architectures` entry and the config file)."""


class CorpusError(ModelError, FileNotFoundError):
    """The real-size tokenizer's corpus root is missing or holds no ``*.py`` file
    (`stdlib_corpus`)."""


class TokenizerCacheError(ModelError, OSError):
    """The tokenizer cache cannot be written, or a build wrote no file (`tokenizer_cache`)."""


class BpeTokenizerError(ModelError, RuntimeError):
    """A built or cached real-size tokenizer does not have its recipe's layout: the number
    of ids, or the ids of the added tokens (`bpe_tokenizer`)."""

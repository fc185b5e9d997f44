"""The local training corpus of the real-size tokenizer: the Python standard library.

The real-size tokenizer (`bpe_tokenizer`) is trained offline, with no download, on text
every fleetrl machine already has: the ``*.py`` sources of the running interpreter's
standard library (``sysconfig.get_paths()["stdlib"]``). Installed packages are left out
(any ``site-packages`` or ``dist-packages`` folder below the root, wherever it sits), so
the corpus is the interpreter's, not the virtualenv's, and installing a package never
changes the tokenizer. Files are read in sorted order of their relative POSIX path and
decoded as UTF-8 (bytes that are not UTF-8, as in a few deliberately mis-encoded test
files, become U+FFFD), so the same interpreter always yields the same corpus.

`corpus_digest` hashes every file's relative path and bytes: the tokenizer cache
(`tokenizer_cache`) is keyed by it, so another Python release, whose library differs,
trains and caches its own tokenizer instead of reusing one it did not produce.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from .errors import CorpusError

__all__ = ["EXCLUDED_DIRS", "CorpusError", "corpus_digest", "corpus_files", "read_corpus", "stdlib_root"]

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
"""Folders below the root whose files are not part of the corpus (installed packages,
byte-code caches)."""


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The ``*.py`` files under `root` (default: `stdlib_root`), outside `EXCLUDED_DIRS`,
    sorted by their path relative to `root`. Raises CorpusError naming the root when it
    is not a folder or holds none."""
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise CorpusError(f"tokenizer corpus root {base} is not a directory")
    found = [
        p for p in base.rglob("*.py")
        if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(base).parts[:-1])
    ]
    if not found:
        raise CorpusError(f"tokenizer corpus root {base} holds no *.py file (outside {sorted(EXCLUDED_DIRS)})")
    return sorted(found, key=lambda p: p.relative_to(base).as_posix())


def read_corpus(files: Sequence[Path]) -> Iterator[str]:
    """Each file's text, in the given order (invalid UTF-8 becomes U+FFFD)."""
    for path in files:
        yield path.read_bytes().decode("utf-8", errors="replace")


def corpus_digest(files: Sequence[Path], root: str | os.PathLike[str] | None = None) -> str:
    """SHA-256 (hex) over every file's path relative to `root` (default `stdlib_root`)
    and its bytes, in order: changes whenever any file is added, removed, renamed or
    edited."""
    base = Path(root) if root is not None else stdlib_root()
    h = hashlib.sha256()
    for path in files:
        data = path.read_bytes()
        name = path.relative_to(base).as_posix().encode("utf-8")
        h.update(len(name).to_bytes(8, "little") + name + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()

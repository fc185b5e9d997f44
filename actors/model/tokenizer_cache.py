"""An on-disk cache of built tokenizers, keyed by the hash of their recipe.

Training the real-size tokenizer takes seconds to a minute (docs/reference/models.md);
`fleetrl model init` and the tests need it again and again. An entry is a folder
``<root>/<key>/`` holding the built files and ``manifest.json``: the key, a description
of the recipe, and the SHA-256 of every file. The default root is
``${XDG_CACHE_HOME:-~/.cache}/fleetrl/tokenizers``.

An entry is trusted only when its manifest parses, names the same key and every file's
hash matches; anything else (a truncated file, a missing manifest, an edited file) is
moved aside and rebuilt. Entries are written into a temporary sibling folder and renamed
into place, so a crash or a concurrent builder never leaves a partial entry under the
key: a reader sees a whole entry or none. When two processes build the same key at once,
the first rename wins and the other discards its copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .errors import TokenizerCacheError

__all__ = ["MANIFEST", "TokenizerCacheError", "cached_build", "default_cache_root", "entry_problem"]

MANIFEST = "manifest.json"


def default_cache_root() -> Path:
    """``$XDG_CACHE_HOME/fleetrl/tokenizers``, or ``~/.cache/fleetrl/tokenizers``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fleetrl" / "tokenizers"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def entry_problem(entry: Path, key: str) -> str | None:
    """Why the folder `entry` is not a whole cache entry of `key`, or None when it is."""
    manifest_path = entry / MANIFEST
    if not manifest_path.is_file():
        return f"{manifest_path} is missing"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"{manifest_path} is not readable JSON ({exc})"
    if not isinstance(manifest, dict) or manifest.get("key") != key:
        return f"{manifest_path} is not the manifest of key {key}"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"{manifest_path} lists no files"
    for name, digest in files.items():
        path = entry / name
        if not path.is_file():
            return f"{path} is missing"
        if _sha256(path) != digest:
            return f"{path} does not match its SHA-256 in {MANIFEST}"
    return None


def _discard(path: Path) -> None:
    """Remove `path` (a folder), first renaming it so no reader finds it half-deleted."""
    aside = path.with_name(f".discard-{path.name}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    if aside.is_dir() and not aside.is_symlink():
        shutil.rmtree(aside, ignore_errors=True)
    else:
        aside.unlink(missing_ok=True)


def cached_build(key: str, build: Callable[[Path], Mapping[str, Any]], *,
                 root: str | os.PathLike[str] | None = None) -> Path:
    """The folder of the whole cache entry `key`, built first when there is none.

    ``build(folder)`` writes the entry's files into the empty `folder` and returns a JSON
    object describing the build (recorded in the manifest under ``"build"``). An existing
    entry that is not whole (`entry_problem`) is discarded and rebuilt. Raises
    TokenizerCacheError when the root cannot be written or the build writes no file.
    """
    base = Path(root) if root is not None else default_cache_root()
    entry = base / key
    if entry.is_dir() and entry_problem(entry, key) is None:
        return entry
    try:
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=base))
    except OSError as exc:
        raise TokenizerCacheError(f"tokenizer cache {base} cannot be written: {exc}") from exc
    try:
        info = dict(build(tmp))
        files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file() and p.name != MANIFEST}
        if not files:
            raise TokenizerCacheError(f"building tokenizer cache entry {key} wrote no file into {tmp}")
        manifest = {"key": key, "files": files, "build": info}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        if entry.exists() or entry.is_symlink():
            if entry.is_dir() and entry_problem(entry, key) is None:
                return entry  # another process finished the same build meanwhile
            _discard(entry)
        try:
            os.replace(tmp, entry)
        except OSError:
            if entry.is_dir() and entry_problem(entry, key) is None:
                return entry  # lost the race to a concurrent builder of the same key
            raise
    except OSError as exc:
        if isinstance(exc, TokenizerCacheError):
            raise
        raise TokenizerCacheError(f"tokenizer cache entry {entry} cannot be written: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry

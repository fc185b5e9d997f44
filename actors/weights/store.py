"""Content-addressed blob stores for weight versions: immutable blobs plus named refs.

A blob's key is the lowercase hex xxh3-128 of its bytes (32 characters), so a blob can
never change under its key and any cache or CDN may keep it forever; a reader checks
``key_of(data) == key``. Refs (e.g. ``manifest``) are the only mutable names: each holds
one key and is replaced atomically.

:class:`LocalDirStore` keeps blobs as files (``blobs/<2 hex>/<32 hex>``) and refs as
small text files, writing each through a temporary file, fsync and rename, so a crash
leaves either the old or the new state, never a partial file. :class:`MemoryStore` is
the in-process equivalent.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Protocol, runtime_checkable

import xxhash

from fleetrl.daemon.files import write_atomic

from .errors import BlobNotFound

__all__ = ["BlobNotFound", "BlobStore", "LocalDirStore", "MemoryStore", "key_of", "check_key",
           "check_ref_name"]

_KEY = re.compile(r"[0-9a-f]{32}")
_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def key_of(data: bytes | bytearray | memoryview) -> str:
    """The content key of ``data``: hex xxh3-128."""
    return xxhash.xxh3_128_hexdigest(data)


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"bad blob key {key!r}: expected 32 lowercase hex digits")
    return key


def check_ref_name(name: str) -> str:
    if not isinstance(name, str) or not _REF.fullmatch(name):
        raise ValueError(f"bad ref name {name!r}: letters, digits, '.', '_', '-' (max 128)")
    return name


@runtime_checkable
class BlobStore(Protocol):
    """Where a publisher puts blobs and followers (or the HTTP app) read them."""

    def put(self, data: bytes) -> str: ...
    def read(self, key: str, start: int = 0, stop: int | None = None) -> bytes: ...
    def size(self, key: str) -> int: ...
    def has(self, key: str) -> bool: ...
    def delete(self, key: str) -> None: ...
    def set_ref(self, name: str, key: str) -> None: ...
    def get_ref(self, name: str) -> str: ...


def _slice(n: int, start: int, stop: int | None) -> tuple[int, int]:
    stop = n if stop is None else stop
    if not 0 <= start <= stop <= n:
        raise ValueError(f"range [{start}, {stop}) outside a blob of {n} bytes")
    return start, stop


class MemoryStore:
    """A BlobStore in a dict (tests, single-process setups)."""

    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._refs: dict[str, str] = {}
        self._lock = threading.Lock()

    def put(self, data: bytes) -> str:
        key = key_of(data)
        with self._lock:
            self._blobs.setdefault(key, bytes(data))
        return key

    def read(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        blob = self._get(key)
        a, b = _slice(len(blob), start, stop)
        return blob[a:b]

    def _get(self, key: str) -> bytes:
        try:
            return self._blobs[check_key(key)]
        except KeyError:
            raise BlobNotFound(key) from None

    def size(self, key: str) -> int:
        return len(self._get(key))

    def has(self, key: str) -> bool:
        return check_key(key) in self._blobs

    def delete(self, key: str) -> None:
        with self._lock:
            self._blobs.pop(check_key(key), None)

    def set_ref(self, name: str, key: str) -> None:
        self._refs[check_ref_name(name)] = check_key(key)

    def get_ref(self, name: str) -> str:
        try:
            return self._refs[check_ref_name(name)]
        except KeyError:
            raise BlobNotFound(name) from None

    def keys(self) -> list[str]:
        return sorted(self._blobs)


class LocalDirStore:
    """A BlobStore in a directory: immutable content-addressed files, atomic writes."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        for sub in ("blobs", "refs", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        check_key(key)
        return self.root / "blobs" / key[:2] / key

    def _atomic_write(self, dest: Path, data: bytes) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(dest, data, tmp_dir=self.root / "tmp")

    def put(self, data: bytes) -> str:
        key = key_of(data)
        dest = self.path(key)
        if not dest.exists():
            self._atomic_write(dest, bytes(data))
        return key

    def read(self, key: str, start: int = 0, stop: int | None = None) -> bytes:
        p = self.path(key)
        try:
            with open(p, "rb") as f:
                n = os.fstat(f.fileno()).st_size
                a, b = _slice(n, start, stop)
                f.seek(a)
                return f.read(b - a)
        except FileNotFoundError:
            raise BlobNotFound(key) from None

    def size(self, key: str) -> int:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            raise BlobNotFound(key) from None

    def has(self, key: str) -> bool:
        return self.path(key).exists()

    def delete(self, key: str) -> None:
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass

    def set_ref(self, name: str, key: str) -> None:
        self._atomic_write(self.root / "refs" / check_ref_name(name), check_key(key).encode())

    def get_ref(self, name: str) -> str:
        try:
            return check_key((self.root / "refs" / check_ref_name(name)).read_text().strip())
        except FileNotFoundError:
            raise BlobNotFound(name) from None

    def keys(self) -> list[str]:
        return sorted(p.name for p in (self.root / "blobs").glob("*/*") if _KEY.fullmatch(p.name))

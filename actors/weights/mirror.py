"""Weight versions through caches and mirrors: copy a store's current version into
another store, and follow through a mirror that falls back to the origin.

Every blob is immutable and named by its content hash, so any HTTP cache (nginx, a CDN)
or object store may hold it; only the ``manifest`` ref moves. Two pieces:

* :func:`mirror_current` copies what the origin's current manifest references (the
  anchor and the deltas that a follower may need, then the manifest blob) into another
  store, blobs first and the ref last, so a reader of the mirror never sees a manifest
  whose blobs are missing. Blobs the mirror already holds are not copied again.
* :class:`MirrorSource` is an `AsyncBlobSource` that reads from a mirror or cache first
  and from the origin when the mirror fails it: a manifest older than the version the
  follower was told to expect (``expect``: the announcement's version) or that cannot
  be read is *stale*, and the origin's is used; a blob the mirror lacks, serves
  corrupted (the key check) or cannot deliver (a network error) is fetched from the
  origin. What it served from where is counted (`MirrorStatistics`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from .errors import BlobIntegrityError, BlobNotFound, ManifestError
from .follower import StoreSource
from .manifest import MANIFEST_REF, Manifest, decode_manifest
from .store import BlobStore

__all__ = ["MirrorSource", "MirrorStatistics", "mirror_current", "referenced_keys"]


def referenced_keys(m: Manifest) -> list[str]:
    """Every blob key a follower of manifest `m` may fetch (each once, in order)."""
    refs = [m.anchor, *([m.since_anchor] if m.since_anchor is not None else []), *m.catchup, *m.steps]
    return list(dict.fromkeys(r.key for r in refs))


def mirror_current(origin: BlobStore, mirror: BlobStore) -> tuple[Manifest, int]:
    """Copy the origin's current version into `mirror` (module docstring); returns its
    manifest and the number of blobs copied."""
    source = StoreSource(origin)  # reads checked against their keys
    key = origin.get_ref(MANIFEST_REF)
    data = source.get(key)
    m = decode_manifest(data)
    copied = 0
    for k in referenced_keys(m):
        if mirror.has(k):
            continue
        mirror.put(source.get(k))
        copied += 1
    mirror.put(data)
    mirror.set_ref(MANIFEST_REF, key)
    return m, copied


class MirrorStatistics(msgspec.Struct, kw_only=True):
    manifests_from_mirror: int = 0
    manifests_from_origin: int = 0
    """Manifests read from the origin because the mirror's was stale or unreadable."""
    stale_manifests: int = 0
    """Of those: the mirror's manifest was older than the version expected."""
    blobs_from_mirror: int = 0
    blobs_from_origin: int = 0
    """Blobs the mirror could not serve (missing, corrupted, unreachable)."""
    last_problem: str | None = None


_MIRROR_FAILURES: tuple[type[BaseException], ...] = (BlobNotFound, BlobIntegrityError, ManifestError, OSError)


def _failures() -> tuple[type[BaseException], ...]:
    """What a mirror may fail with: the store's errors, the network's (httpx), S3's (botocore)."""
    import httpx

    out: tuple[type[BaseException], ...] = (*_MIRROR_FAILURES, httpx.HTTPError)
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:  # boto3 is optional
        return out
    return (*out, BotoCoreError, ClientError)


class MirrorSource:
    """Read through `mirror`, fall back to `origin` (module docstring). Both are
    `AsyncBlobSource`s (``manifest()``, ``get(key)``): an `HttpBlobSource` on a cache or
    on the daemon, an `AsyncStoreSource` over an `S3Store`, ..."""

    def __init__(self, mirror: Any, origin: Any) -> None:
        self.mirror = mirror
        self.origin = origin
        self.expected: int | None = None
        self.stats = MirrorStatistics()
        self._failures = _failures()

    def expect(self, version: int) -> None:
        """The follower was told `version` exists: an older manifest is stale."""
        self.expected = version if self.expected is None else max(self.expected, version)

    async def manifest(self) -> Manifest:
        try:
            m = await self.mirror.manifest()
        except self._failures as exc:
            self.stats.last_problem = f"mirror manifest: {type(exc).__name__}: {exc}"
        else:
            if self.expected is None or m.version >= self.expected:
                self.stats.manifests_from_mirror += 1
                return m
            self.stats.stale_manifests += 1
            self.stats.last_problem = f"mirror manifest at version {m.version}, expected {self.expected}"
        self.stats.manifests_from_origin += 1
        return await self.origin.manifest()

    async def get(self, key: str) -> bytes:
        try:
            data = await self.mirror.get(key)
        except self._failures as exc:
            self.stats.last_problem = f"mirror blob {key}: {type(exc).__name__}: {exc}"
        else:
            self.stats.blobs_from_mirror += 1
            return data
        self.stats.blobs_from_origin += 1
        return await self.origin.get(key)

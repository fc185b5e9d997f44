"""The manifest: what a publisher currently offers, and the pure catch-up plan over it.

The publisher writes one manifest (JSON, itself a content-addressed blob) per version
and points the ref ``manifest`` at it. A follower reads it and decides, with
:func:`plan_catchup`, which blobs bring its weights to the current version:

* already current: nothing;
* within the window (its version has a catch-up delta): that one combined delta;
* otherwise (too far behind, unknown or corrupted weights): reset to zero, the latest
  anchor, then the combined delta from the anchor (absent when the anchor is current).
"""

from __future__ import annotations

import msgspec

from .errors import ManifestError
from .version import TensorSpec

__all__ = ["BlobRef", "Manifest", "CatchupPlan", "plan_catchup", "ManifestError",
           "encode_manifest", "decode_manifest", "MANIFEST_REF"]

MANIFEST_REF = "manifest"


class BlobRef(msgspec.Struct, frozen=True):
    """A delta blob from ``base_version`` (with ``base_digest``) to ``target_version``."""

    key: str
    size: int
    base_version: int | None  # None: an anchor (a delta from the all-zero model)
    base_digest: str
    target_version: int


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: int
    run: str
    fingerprint: str  # hex
    chunk_elems: int
    tensors: tuple[TensorSpec, ...]
    version: int
    digest: str  # hex
    window: int
    anchor_every: int
    anchor: BlobRef
    since_anchor: BlobRef | None  # anchor.target_version -> version
    catchup: tuple[BlobRef, ...]  # one per base version in [version - window, version - 1]
    steps: tuple[BlobRef, ...]  # the per-step deltas of the same window


def encode_manifest(m: Manifest) -> bytes:
    return msgspec.json.encode(m)


def decode_manifest(data: bytes) -> Manifest:
    try:
        m = msgspec.json.decode(data, type=Manifest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ManifestError(f"bad manifest: {e}") from e
    if m.format != 1:
        raise ManifestError(f"unsupported manifest format {m.format}")
    return m


class CatchupPlan(msgspec.Struct, frozen=True):
    reset: bool  # zero the weights first (anchor route)
    blobs: tuple[BlobRef, ...]


def plan_catchup(m: Manifest, version: int | None, digest: str | None, *, trust_weights: bool = True) -> CatchupPlan:
    """Blobs that take weights at (version, digest) to ``m.version``.

    ``trust_weights=False`` (weights known or suspected corrupt) forces the anchor route.
    """
    if trust_weights and version is not None:
        if version == m.version and digest == m.digest:
            return CatchupPlan(False, ())
        for ref in m.catchup:
            if ref.base_version == version and ref.base_digest == digest:
                return CatchupPlan(False, (ref,))
    blobs = (m.anchor,) + ((m.since_anchor,) if m.since_anchor is not None else ())
    return CatchupPlan(True, blobs)

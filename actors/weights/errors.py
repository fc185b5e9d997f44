"""Every error of the weights package, under one root: :class:`DeltaError`.

Named for who broke what: the delta's bytes (:class:`DeltaFormatError`, with
:class:`StreamError` for one stored stream), the weights it was applied to
(:class:`DeltaMismatchError`, :class:`DeltaVerifyError`), the manifest
(:class:`ManifestError`), the blob store or the wire (:class:`BlobNotFound`,
:class:`BlobIntegrityError`) and an HTTP client's ``Range`` header (:class:`RangeError`).

The root is a ``ValueError``, as every one of these was before it had a root, so code
that catches ``ValueError`` still does; :class:`BlobNotFound` keeps ``KeyError`` too
(stores raise it where a mapping would). Each is also importable from the module that
raises it (``codec``, ``streams``, ``manifest``, ``store``, ``follower``, ``http``).
"""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = ["DeltaError", "DeltaFormatError", "DeltaMismatchError", "DeltaVerifyError",
           "StreamError", "ManifestError", "BlobNotFound", "BlobIntegrityError", "RangeError"]


class DeltaError(FleetrlError, ValueError):
    """Base class of every error of the weights package."""


class DeltaFormatError(DeltaError):
    """The bytes are not a well-formed delta (truncated, corrupted, wrong version)."""


class DeltaMismatchError(DeltaError):
    """The delta does not fit these weights (run, fingerprint, base version or digest)."""


class DeltaVerifyError(DeltaError):
    """A chunk did not reach its target hash; the weights were restored (undone)."""


class StreamError(DeltaError):
    """A stored stream is malformed (the codec re-raises it as DeltaFormatError)."""


class ManifestError(DeltaError):
    """A manifest that cannot be decoded or does not fit the follower."""


class BlobNotFound(DeltaError, KeyError):
    """No blob (or ref) with that key (or name)."""


class BlobIntegrityError(DeltaError):
    """A fetched blob's bytes do not hash to its key."""


class RangeError(DeltaError):
    """An HTTP ``Range`` header that is malformed or selects nothing of the blob."""

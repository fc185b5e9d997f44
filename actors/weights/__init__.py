"""fleetrl.actors.weights: weight versions and the lossless sparse delta stream.

Pure core (no I/O): :mod:`.version` (layout, fingerprint, digests), :mod:`.codec` (the
delta codec's front: encode / read / parse / apply / compose, from :mod:`.delta`,
:mod:`.params`, :mod:`.encoder`, :mod:`.wire`, :mod:`.applier`, :mod:`.composer`),
:mod:`.streams` (stored streams), :mod:`.kernels` (compiled per-chunk passes),
:mod:`.quant` (deterministic fp8), :mod:`.manifest` (catch-up planning), :mod:`.metrics`.
I/O around it: :mod:`.store` (content-addressed blob stores), :mod:`.publisher` (trainer
side), :mod:`.follower` (sampler side, every precision), :mod:`.http` (ASGI app and httpx
client). Every error derives from :class:`DeltaError` (:mod:`.errors`). Format:
docs/reference/delta-format.md.
"""

from .delta import Delta, PackedDelta
from .errors import (
    BlobIntegrityError,
    BlobNotFound,
    DeltaError,
    DeltaFormatError,
    DeltaMismatchError,
    DeltaVerifyError,
    ManifestError,
)
from .follower import CastFollower, Follower, Fp8Follower, StoreSource, SyncReport
from .manifest import Manifest
from .metrics import VersionMetrics
from .params import CodecParams
from .publisher import Publisher, PublisherConfig
from .quant import dequantize_fp8, quantize_fp8
from .store import BlobStore, LocalDirStore, MemoryStore
from .version import Layout, TensorSpec

__all__ = [
    "BlobIntegrityError", "BlobNotFound", "BlobStore", "CastFollower", "CodecParams", "Delta",
    "DeltaError", "DeltaFormatError", "DeltaMismatchError", "DeltaVerifyError", "Follower",
    "Fp8Follower", "Layout", "LocalDirStore", "Manifest", "ManifestError", "MemoryStore",
    "PackedDelta", "Publisher", "PublisherConfig", "StoreSource", "SyncReport", "TensorSpec",
    "VersionMetrics", "dequantize_fp8", "quantize_fp8",
]

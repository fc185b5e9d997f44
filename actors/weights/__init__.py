"""fleetrl.actors.weights: weight versions and the lossless sparse delta stream.

Pure core (no I/O): :mod:`.version` (layout, fingerprint, digests), :mod:`.codec`
(encode / read / parse / apply / compose), :mod:`.streams` (stored streams), :mod:`.quant`
(deterministic fp8), :mod:`.manifest` (catch-up planning), :mod:`.metrics`. I/O around it: :mod:`.store` (content-addressed
blob stores), :mod:`.publisher` (trainer side), :mod:`.follower` (sampler side, every
precision), :mod:`.http` (ASGI app and httpx client). Format: docs/delta-format.md.
"""

from .codec import (
    CodecParams,
    Delta,
    DeltaError,
    DeltaFormatError,
    DeltaMismatchError,
    DeltaVerifyError,
    PackedDelta,
)
from .follower import CastFollower, Follower, Fp8Follower, StoreSource, SyncReport
from .manifest import Manifest, ManifestError
from .metrics import VersionMetrics
from .publisher import Publisher, PublisherConfig
from .quant import dequantize_fp8, quantize_fp8
from .store import BlobNotFound, BlobStore, LocalDirStore, MemoryStore
from .version import Layout, TensorSpec

__all__ = [
    "BlobNotFound", "BlobStore", "CastFollower", "CodecParams", "Delta", "DeltaError",
    "DeltaFormatError", "DeltaMismatchError", "DeltaVerifyError", "Follower", "Fp8Follower",
    "Layout", "LocalDirStore", "Manifest", "ManifestError", "MemoryStore", "PackedDelta", "Publisher",
    "PublisherConfig", "StoreSource", "SyncReport", "TensorSpec", "VersionMetrics",
    "dequantize_fp8", "quantize_fp8",
]

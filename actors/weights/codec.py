"""The lossless sparse delta codec (pure, sans-IO): encode, parse, apply, compose.

This module is the codec's front: it gathers the names callers use (``codec.apply``,
``codec.Delta``, ...) from the modules that implement them:

* :mod:`.delta` - chunk kinds, streams, :class:`Delta`, :class:`PackedDelta`,
  :class:`ChangedRange`; :mod:`.params` - :class:`CodecParams`;
* :mod:`.encoder` - :func:`build`, :func:`encode`, :func:`encode_anchor`;
* :mod:`.wire` - the bytes: :func:`serialize`, :func:`read`, :func:`parse`;
* :mod:`.applier` - :func:`check_fits`, :func:`apply`; :mod:`.composer` - :func:`compose`;
* :mod:`.errors` - :class:`DeltaError` and every error under it.

A delta takes a model from version *base* to version *target*. For every chunk of the
layout (see :mod:`.version`) it records one of:

* ``UNCHANGED`` - nothing changed; costs one byte in the chunk table;
* ``SPARSE``    - the positions of the changed elements, as gaps, and the XOR of their
  old and new bf16 bit patterns (exact; no float arithmetic anywhere), both as *split
  varints* (:mod:`.kernels`): about one byte per gap and one per XOR word;
* ``DENSE``     - the XOR of every element of the chunk (for chunks where more than
  ``dense_threshold`` of the elements changed).

A delta has five streams: gap heads, gap tails, XOR-word heads, XOR-word tails (all
bytes, every sparse chunk's in chunk order) and dense words (uint16); each is compressed
with blosc2 (by default zstd level 1). The header carries the run, model fingerprint,
base/target version and digest, the chunk table (kinds; entries and tail bytes of each
sparse chunk; each changed chunk's target hash) and each stream's hash; a trailer hash
covers every byte. The byte layout is in docs/reference/delta-format.md.

An *anchor* is a delta whose base is the all-zero model (base version ``NO_VERSION``):
applying it to zeroed weights yields the version, so anchors, deltas and their
compositions share one format and one code path.

Applying is in place and transactional: everything that can be checked before touching
the weights is (trailer, structure, stream hashes, fingerprint, base version and
digest); each chunk is then XOR-scattered by a compiled kernel that decodes gaps ->
positions -> XOR in one pass (and checks every position lies inside the chunk), and its
target hash is verified; on any failure every chunk already touched is XORed back (XOR
is its own inverse).

Speed: per-chunk work (diff, varint coding, scatter-XOR, hashing) and the stream parts'
(de)compression run on a small shared thread pool (:func:`.version.parallel_map`,
``threads`` arguments, default 2); the numba kernels, xxhash and blosc2 release the GIL
(:mod:`.streams` turns blosc2's release on, without which every "parallel" part ran one
at a time). :func:`read` checks everything but decompresses nothing (what a follower
needs to decide how to apply); :func:`apply` then decompresses the parts on the workers
and runs the per-chunk pass on the same workers. Chunks are disjoint and parts are
compressed with one blosc2 thread each, so bytes, results and undo do not depend on the
thread count.
"""

from .applier import apply, check_fits
from .composer import compose
from .delta import DENSE, SPARSE, STREAMS, UNCHANGED, ChangedRange, Delta, DeltaHeader, PackedDelta
from .encoder import build, encode, encode_anchor
from .errors import DeltaError, DeltaFormatError, DeltaMismatchError, DeltaVerifyError
from .params import DEFAULT_PARAMS, CodecParams
from .wire import FORMAT_VERSION, MAGIC, parse, read, serialize

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "UNCHANGED",
    "SPARSE",
    "DENSE",
    "STREAMS",
    "CodecParams",
    "DeltaError",
    "DeltaFormatError",
    "DeltaMismatchError",
    "DeltaVerifyError",
    "DeltaHeader",
    "Delta",
    "PackedDelta",
    "ChangedRange",
    "DEFAULT_PARAMS",
    "check_fits",
    "encode",
    "encode_anchor",
    "build",
    "serialize",
    "read",
    "parse",
    "apply",
    "compose",
]


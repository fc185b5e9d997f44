"""Apply a delta in place, transactionally: :func:`check_fits` and :func:`apply`.

Everything that can be checked before touching the weights is (trailer, structure,
stream hashes by :func:`.wire.read`; fingerprint, chunking, base version and digest
here); each changed chunk is then XOR-scattered by a compiled kernel that also checks
every position lies inside the chunk, and its target hash is verified; on any failure
every chunk already touched is XORed back (XOR is its own inverse). Pure; see
:mod:`.codec`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from . import kernels
from .delta import DENSE, SPARSE, UNCHANGED, ChangedRange, Delta, PackedDelta
from .errors import DeltaFormatError, DeltaMismatchError, DeltaVerifyError
from .version import Layout, parallel_map, version_label
from .wire import read

__all__ = ["check_fits", "apply"]


def check_fits(d: Delta | PackedDelta, layout: Layout, *, run: str | None = None) -> None:
    """Raise DeltaMismatchError/DeltaFormatError unless ``d`` fits ``layout``."""
    if run is not None and d.run != run:
        raise DeltaMismatchError(f"delta is for run {d.run!r}, not {run!r}")
    if d.fingerprint != layout.fingerprint:
        raise DeltaMismatchError(
            f"model fingerprint mismatch: delta {d.fingerprint.hex()}, weights {layout.fingerprint.hex()}"
        )
    if d.chunk_elems != layout.chunk_elems or d.n_chunks != layout.n_chunks:
        raise DeltaMismatchError(
            f"chunking mismatch: delta has {d.n_chunks} chunks of {d.chunk_elems}, "
            f"weights {layout.n_chunks} of {layout.chunk_elems}"
        )
    bad = np.flatnonzero(d.counts > layout.lengths)
    if bad.size:
        raise DeltaFormatError(f"{layout.chunk_name(int(bad[0]))}: more sparse entries than elements")
    want = int(layout.lengths[d.kinds == DENSE].sum())
    if d.n_dense_words != want:
        raise DeltaFormatError(f"dense stream holds {d.n_dense_words} words, dense chunks need {want}")


def apply(
    arrays: Sequence[np.ndarray],
    delta: Delta | PackedDelta | bytes | bytearray | memoryview,
    layout: Layout,
    *,
    current_version: int,
    current_digest: bytes,
    run: str | None = None,
    threads: int | None = None,
) -> list[ChangedRange]:
    """Apply ``delta`` in place to ``arrays`` (flat uint16 views in layout order).

    The weights must be exactly the delta's base: ``current_version`` and
    ``current_digest`` are compared with the delta's (never apply out of order). For an
    anchor the weights must be zero and ``current_version`` ``NO_VERSION``. Returns the
    touched ranges. If a chunk's entries are malformed (DeltaFormatError) or a chunk
    misses its target hash (DeltaVerifyError), every touched chunk is restored first:
    the weights are then exactly as before the call.

    Bytes and a :class:`PackedDelta` are first decompressed, every stream part on
    ``threads`` workers (blosc2 releases the GIL, see :mod:`.streams`; a part that cannot
    be decompressed raises DeltaFormatError with nothing touched). Then each changed
    chunk is XOR-ed by one compiled pass and hashed right after, while it is still in
    cache, on the same workers (chunks are disjoint, so the result, and the undo on a
    failure, do not depend on the thread count).
    """
    d = delta if isinstance(delta, (Delta, PackedDelta)) else read(delta)
    check_fits(d, layout, run=run)
    layout.check_arrays(arrays)
    if d.base_version != current_version or d.base_digest != current_digest:
        raise DeltaMismatchError(
            f"delta base is version {version_label(d.base_version)} digest {d.base_digest.hex()}, "
            f"weights are version {version_label(current_version)} digest {current_digest.hex()}"
        )
    changed = np.flatnonzero(d.kinds != UNCHANGED).tolist()
    tensor_of, starts, stops = layout.tensor_of.tolist(), layout.starts.tolist(), layout.stops.tolist()
    dense_lens = np.where(d.kinds == DENSE, layout.lengths, 0)
    dense_off = (np.cumsum(dense_lens) - dense_lens).tolist()
    kinds = d.kinds.tolist()
    full = d.decode(threads=threads) if isinstance(d, PackedDelta) else d

    def xor(c: int) -> int:
        """XOR chunk c in place: 0, or a kernel error code (the chunk is then untouched)."""
        seg = arrays[tensor_of[c]][starts[c] : stops[c]]
        if kinds[c] == SPARSE:
            return kernels.xor_chunk(seg, *full.varints(c))
        seg ^= full.dense[dense_off[c] : dense_off[c] + seg.size]
        return 0

    def one(c: int) -> bool | str:
        """XOR chunk c and check its target hash: True/False, or why it was not applied."""
        err = xor(c)
        if err:
            return kernels.error_text(err)
        return xxhash.xxh3_128_digest(arrays[tensor_of[c]][starts[c] : stops[c]]) == d.target_hashes[c]

    ok = parallel_map(one, changed, threads)
    if not all(r is True for r in ok):
        # XOR is its own inverse: every chunk that was XOR-ed goes back
        parallel_map(xor, [c for c, r in zip(changed, ok) if not isinstance(r, str)], threads)
        for c, r in zip(changed, ok):
            if isinstance(r, str):
                raise DeltaFormatError(f"{layout.chunk_name(c)}: cannot apply ({r}); "
                                       "all changes were undone")
        bad = changed[ok.index(False)]
        raise DeltaVerifyError(
            f"{layout.chunk_name(bad)} does not match the delta's target hash after applying "
            f"version {version_label(d.base_version)} -> {d.target_version}; all changes were undone "
            "(the weights differ from the claimed base)"
        )
    return [ChangedRange(tensor_of[c], starts[c], stops[c], full if kinds[c] == SPARSE else None, c)
            for c in changed]

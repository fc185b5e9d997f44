"""Diff two versions into a :class:`.delta.Delta` (:func:`build`), and into bytes
(:func:`encode`, :func:`encode_anchor`: :func:`build` then :func:`.wire.serialize`).

Each chunk is diffed in one compiled pass (:func:`.kernels.diff_chunk`: XOR, gaps,
split varints) into this thread's scratch buffers; chunks run on the codec's worker
threads and the result does not depend on how many. Pure; see :mod:`.codec`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import numpy as np

from . import kernels
from .delta import DENSE, SPARSE, UNCHANGED, Delta
from .params import DEFAULT_PARAMS, CodecParams
from .version import NO_VERSION, Layout, chunk_hashes, digest_of, parallel_map
from .wire import serialize

__all__ = ["build", "encode", "encode_anchor", "assemble", "varints_of"]

_SPARSE_PIECES = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def assemble(layout: Layout, kinds: list[int], pieces: list, hashes: Sequence[bytes], *, run: str,
             base_version: int, base_digest: bytes, target_version: int, target_digest: bytes) -> Delta:
    """A Delta from per-chunk ``kinds`` and pieces (SPARSE: the four varint arrays,
    DENSE: the XOR words, UNCHANGED: None)."""
    n = layout.n_chunks
    table = np.zeros((n, 3), dtype=np.int64)
    sparse = [(c, p) for c, (k, p) in enumerate(zip(kinds, pieces)) if k == SPARSE]
    for c, (gh, gt, _, vt) in sparse:
        table[c] = gh.size, gt.size, vt.size
    streams = [_cat([p[i] for _, p in sparse], np.uint8) for i in range(4)]
    return Delta(
        run=run, fingerprint=layout.fingerprint, chunk_elems=layout.chunk_elems,
        base_version=base_version, base_digest=base_digest,
        target_version=target_version, target_digest=target_digest,
        kinds=np.asarray(kinds, dtype=np.uint8).reshape(n), table=table,
        target_hashes=tuple(b"" if k == UNCHANGED else h for k, h in zip(kinds, hashes)),
        gap_head=streams[0], gap_tail=streams[1], value_head=streams[2], value_tail=streams[3],
        dense=_cat([p for k, p in zip(kinds, pieces) if k == DENSE], np.uint16),
    )


def build(
    layout: Layout,
    old: Sequence[np.ndarray] | None,
    new: Sequence[np.ndarray],
    *,
    run: str,
    base_version: int,
    base_digest: bytes,
    target_version: int,
    target_hashes: Sequence[bytes] | None = None,
    params: CodecParams = DEFAULT_PARAMS,
    threads: int | None = None,
) -> Delta:
    """Diff ``old`` -> ``new`` (flat uint16 views in layout order; ``old=None`` means zeros).

    ``target_hashes`` (the chunk hashes of ``new``) may be passed when already known.
    Chunks are diffed on ``threads`` workers (default :data:`.version.DEFAULT_THREADS`),
    each in one compiled pass (XOR, gaps, varints); the result does not depend on the
    thread count.
    """
    layout.check_arrays(new, "new weights")
    if old is not None:
        layout.check_arrays(old, "old weights")
    if target_hashes is None:
        target_hashes = chunk_hashes(layout, new, threads=threads)
    elif len(target_hashes) != layout.n_chunks:
        raise ValueError(f"target_hashes: expected {layout.n_chunks}, got {len(target_hashes)}")
    tensor_of, starts, stops = layout.tensor_of.tolist(), layout.starts.tolist(), layout.stops.tolist()
    width = int(layout.lengths.max(initial=0))
    threshold = params.dense_threshold

    def diff(c: int):
        t, lo, hi = tensor_of[c], starts[c], stops[c]
        seg_new = new[t][lo:hi]
        seg_old = seg_new if old is None else old[t][lo:hi]
        gh, gt, vh, vt = _scratch(width)
        k, nt_g, nt_v = kernels.diff_chunk(seg_old, seg_new, old is not None,
                                           math.floor(threshold * (hi - lo)), gh, gt, vh, vt)
        if k == 0:
            return UNCHANGED, None
        if k < 0:
            return DENSE, seg_new.copy() if old is None else np.bitwise_xor(seg_old, seg_new)
        return SPARSE, (gh[:k].copy(), gt[:nt_g].copy(), vh[:k].copy(), vt[:nt_v].copy())

    parts = parallel_map(diff, range(layout.n_chunks), threads)
    return assemble(layout, [p[0] for p in parts], [p[1] for p in parts], target_hashes, run=run,
                    base_version=base_version, base_digest=base_digest,
                    target_version=target_version, target_digest=digest_of(target_hashes))


_local = threading.local()


def _scratch(n: int) -> _SPARSE_PIECES:
    """This thread's reusable varint buffers for a chunk of up to ``n`` elements (no page
    faults from fresh allocations per chunk)."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None or bufs[0].size < n:
        g_tail, v_tail = kernels.tail_bound(n)
        bufs = _local.bufs = (np.empty(n, np.uint8), np.empty(g_tail, np.uint8),
                              np.empty(n, np.uint8), np.empty(v_tail, np.uint8))
    return bufs


def varints_of(positions: np.ndarray, values: np.ndarray) -> _SPARSE_PIECES:
    """Split-varint arrays of sorted, distinct ``positions`` and non-zero ``values``."""
    k = positions.size
    gh, vh = np.empty(k, np.uint8), np.empty(k, np.uint8)
    g_tail, v_tail = kernels.tail_bound(int(positions[-1]) + 1 if k else 0)
    gt, vt = np.empty(g_tail, np.uint8), np.empty(min(v_tail, 2 * k), np.uint8)
    nt_g, nt_v = kernels.encode_entries(positions, values, gh, gt, vh, vt)
    return gh, gt[:nt_g].copy(), vh, vt[:nt_v].copy()


def _cat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype)



def encode(
    layout: Layout,
    old: Sequence[np.ndarray] | None,
    new: Sequence[np.ndarray],
    *,
    params: CodecParams = DEFAULT_PARAMS,
    threads: int | None = None,
    **header,
) -> bytes:
    """The serialized delta ``old`` -> ``new``; ``header`` is :func:`build`'s ``run``,
    ``base_version``, ``base_digest``, ``target_version`` and ``target_hashes``."""
    d = build(layout, old, new, params=params, threads=threads, **header)
    return serialize(d, params, threads=threads)


def encode_anchor(layout: Layout, new: Sequence[np.ndarray], *, run: str, version: int,
                  target_hashes: Sequence[bytes] | None = None, params: CodecParams = DEFAULT_PARAMS,
                  threads: int | None = None) -> bytes:
    """The serialized anchor of ``new``: a delta from the all-zero model."""
    return encode(layout, None, new, run=run, base_version=NO_VERSION, base_digest=layout.zero_digest(),
                  target_version=version, target_hashes=target_hashes, params=params, threads=threads)

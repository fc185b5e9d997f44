"""Compose two deltas into one (:func:`compose`): what a publisher serves to a follower
that is several versions behind. Pure; see :mod:`.codec`.
"""

from __future__ import annotations

import numpy as np

from .applier import check_fits
from .delta import DENSE, SPARSE, UNCHANGED, Delta
from .encoder import assemble, varints_of
from .errors import DeltaMismatchError
from .params import DEFAULT_PARAMS, CodecParams
from .version import Layout, version_label

__all__ = ["compose"]


def compose(first: Delta, second: Delta, layout: Layout, params: CodecParams = DEFAULT_PARAMS) -> Delta:
    """One delta equal to applying ``first`` then ``second``.

    XOR deltas compose by merging sorted positions and XOR-ing values at equal positions
    (entries that cancel drop out); any dense side makes the chunk dense, and the result is
    re-sparsified by ``params.dense_threshold``. A chunk only one side changes keeps that
    side's bytes as they are. Composing an anchor with a delta gives an anchor of the
    later version.
    """
    for d in (first, second):
        check_fits(d, layout)
    if first.run != second.run:
        raise DeltaMismatchError(f"cannot compose deltas of runs {first.run!r} and {second.run!r}")
    if first.target_version != second.base_version or first.target_digest != second.base_digest:
        raise DeltaMismatchError(
            f"cannot compose: first ends at version {version_label(first.target_version)}, "
            f"second starts at {version_label(second.base_version)} (or digests differ)"
        )
    kinds, pieces, hashes = [], [], []
    for c in range(layout.n_chunks):
        k1, k2 = int(first.kinds[c]), int(second.kinds[c])
        if k2 == UNCHANGED or k1 == UNCHANGED:
            src = first if k2 == UNCHANGED else second
            kind = int(src.kinds[c])
            piece = src.varints(c) if kind == SPARSE else src.chunk(c, layout)[1]
            kinds.append(kind)
            pieces.append(piece)
            hashes.append(src.target_hashes[c])
            continue
        n = int(layout.lengths[c])
        _, a1, b1 = first.chunk(c, layout)
        _, a2, b2 = second.chunk(c, layout)
        if k1 == SPARSE and k2 == SPARSE:
            pos, val = _merge_xor(a1, b1, a2, b2)
        else:
            words = _densify(k1, a1, b1, n) ^ _densify(k2, a2, b2, n)
            pos = np.flatnonzero(words)
            if pos.size > params.dense_threshold * n:
                kinds.append(DENSE)
                pieces.append(words)
                hashes.append(second.target_hashes[c])
                continue
            val = words[pos]
        kinds.append(SPARSE if pos.size else UNCHANGED)
        pieces.append(varints_of(pos, val) if pos.size else None)
        hashes.append(second.target_hashes[c])
    return assemble(layout, kinds, pieces, hashes, run=first.run, base_version=first.base_version,
                    base_digest=first.base_digest, target_version=second.target_version,
                    target_digest=second.target_digest)


def _merge_xor(p1: np.ndarray, v1: np.ndarray, p2: np.ndarray, v2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge two sorted, duplicate-free sparse lists, XOR-ing values at equal positions
    and dropping entries that cancel to 0.

    A stable argsort of the two concatenated sorted runs is numpy's timsort, which finds
    the two runs and merges them in linear time (measured faster than a searchsorted
    placement). A position occurs at most twice and its entries end up adjacent, so the
    XOR of equal positions is one pass over neighbours (no np.unique, which sorts again).
    """
    pos = np.concatenate([p1, p2])
    order = np.argsort(pos, kind="stable")
    pos = pos[order]
    val = np.concatenate([v1, v2])[order]
    dup = np.flatnonzero(pos[1:] == pos[:-1])  # first of each equal pair
    if dup.size:
        val[dup] ^= val[dup + 1]
        val[dup + 1] = 0  # the second of the pair is dropped with the cancelled entries
    elif val.all():
        return pos, val
    keep = val != 0
    return pos[keep], val[keep]


def _densify(kind: int, a: np.ndarray | None, b: np.ndarray | None, n: int) -> np.ndarray:
    if kind == DENSE:
        return a.copy()
    out = np.zeros(n, dtype=np.uint16)
    if kind == SPARSE:
        out[a] = b
    return out

"""The delta as data: its chunk kinds, its streams, and the types that hold one.

A :class:`DeltaHeader` is what a delta says about itself (run, model, base and target,
chunk table); a :class:`PackedDelta` adds its stored (still compressed) streams, as
:func:`.wire.read` checks them; a :class:`Delta` adds the raw streams, as
:func:`.encoder.build` makes them and :func:`.applier.apply` and :func:`.composer.compose`
read them. A :class:`ChangedRange` is what an apply touched. Pure; see :mod:`.codec`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from . import kernels, streams
from .errors import DeltaFormatError, StreamError
from .version import NO_VERSION, Layout, parallel_map

__all__ = ["UNCHANGED", "SPARSE", "DENSE", "STREAMS", "DeltaHeader", "Delta", "PackedDelta",
           "ChangedRange"]

UNCHANGED, SPARSE, DENSE = 0, 1, 2
STREAMS = ("gap_head", "gap_tail", "value_head", "value_tail", "dense")
"""The streams of a delta, in stored order."""
_DTYPE = (np.uint8, np.uint8, np.uint8, np.uint8, np.uint16)


@dataclass(frozen=True, eq=False)
class DeltaHeader:
    """What a delta says about itself: run, model, base and target, and its chunk table.

    ``table[c]`` is ``(entries, gap tail bytes, value tail bytes)`` of chunk ``c`` (all 0
    unless SPARSE); every sparse chunk's bytes are concatenated in chunk order in the
    four byte streams, so ``offsets[c]`` (the running sums) is where chunk ``c``'s bytes
    start in the heads (entries), gap tails and value tails; dense chunks' XOR words are
    concatenated in chunk order in the dense stream; ``target_hashes[c]`` is the chunk's
    hash after applying (``b""`` if UNCHANGED).
    """

    run: str
    fingerprint: bytes
    chunk_elems: int
    base_version: int
    base_digest: bytes
    target_version: int
    target_digest: bytes
    kinds: np.ndarray  # uint8 [n_chunks]
    table: np.ndarray  # int64 [n_chunks, 3]
    target_hashes: tuple[bytes, ...]
    offsets: np.ndarray = field(init=False)  # int64 [n_chunks + 1, 3]: where each chunk's bytes start

    def __post_init__(self) -> None:
        off = np.zeros((len(self.kinds) + 1, 3), dtype=np.int64)
        np.cumsum(self.table, axis=0, out=off[1:])
        object.__setattr__(self, "offsets", off)

    @property
    def n_chunks(self) -> int:
        return len(self.kinds)

    @property
    def counts(self) -> np.ndarray:
        """Sparse entries per chunk (int64 [n_chunks])."""
        return self.table[:, 0]

    @property
    def n_entries(self) -> int:
        return int(self.offsets[-1, 0])

    @property
    def is_anchor(self) -> bool:
        return self.base_version == NO_VERSION

    @property
    def is_empty(self) -> bool:
        """True when no chunk changes."""
        return not bool((self.kinds != UNCHANGED).any())


@dataclass(frozen=True, eq=False)
class Delta(DeltaHeader):
    """A decoded delta, its sparse chunks still in split-varint form (what the kernels
    read; positions are decoded per chunk on demand by :meth:`entries`)."""

    gap_head: np.ndarray  # uint8, one per entry
    gap_tail: np.ndarray  # uint8
    value_head: np.ndarray  # uint8, one per entry
    value_tail: np.ndarray  # uint8
    dense: np.ndarray  # uint16

    @property
    def n_entries(self) -> int:
        return int(self.gap_head.size)

    @property
    def n_dense_words(self) -> int:
        return int(self.dense.size)

    @property
    def changed_elements(self) -> int:
        """Number of elements whose bits change (dense chunks counted exactly)."""
        return self.n_entries + int(np.count_nonzero(self.dense))

    def streams(self) -> tuple[np.ndarray, ...]:
        """The five raw streams, in :data:`STREAMS` order."""
        return self.gap_head, self.gap_tail, self.value_head, self.value_tail, self.dense

    def varints(self, c: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Chunk ``c``'s gap heads, gap tails, value heads, value tails (views)."""
        (e0, g0, v0), (e1, g1, v1) = self.offsets[c].tolist(), self.offsets[c + 1].tolist()
        return self.gap_head[e0:e1], self.gap_tail[g0:g1], self.value_head[e0:e1], self.value_tail[v0:v1]

    def entries(self, c: int, n: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Chunk ``c``'s positions (int64, relative to the chunk, in a chunk of ``n``
        elements, default ``chunk_elems``) and XOR words (uint16); DeltaFormatError if
        they are malformed."""
        gh, gt, vh, vt = self.varints(c)
        pos, val = np.empty(gh.size, np.int64), np.empty(gh.size, np.uint16)
        err = kernels.decode_entries(gh, gt, vh, vt, self.chunk_elems if n is None else n, pos, val)
        if err:
            raise DeltaFormatError(f"chunk {c}: {kernels.error_text(err)}")
        return pos, val

    def xor_words(self) -> np.ndarray:
        """Every non-zero XOR word of the delta (sparse entries, then dense words)."""
        parts = [self.entries(c)[1] for c in np.flatnonzero(self.kinds == SPARSE).tolist()]
        parts.append(self.dense[self.dense != 0])
        return np.concatenate(parts)

    def chunk(self, c: int, layout: Layout) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """``(kind, positions or dense words, values or None)`` of chunk ``c``, decoded."""
        kind = int(self.kinds[c])
        if kind == SPARSE:
            return (kind, *self.entries(c, int(layout.lengths[c])))
        if kind == DENSE:
            lo, hi = self._dense_offsets(layout)[c]
            return kind, self.dense[lo:hi], None
        return kind, None, None

    def _dense_offsets(self, layout: Layout) -> dict[int, tuple[int, int]]:
        cache = self.__dict__.get("_dense_cache")
        if cache is None:
            cache, at = {}, 0
            for c in np.flatnonzero(self.kinds == DENSE).tolist():
                n = int(layout.lengths[c])
                cache[c] = (at, at + n)
                at += n
            self.__dict__["_dense_cache"] = cache
        return cache


@dataclass(frozen=True, eq=False)
class PackedDelta(DeltaHeader):
    """A checked delta whose streams are still compressed (what :func:`read` returns).

    Everything :func:`parse` checks has been checked (trailer, structure, chunk table,
    stream hashes, part tables); nothing is decompressed (the follower decides from the
    header how to apply). :meth:`decode` decompresses every part into a :class:`Delta`.
    ``parts[s]`` are stream ``s``'s stored parts (views into the delta's bytes) with the
    raw ranges they fill.
    """

    raw_lengths: tuple[int, ...]  # raw bytes of each stream, in STREAMS order
    parts: tuple[tuple[streams.Part, ...], ...]

    @property
    def n_dense_words(self) -> int:
        return self.raw_lengths[-1] // 2

    def buffers(self) -> list[np.ndarray]:
        """Uninitialised uint8 outputs for the five raw streams."""
        return [np.empty(n, np.uint8) for n in self.raw_lengths]

    def decompress(self, s: int, i: int, outs: Sequence[np.ndarray]) -> None:
        """Part ``i`` of stream ``s`` into ``outs[s]``; DeltaFormatError if blosc2 cannot."""
        try:
            streams.decompress_into(STREAMS[s], i, self.parts[s][i], outs[s])
        except StreamError as e:
            raise DeltaFormatError(str(e)) from None

    def decode(self, *, threads: int | None = None) -> Delta:
        """The decoded delta: every part decompressed on ``threads`` workers."""
        outs = self.buffers()
        jobs = [(s, i) for s, ps in enumerate(self.parts) for i in range(len(ps))]
        parallel_map(lambda j: self.decompress(*jobs[j], outs), range(len(jobs)), threads)
        return self.decoded(outs)

    def decoded(self, outs: Sequence[np.ndarray]) -> Delta:
        """The Delta whose raw streams are ``outs`` (every part decompressed into them)."""
        gh, gt, vh, vt, dense = (o.view(dt) for o, dt in zip(outs, _DTYPE))
        return Delta(run=self.run, fingerprint=self.fingerprint, chunk_elems=self.chunk_elems,
                     base_version=self.base_version, base_digest=self.base_digest,
                     target_version=self.target_version, target_digest=self.target_digest,
                     kinds=self.kinds, table=self.table, target_hashes=self.target_hashes,
                     gap_head=gh, gap_tail=gt, value_head=vh, value_tail=vt, dense=dense)


class ChangedRange:
    """Elements of tensor ``tensor`` touched by an apply: ``start + positions`` (flat
    indices into the tensor; positions are relative to ``start``, as in the delta) or,
    when ``positions`` is None, all of ``[start, stop)``. Positions are decoded from the
    delta when first read (a bf16 follower never needs them)."""

    __slots__ = ("tensor", "start", "stop", "_delta", "_chunk", "_positions")

    def __init__(self, tensor: int, start: int, stop: int, delta: Delta | None = None, chunk: int = -1):
        self.tensor, self.start, self.stop = tensor, start, stop
        self._delta, self._chunk, self._positions = delta, chunk, None

    @property
    def positions(self) -> np.ndarray | None:
        if self._delta is None:
            return None
        if self._positions is None:
            self._positions = self._delta.entries(self._chunk, self.stop - self.start)[0]
        return self._positions

    def __repr__(self) -> str:
        kind = "all" if self._delta is None else f"{int(self._delta.counts[self._chunk])} positions"
        return f"ChangedRange(tensor={self.tensor}, [{self.start}, {self.stop}), {kind})"

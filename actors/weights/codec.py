"""The lossless sparse delta codec (pure, sans-IO): encode, parse, apply, compose.

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
covers every byte. The byte layout is in docs/delta-format.md.

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

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import blosc2
import msgspec
import numpy as np
import xxhash

from . import kernels, streams
from .version import NO_VERSION, Layout, chunk_hashes, digest_of, parallel_map

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

MAGIC = b"FRLD"
FORMAT_VERSION = 2
UNCHANGED, SPARSE, DENSE = 0, 1, 2
_HASH = 16

_FIXED = struct.Struct("<4sHBB16sQ16sQ16sIIIIQH")
_STREAM = struct.Struct("<QQ16s")
STREAMS = ("gap_head", "gap_tail", "value_head", "value_tail", "dense")
"""The streams of a delta, in stored order."""
_ITEMSIZE = (1, 1, 1, 1, 2)
_DTYPE = (np.uint8, np.uint8, np.uint8, np.uint8, np.uint16)


class DeltaError(ValueError):
    """Base class of every delta error."""


class DeltaFormatError(DeltaError):
    """The bytes are not a well-formed delta (truncated, corrupted, wrong version)."""


class DeltaMismatchError(DeltaError):
    """The delta does not fit these weights (run, fingerprint, base version or digest)."""


class DeltaVerifyError(DeltaError):
    """A chunk did not reach its target hash; the weights were restored (undone)."""


class CodecParams(msgspec.Struct, frozen=True):
    """How streams are compressed. The decoder needs none of this (blosc2 frames say it)."""

    codec: str = "zstd"
    clevel: int = 1
    # "shuffle" | "bitshuffle" | "none"; shuffle applies to the dense words only (on the
    # byte streams it is the identity, which blosc2 would still pay a copy per block for)
    filter: str = "shuffle"
    split: bool = True  # compress each byte plane separately (dense words)
    # 0: one block per byte-stream part of >= streams.ONE_BLOCK_FROM raw bytes, blosc2's
    # choice otherwise; -1: blosc2's choice everywhere; > 0: that block size everywhere
    blocksize: int = 0
    part_bytes: int = streams.PART_BYTES  # raw bytes per stored part (any size reads back)
    dense_threshold: float = 0.25  # changed fraction above which a chunk goes dense
    # blosc2 threads per stream part; 0: one (parts already run on the codec's worker
    # threads, and one thread keeps the bytes reproducible, see docs/delta-format.md)
    nthreads: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.dense_threshold <= 1.0:
            raise ValueError(f"CodecParams.dense_threshold must be in [0, 1], got {self.dense_threshold}")
        if self.blocksize < -1:
            raise ValueError(f"CodecParams.blocksize must be -1, 0 or a size in bytes, got {self.blocksize}")
        if not 2 <= self.part_bytes <= 1 << 30:
            raise ValueError(f"CodecParams.part_bytes must be in [2, 2**30], got {self.part_bytes}")

    def cparams(self, typesize: int, nbytes: int = 0) -> dict:
        """blosc2 settings for a part of ``nbytes`` raw bytes of ``typesize``-byte items."""
        codecs = {"zstd": blosc2.Codec.ZSTD, "lz4": blosc2.Codec.LZ4, "zlib": blosc2.Codec.ZLIB,
                  "blosclz": blosc2.Codec.BLOSCLZ, "lz4hc": blosc2.Codec.LZ4HC}
        filters = {"shuffle": blosc2.Filter.SHUFFLE, "bitshuffle": blosc2.Filter.BITSHUFFLE,
                   "none": blosc2.Filter.NOFILTER}
        if self.codec not in codecs:
            raise ValueError(f"CodecParams.codec must be one of {sorted(codecs)}, got {self.codec!r}")
        if self.filter not in filters:
            raise ValueError(f"CodecParams.filter must be one of {sorted(filters)}, got {self.filter!r}")
        byte_stream = typesize == 1
        filt = blosc2.Filter.NOFILTER if byte_stream and self.filter == "shuffle" else filters[self.filter]
        blocksize = max(self.blocksize, 0)
        if self.blocksize == 0 and byte_stream and nbytes >= streams.ONE_BLOCK_FROM:
            blocksize = nbytes
        return dict(
            typesize=typesize,
            codec=codecs[self.codec],
            clevel=self.clevel,
            filters=[filt],
            filters_meta=[0],
            splitmode=blosc2.SplitMode.ALWAYS_SPLIT if self.split and not byte_stream
            else blosc2.SplitMode.NEVER_SPLIT,
            blocksize=blocksize,
            nthreads=self.nthreads or 1,
        )


DEFAULT_PARAMS = CodecParams()


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
        except streams.StreamError as e:
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


# ----------------------------------------------------------------------------- encode

_SPARSE_PIECES = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _assemble(layout: Layout, kinds: list[int], pieces: list, hashes: Sequence[bytes], *, run: str,
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
    return _assemble(layout, [p[0] for p in parts], [p[1] for p in parts], target_hashes, run=run,
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


def _varints(positions: np.ndarray, values: np.ndarray) -> _SPARSE_PIECES:
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
    old: Sequence[np.ndarray],
    new: Sequence[np.ndarray],
    *,
    run: str,
    base_version: int,
    base_digest: bytes,
    target_version: int,
    target_hashes: Sequence[bytes] | None = None,
    params: CodecParams = DEFAULT_PARAMS,
    threads: int | None = None,
) -> bytes:
    """The serialized delta ``old`` -> ``new``."""
    d = build(layout, old, new, run=run, base_version=base_version, base_digest=base_digest,
              target_version=target_version, target_hashes=target_hashes, params=params,
              threads=threads)
    return serialize(d, params, threads=threads)


def encode_anchor(
    layout: Layout,
    new: Sequence[np.ndarray],
    *,
    run: str,
    version: int,
    target_hashes: Sequence[bytes] | None = None,
    params: CodecParams = DEFAULT_PARAMS,
    threads: int | None = None,
) -> bytes:
    """The serialized anchor of ``new``: a delta from the all-zero model."""
    d = build(layout, None, new, run=run, base_version=NO_VERSION, base_digest=layout.zero_digest(),
              target_version=version, target_hashes=target_hashes, params=params, threads=threads)
    return serialize(d, params, threads=threads)


# ----------------------------------------------------------------------------- serialize


def serialize(d: Delta, params: CodecParams = DEFAULT_PARAMS, *, threads: int | None = None) -> bytes:
    """Bytes of ``d`` in format version 2 (docs/delta-format.md); stream parts are
    compressed on ``threads`` workers."""
    run = d.run.encode()
    if len(run) > 0xFFFF:
        raise ValueError("run id longer than 65535 bytes")
    raw = d.streams()
    stored = streams.pack(raw, params.cparams, params.part_bytes, threads)
    sparse = d.kinds == SPARSE
    changed = [h for h in d.target_hashes if h]
    out = [
        _FIXED.pack(MAGIC, FORMAT_VERSION, 0, 0, d.fingerprint, d.base_version, d.base_digest,
                    d.target_version, d.target_digest, d.chunk_elems, d.n_chunks,
                    int(sparse.sum()), len(changed), d.n_entries, len(run)),
        run,
    ]
    out.extend(_STREAM.pack(len(s), r.nbytes, xxhash.xxh3_128_digest(s)) for s, r in zip(stored, raw))
    out.append(d.kinds.astype(np.uint8).tobytes())
    out.append(d.table[sparse].astype("<u4").tobytes())
    out.append(b"".join(changed))
    out.extend(stored)
    body = b"".join(out)
    return body + xxhash.xxh3_128_digest(body)


# ----------------------------------------------------------------------------- parse


class _Reader:
    def __init__(self, buf: memoryview):
        self.buf, self.at = buf, 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise DeltaFormatError(
                f"truncated delta: {what} needs {n} bytes at offset {self.at}, "
                f"{len(self.buf) - self.at} left"
            )
        out = self.buf[self.at : self.at + n]
        self.at += n
        return out


def parse(blob: bytes | bytearray | memoryview, *, threads: int | None = None) -> Delta:
    """Check and decode a serialized delta. Raises DeltaFormatError naming what is wrong.

    Streams are decompressed on ``threads`` workers. Positions stay in their compact
    varint form; they are checked (inside their chunk) as they are decoded or applied.
    """
    return read(blob).decode(threads=threads)


def read(blob: bytes | bytearray | memoryview) -> PackedDelta:
    """Check a serialized delta without decompressing it: trailer, magic, version, flags,
    every length, the chunk table, each stream's hash and part table. Raises
    DeltaFormatError naming what is wrong. The result keeps views into ``blob``."""
    buf = memoryview(blob).cast("B")
    if len(buf) < _FIXED.size + _HASH:
        raise DeltaFormatError(f"truncated delta: {len(buf)} bytes is shorter than any header")
    if bytes(buf[:4]) != MAGIC:
        raise DeltaFormatError(f"bad magic {bytes(buf[:4])!r}, expected {MAGIC!r}")
    (fmt,) = struct.unpack_from("<H", buf, 4)
    if fmt != FORMAT_VERSION:
        hint = " (an older publisher wrote it: republish or re-anchor)" if fmt < FORMAT_VERSION else ""
        raise DeltaFormatError(f"unsupported delta format version {fmt} (this reader: {FORMAT_VERSION}){hint}")
    if xxhash.xxh3_128_digest(buf[:-_HASH]) != bytes(buf[-_HASH:]):
        raise DeltaFormatError("trailer hash mismatch: the delta is corrupted or truncated")
    r = _Reader(buf[:-_HASH])
    (_, _, flags, reserved, fp, base_v, base_d, tgt_v, tgt_d, chunk_elems, n_chunks, n_sparse,
     n_changed, n_changes, run_len) = _FIXED.unpack(r.take(_FIXED.size, "fixed header"))
    if flags != 0 or reserved != 0:
        raise DeltaFormatError(f"unknown flags {flags:#x} / reserved byte {reserved:#x} in header "
                               f"(format {FORMAT_VERSION} defines none; arithmetic or other delta "
                               "kinds are not accepted)")
    try:
        run = bytes(r.take(run_len, "run id")).decode()
    except UnicodeDecodeError as e:
        raise DeltaFormatError("run id is not UTF-8") from e
    table_rows = [_STREAM.unpack(r.take(_STREAM.size, f"stream table entry {name!r}")) for name in STREAMS]
    kinds = np.frombuffer(r.take(n_chunks, "chunk kinds"), dtype=np.uint8).copy()
    if (kinds > DENSE).any():
        bad = int(np.flatnonzero(kinds > DENSE)[0])
        raise DeltaFormatError(f"chunk {bad}: unknown kind {kinds[bad]}")
    if int((kinds == SPARSE).sum()) != n_sparse or int((kinds != UNCHANGED).sum()) != n_changed:
        raise DeltaFormatError("chunk table: kind counts disagree with the header")
    table = np.zeros((n_chunks, 3), dtype=np.int64)
    table[kinds == SPARSE] = np.frombuffer(r.take(12 * n_sparse, "sparse chunk table"),
                                           dtype="<u4").reshape(n_sparse, 3)
    entries = table[kinds == SPARSE, 0]
    if (entries == 0).any() or (entries > chunk_elems).any():
        raise DeltaFormatError("chunk table: a sparse chunk has 0 entries or more than chunk_elems")
    totals = table.sum(axis=0).tolist()
    if totals[0] != n_changes:
        raise DeltaFormatError("chunk table: sparse entries do not sum to the header's change count")
    hraw = bytes(r.take(_HASH * n_changed, "target hashes"))
    changed_iter = iter(hraw[i : i + _HASH] for i in range(0, len(hraw), _HASH))
    hashes = tuple(next(changed_iter) if k != UNCHANGED else b"" for k in kinds.tolist())
    expect = (n_changes, totals[1], n_changes, totals[2], None)
    parts = []
    for (clen, raw_len, h), name, want, size in zip(table_rows, STREAMS, expect, _ITEMSIZE):
        data = r.take(clen, f"stream {name!r}")
        if xxhash.xxh3_128_digest(data) != h:
            raise DeltaFormatError(f"stream {name!r}: hash mismatch")
        if want is not None and raw_len != want:
            raise DeltaFormatError(f"stream {name!r}: {raw_len} raw bytes, the chunk table says {want}")
        if raw_len % size:
            raise DeltaFormatError(f"stream {name!r}: raw length {raw_len} is not whole elements")
        try:
            parts.append(tuple(streams.split(name, data, raw_len)))
        except streams.StreamError as e:
            raise DeltaFormatError(str(e)) from None
    if r.at != len(r.buf):
        raise DeltaFormatError(f"{len(r.buf) - r.at} unexpected bytes before the trailer")
    return PackedDelta(run=run, fingerprint=bytes(fp), chunk_elems=chunk_elems, base_version=base_v,
                       base_digest=bytes(base_d), target_version=tgt_v, target_digest=bytes(tgt_d),
                       kinds=kinds, table=table, target_hashes=hashes,
                       raw_lengths=tuple(row[1] for row in table_rows), parts=tuple(parts))


# ----------------------------------------------------------------------------- apply


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
            f"delta base is version {_v(d.base_version)} digest {d.base_digest.hex()}, "
            f"weights are version {_v(current_version)} digest {current_digest.hex()}"
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
            f"version {_v(d.base_version)} -> {d.target_version}; all changes were undone "
            "(the weights differ from the claimed base)"
        )
    return [ChangedRange(tensor_of[c], starts[c], stops[c], full if kinds[c] == SPARSE else None, c)
            for c in changed]


def _v(v: int) -> str:
    return "none" if v == NO_VERSION else str(v)


# ----------------------------------------------------------------------------- compose


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
            f"cannot compose: first ends at version {_v(first.target_version)}, "
            f"second starts at {_v(second.base_version)} (or digests differ)"
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
        pieces.append(_varints(pos, val) if pos.size else None)
        hashes.append(second.target_hashes[c])
    return _assemble(layout, kinds, pieces, hashes, run=first.run, base_version=first.base_version,
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

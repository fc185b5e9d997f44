"""The lossless sparse delta codec (pure, sans-IO): encode, parse, apply, compose.

A delta takes a model from version *base* to version *target*. For every chunk of the
layout (see :mod:`.version`) it records one of:

* ``UNCHANGED`` - nothing changed; costs one byte in the chunk table;
* ``SPARSE``    - the positions of the changed elements, as gaps, and the XOR of their
  old and new bf16 bit patterns (exact; no float arithmetic anywhere);
* ``DENSE``     - the XOR of every element of the chunk (for chunks where more than
  ``dense_threshold`` of the elements changed).

All sparse gaps of a delta form one stream (uint32), all sparse XOR values another
(uint16), all dense XOR words a third (uint16); each is compressed with blosc2 (by
default zstd level 1, byte shuffle, each byte plane compressed separately). The header
carries the run, model fingerprint, base/target version and digest, the chunk table
with each changed chunk's target hash, and each stream's hash; a trailer hash covers
every byte. The byte layout is in docs/delta-format.md.

An *anchor* is a delta whose base is the all-zero model (base version ``NO_VERSION``):
applying it to zeroed weights yields the version, so anchors, deltas and their
compositions share one format and one code path.

Applying is in place and transactional: everything that can be checked before touching
the weights is (trailer, structure, stream hashes, fingerprint, base version and
digest); each chunk is then XOR-scattered and its target hash verified, and on any
mismatch every chunk already touched is XORed back (XOR is its own inverse).

Speed: all per-chunk work (diff, gap coding, gaps -> positions, scatter-XOR, hashing)
and the stream parts' (de)compression run on a small shared thread pool
(:func:`.version.parallel_map`, ``threads`` arguments, default 2); numpy, xxhash and
blosc2 release the GIL for it. Chunks are disjoint and parts are compressed with one
blosc2 thread each, so bytes, results and undo do not depend on the thread count.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import blosc2
import msgspec
import numpy as np
import xxhash

from .version import NO_VERSION, Layout, chunk_hashes, digest_of, parallel_map

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "UNCHANGED",
    "SPARSE",
    "DENSE",
    "CodecParams",
    "DeltaError",
    "DeltaFormatError",
    "DeltaMismatchError",
    "DeltaVerifyError",
    "Delta",
    "ChangedRange",
    "DEFAULT_PARAMS",
    "check_fits",
    "encode",
    "encode_anchor",
    "build",
    "serialize",
    "parse",
    "apply",
    "compose",
]

MAGIC = b"FRLD"
FORMAT_VERSION = 1
UNCHANGED, SPARSE, DENSE = 0, 1, 2
_HASH = 16
_PART_BYTES = 1 << 22  # raw bytes per blosc2 chunk of a stream (4 MiB): parts are
# compressed on the worker threads, one blosc2 thread each, so the bytes do not depend on
# the thread count (blosc2's own threads write blocks in completion order)

_FIXED = struct.Struct("<4sHBB16sQ16sQ16sIIIIQH")
_STREAM = struct.Struct("<QQ16s")
_STREAM_NAMES = ("gaps", "values", "dense")


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
    filter: str = "shuffle"  # "shuffle" | "bitshuffle" | "none"
    split: bool = True  # compress each byte plane separately
    blocksize: int = 0  # 0: blosc2 picks
    dense_threshold: float = 0.25  # changed fraction above which a chunk goes dense
    # blosc2 threads per stream part; 0: one (parts already run on the codec's worker
    # threads, and one thread keeps the bytes reproducible, see docs/delta-format.md)
    nthreads: int = 0

    def cparams(self, typesize: int) -> dict:
        codecs = {"zstd": blosc2.Codec.ZSTD, "lz4": blosc2.Codec.LZ4, "zlib": blosc2.Codec.ZLIB,
                  "blosclz": blosc2.Codec.BLOSCLZ, "lz4hc": blosc2.Codec.LZ4HC}
        filters = {"shuffle": blosc2.Filter.SHUFFLE, "bitshuffle": blosc2.Filter.BITSHUFFLE,
                   "none": blosc2.Filter.NOFILTER}
        if self.codec not in codecs:
            raise ValueError(f"CodecParams.codec must be one of {sorted(codecs)}, got {self.codec!r}")
        if self.filter not in filters:
            raise ValueError(f"CodecParams.filter must be one of {sorted(filters)}, got {self.filter!r}")
        out = dict(
            typesize=typesize,
            codec=codecs[self.codec],
            clevel=self.clevel,
            filters=[filters[self.filter]],
            filters_meta=[0],
            splitmode=blosc2.SplitMode.ALWAYS_SPLIT if self.split else blosc2.SplitMode.NEVER_SPLIT,
            blocksize=self.blocksize,
        )
        if self.nthreads:
            out["nthreads"] = self.nthreads
        return out


DEFAULT_PARAMS = CodecParams()


@dataclass(frozen=True, eq=False)
class Delta:
    """A decoded delta. Positions are relative to their chunk's start.

    ``counts[c]`` is the number of sparse entries of chunk ``c`` (0 unless SPARSE);
    sparse entries of all chunks are concatenated in chunk order in ``positions`` /
    ``values``; dense chunks' XOR words are concatenated in ``dense``;
    ``target_hashes[c]`` is the chunk's hash after applying (``b""`` if UNCHANGED).
    """

    run: str
    fingerprint: bytes
    chunk_elems: int
    base_version: int
    base_digest: bytes
    target_version: int
    target_digest: bytes
    kinds: np.ndarray  # uint8 [n_chunks]
    counts: np.ndarray  # int64 [n_chunks]
    target_hashes: tuple[bytes, ...]
    positions: np.ndarray  # int64
    values: np.ndarray  # uint16
    dense: np.ndarray  # uint16
    sparse_offsets: np.ndarray = field(init=False)  # int64 [n_chunks + 1]

    def __post_init__(self) -> None:
        off = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=off[1:])
        object.__setattr__(self, "sparse_offsets", off)

    @property
    def n_chunks(self) -> int:
        return len(self.kinds)

    @property
    def is_anchor(self) -> bool:
        return self.base_version == NO_VERSION

    @property
    def is_empty(self) -> bool:
        """True when no chunk changes."""
        return not bool((self.kinds != UNCHANGED).any())

    @property
    def changed_elements(self) -> int:
        """Number of elements whose bits change (dense chunks counted exactly)."""
        return int(self.positions.size + np.count_nonzero(self.dense))

    def chunk(self, c: int, layout: Layout) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        """``(kind, positions or dense words, values or None)`` of chunk ``c``."""
        kind = int(self.kinds[c])
        if kind == SPARSE:
            lo, hi = self.sparse_offsets[c], self.sparse_offsets[c + 1]
            return kind, self.positions[lo:hi], self.values[lo:hi]
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


@dataclass(frozen=True)
class ChangedRange:
    """Elements of tensor ``tensor`` touched by an apply: ``start + positions`` (flat
    indices into the tensor; positions are relative to ``start``, as in the delta) or,
    when ``positions`` is None, all of ``[start, stop)``."""

    tensor: int
    start: int
    stop: int
    positions: np.ndarray | None


# ----------------------------------------------------------------------------- encode


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
    Chunks are diffed on ``threads`` workers (default :data:`.version.DEFAULT_THREADS`);
    the result does not depend on the thread count.
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

    def diff(c: int) -> tuple[int, np.ndarray | None, np.ndarray | None]:
        t, lo, hi = tensor_of[c], starts[c], stops[c]
        n = hi - lo
        x_buf, mask_buf = _scratch(width)
        seg_new = new[t][lo:hi]
        # one XOR pass, a bool mask of it and the mask's nonzero(): nonzero() on a bool
        # mask is several times faster than on uint16, and gathering the XOR words once
        # beats gathering old and new and XOR-ing the gathers (15% less CPU at 1.7% and
        # at 11% changed on the bench's data)
        x = seg_new if old is None else np.bitwise_xor(old[t][lo:hi], seg_new, out=x_buf[:n])
        mask = np.not_equal(x, 0, out=mask_buf[:n])
        k = int(np.count_nonzero(mask))
        if k == 0:
            return UNCHANGED, None, None
        if k > threshold * n:
            return DENSE, x.copy(), None
        nz = np.flatnonzero(mask)
        return SPARSE, nz, x[nz]

    parts = parallel_map(diff, range(layout.n_chunks), threads)
    kinds = np.fromiter((p[0] for p in parts), dtype=np.uint8, count=len(parts))
    counts = np.fromiter((p[1].size if p[0] == SPARSE else 0 for p in parts), dtype=np.int64,
                         count=len(parts))
    hashes = tuple(b"" if p[0] == UNCHANGED else h for p, h in zip(parts, target_hashes))
    return Delta(
        run=run,
        fingerprint=layout.fingerprint,
        chunk_elems=layout.chunk_elems,
        base_version=base_version,
        base_digest=base_digest,
        target_version=target_version,
        target_digest=digest_of(target_hashes),
        kinds=kinds,
        counts=counts,
        target_hashes=hashes,
        positions=_cat([p[1] for p in parts if p[0] == SPARSE], np.int64),
        values=_cat([p[2] for p in parts if p[0] == SPARSE], np.uint16),
        dense=_cat([p[1] for p in parts if p[0] == DENSE], np.uint16),
    )


_local = threading.local()


def _scratch(n: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's reusable XOR and mask buffers of at least ``n`` elements (no page
    faults from a fresh 2 MiB allocation per chunk)."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None or bufs[0].size < n:
        bufs = _local.bufs = (np.empty(n, dtype=np.uint16), np.empty(n, dtype=bool))
    return bufs


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


def _gaps(d: Delta, threads: int | None = None) -> np.ndarray:
    """Per-chunk gap coding: gap[0] = pos[0], gap[i] = pos[i] - pos[i-1] - 1 (uint32).

    Computed chunk by chunk on ``threads`` workers straight into the uint32 output
    (positions are < chunk_elems <= 2**31, so every gap fits).
    """
    pos = d.positions
    out = np.empty(pos.size, dtype=np.uint32)
    off = d.sparse_offsets.tolist()

    def one(c: int) -> None:
        lo, hi = off[c], off[c + 1]
        out[lo] = pos[lo]
        g = out[lo + 1 : hi]
        np.subtract(pos[lo + 1 : hi], pos[lo : hi - 1], out=g, casting="unsafe")
        g -= np.uint32(1)

    parallel_map(one, np.flatnonzero(d.counts).tolist(), threads)
    return out


def _pack_stream(arr: np.ndarray, params: CodecParams, threads: int | None = None) -> bytes:
    """A stream: u32 part count, u64 compressed length of each part, then the parts.

    Parts are compressed on ``threads`` workers; each uses ``params.nthreads`` blosc2
    threads (0: one, which keeps the bytes reproducible)."""
    raw = arr.view(np.uint8)
    if raw.size == 0:
        return b""
    cp = params.cparams(arr.itemsize)
    cp.setdefault("nthreads", 1)
    step = _PART_BYTES - _PART_BYTES % arr.itemsize
    parts = parallel_map(lambda i: blosc2.compress2(raw[i : i + step], **cp),
                         range(0, raw.size, step), threads)
    head = struct.pack(f"<I{len(parts)}Q", len(parts), *(len(p) for p in parts))
    return head + b"".join(parts)


def serialize(d: Delta, params: CodecParams = DEFAULT_PARAMS, *, threads: int | None = None) -> bytes:
    """Bytes of ``d`` in format version 1 (docs/delta-format.md)."""
    run = d.run.encode()
    if len(run) > 0xFFFF:
        raise ValueError("run id longer than 65535 bytes")
    streams = [_pack_stream(_gaps(d, threads), params, threads),
               _pack_stream(d.values, params, threads), _pack_stream(d.dense, params, threads)]
    raws = [d.positions.size * 4, d.values.size * 2, d.dense.size * 2]
    sparse = d.kinds == SPARSE
    changed = [h for h in d.target_hashes if h]
    out = [
        _FIXED.pack(MAGIC, FORMAT_VERSION, 0, 0, d.fingerprint, d.base_version, d.base_digest,
                    d.target_version, d.target_digest, d.chunk_elems, d.n_chunks,
                    int(sparse.sum()), len(changed), int(d.positions.size), len(run)),
        run,
    ]
    for s, raw in zip(streams, raws):
        out.append(_STREAM.pack(len(s), raw, xxhash.xxh3_128_digest(s)))
    out.append(d.kinds.astype(np.uint8).tobytes())
    out.append(d.counts[sparse].astype("<u4").tobytes())
    out.append(b"".join(changed))
    out.extend(streams)
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


def _unpack_stream(data: memoryview, raw_len: int, dtype, name: str,
                   threads: int | None = None) -> np.ndarray:
    """Decode one stream; its parts are checked first, then decompressed in parallel on
    ``threads`` workers (one blosc2 thread each) straight into the output."""
    if raw_len == 0:
        if len(data):
            raise DeltaFormatError(f"stream {name!r}: {len(data)} bytes for an empty stream")
        return np.empty(0, dtype=dtype)
    r = _Reader(data)
    (n_parts,) = struct.unpack("<I", r.take(4, f"stream {name!r} part count"))
    sizes = struct.unpack(f"<{n_parts}Q", r.take(8 * n_parts, f"stream {name!r} part sizes"))
    out = np.empty(raw_len, dtype=np.uint8)
    jobs: list[tuple[memoryview, int, int]] = []
    at = 0
    for i, sz in enumerate(sizes):
        part = r.take(sz, f"stream {name!r} part {i}")
        try:
            nbytes = blosc2.get_cbuffer_sizes(part)[0]
        except Exception as e:  # blosc2 raises several types for garbage headers
            raise DeltaFormatError(f"stream {name!r} part {i}: not a blosc2 chunk ({e})") from e
        if at + nbytes > raw_len:
            raise DeltaFormatError(f"stream {name!r}: parts exceed the declared {raw_len} bytes")
        jobs.append((part, at, nbytes))
        at += nbytes
    if at != raw_len or r.at != len(data):
        raise DeltaFormatError(f"stream {name!r}: parts hold {at} bytes, header says {raw_len}")

    def one(i: int) -> Exception | None:
        part, lo, nbytes = jobs[i]
        try:
            blosc2.decompress2(part, dst=out[lo : lo + nbytes], nthreads=1)
        except Exception as e:  # noqa: BLE001 - reported below with the part's index
            return e
        return None

    for i, e in enumerate(parallel_map(one, range(len(jobs)), threads)):
        if e is not None:
            raise DeltaFormatError(f"stream {name!r} part {i}: cannot decompress ({e})") from e
    return out.view(dtype)


def parse(blob: bytes | bytearray | memoryview, *, threads: int | None = None) -> Delta:
    """Check and decode a serialized delta. Raises DeltaFormatError naming what is wrong.

    Gaps are turned back into positions chunk by chunk on ``threads`` workers.
    """
    buf = memoryview(blob).cast("B")
    if len(buf) < _FIXED.size + _HASH:
        raise DeltaFormatError(f"truncated delta: {len(buf)} bytes is shorter than any header")
    if bytes(buf[:4]) != MAGIC:
        raise DeltaFormatError(f"bad magic {bytes(buf[:4])!r}, expected {MAGIC!r}")
    (fmt,) = struct.unpack_from("<H", buf, 4)
    if fmt != FORMAT_VERSION:
        raise DeltaFormatError(f"unsupported delta format version {fmt} (this reader: {FORMAT_VERSION})")
    if xxhash.xxh3_128_digest(buf[:-_HASH]) != bytes(buf[-_HASH:]):
        raise DeltaFormatError("trailer hash mismatch: the delta is corrupted or truncated")
    r = _Reader(buf[:-_HASH])
    (_, _, flags, reserved, fp, base_v, base_d, tgt_v, tgt_d, chunk_elems, n_chunks, n_sparse,
     n_changed, n_changes, run_len) = _FIXED.unpack(r.take(_FIXED.size, "fixed header"))
    if flags != 0 or reserved != 0:
        raise DeltaFormatError(f"unknown flags {flags:#x} / reserved byte {reserved:#x} in header "
                               "(format 1 defines none; arithmetic or other delta kinds are not accepted)")
    try:
        run = bytes(r.take(run_len, "run id")).decode()
    except UnicodeDecodeError as e:
        raise DeltaFormatError("run id is not UTF-8") from e
    table = [_STREAM.unpack(r.take(_STREAM.size, f"stream table entry {i}")) for i in range(3)]
    kinds = np.frombuffer(r.take(n_chunks, "chunk kinds"), dtype=np.uint8).copy()
    if (kinds > DENSE).any():
        bad = int(np.flatnonzero(kinds > DENSE)[0])
        raise DeltaFormatError(f"chunk {bad}: unknown kind {kinds[bad]}")
    if int((kinds == SPARSE).sum()) != n_sparse or int((kinds != UNCHANGED).sum()) != n_changed:
        raise DeltaFormatError("chunk table: kind counts disagree with the header")
    sparse_counts = np.frombuffer(r.take(4 * n_sparse, "sparse counts"), dtype="<u4")
    counts = np.zeros(n_chunks, dtype=np.int64)
    counts[kinds == SPARSE] = sparse_counts
    if int(counts.sum()) != n_changes:
        raise DeltaFormatError("chunk table: sparse counts do not sum to the header's change count")
    if (counts[kinds == SPARSE] == 0).any() or (counts > chunk_elems).any():
        raise DeltaFormatError("chunk table: a sparse count is 0 or exceeds chunk_elems")
    hraw = bytes(r.take(_HASH * n_changed, "target hashes"))
    changed_iter = iter(hraw[i : i + _HASH] for i in range(0, len(hraw), _HASH))
    hashes = tuple(next(changed_iter) if k != UNCHANGED else b"" for k in kinds.tolist())
    raw_expect = (n_changes * 4, n_changes * 2, None)
    arrays = []
    for (clen, raw_len, h), name, expect, dtype in zip(
        table, _STREAM_NAMES, raw_expect, (np.uint32, np.uint16, np.uint16)
    ):
        data = r.take(clen, f"stream {name!r}")
        if xxhash.xxh3_128_digest(data) != h:
            raise DeltaFormatError(f"stream {name!r}: hash mismatch")
        if expect is not None and raw_len != expect:
            raise DeltaFormatError(f"stream {name!r}: {raw_len} raw bytes, expected {expect}")
        if raw_len % np.dtype(dtype).itemsize:
            raise DeltaFormatError(f"stream {name!r}: raw length {raw_len} is not whole elements")
        arrays.append(_unpack_stream(data, raw_len, dtype, name, threads))
    if r.at != len(r.buf):
        raise DeltaFormatError(f"{len(r.buf) - r.at} unexpected bytes before the trailer")
    gaps, values, dense = arrays
    positions = _positions(gaps, counts, threads)
    d = Delta(run=run, fingerprint=bytes(fp), chunk_elems=chunk_elems, base_version=base_v,
              base_digest=bytes(base_d), target_version=tgt_v, target_digest=bytes(tgt_d),
              kinds=kinds, counts=counts, target_hashes=hashes, positions=positions,
              values=values, dense=dense)
    if positions.size:
        last = positions[d.sparse_offsets[1:][counts > 0] - 1]
        if (last >= chunk_elems).any():
            raise DeltaFormatError("a sparse position lies beyond chunk_elems")
    return d


def _positions(gaps: np.ndarray, counts: np.ndarray, threads: int | None = None) -> np.ndarray:
    """Inverse of _gaps: chunk-relative positions from per-chunk gaps.

    Within a chunk pos[i] = sum(gap[:i+1]) + i: one int64 cumsum of the uint32 gaps plus
    0, 1, 2, ... (a shared read-only ramp), chunk by chunk on ``threads`` workers.
    """
    out = np.empty(gaps.size, dtype=np.int64)
    if gaps.size == 0:
        return out
    ends = np.cumsum(counts)
    nz = np.flatnonzero(counts)
    los, his = (ends - counts)[nz].tolist(), ends[nz].tolist()
    ramp = np.arange(int(counts.max()), dtype=np.int64)

    def one(i: int) -> None:
        o = out[los[i] : his[i]]
        np.cumsum(gaps[los[i] : his[i]], dtype=np.int64, out=o)
        o += ramp[: o.size]

    parallel_map(one, range(len(los)), threads)
    return out


# ----------------------------------------------------------------------------- apply


def check_fits(d: Delta, layout: Layout, *, run: str | None = None) -> None:
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
    sparse = d.kinds == SPARSE
    if (d.counts[sparse] > layout.lengths[sparse]).any():
        raise DeltaFormatError("a sparse chunk has more entries than elements")
    if d.positions.size:
        nz = d.counts > 0
        last = d.positions[d.sparse_offsets[1:][nz] - 1]
        bad = np.flatnonzero(last >= layout.lengths[nz])
        if bad.size:
            c = int(np.flatnonzero(nz)[bad[0]])
            raise DeltaFormatError(f"{layout.chunk_name(c)}: a position lies beyond the chunk")
    want = int(layout.lengths[d.kinds == DENSE].sum())
    if d.dense.size != want:
        raise DeltaFormatError(f"dense stream holds {d.dense.size} words, dense chunks need {want}")


def apply(
    arrays: Sequence[np.ndarray],
    delta: Delta | bytes | bytearray | memoryview,
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
    touched ranges. On a target-hash mismatch every touched chunk is restored and
    DeltaVerifyError is raised; the weights are then exactly as before the call.

    Chunks are XOR-ed and hashed on ``threads`` workers (chunks are disjoint, so the
    result, and the undo on a mismatch, do not depend on the thread count).
    """
    d = delta if isinstance(delta, Delta) else parse(delta, threads=threads)
    check_fits(d, layout, run=run)
    layout.check_arrays(arrays)
    if d.base_version != current_version or d.base_digest != current_digest:
        raise DeltaMismatchError(
            f"delta base is version {_v(d.base_version)} digest {d.base_digest.hex()}, "
            f"weights are version {_v(current_version)} digest {current_digest.hex()}"
        )
    changed = np.flatnonzero(d.kinds != UNCHANGED).tolist()
    tensor_of, starts, stops = layout.tensor_of.tolist(), layout.starts.tolist(), layout.stops.tolist()
    sp_off = d.sparse_offsets.tolist()
    dense_lens = np.where(d.kinds == DENSE, layout.lengths, 0)
    dense_off = (np.cumsum(dense_lens) - dense_lens).tolist()
    kinds = d.kinds.tolist()

    def xor(c: int) -> None:
        seg = arrays[tensor_of[c]][starts[c] : stops[c]]
        if kinds[c] == SPARSE:
            pos = d.positions[sp_off[c] : sp_off[c + 1]]
            seg[pos] ^= d.values[sp_off[c] : sp_off[c + 1]]
        else:
            seg ^= d.dense[dense_off[c] : dense_off[c] + seg.size]

    def one(c: int) -> bool | Exception:
        """XOR chunk c in place; whether it reached its target hash (an exception: the
        chunk was not touched)."""
        try:
            xor(c)
        except Exception as e:  # noqa: BLE001 - handed back so the other chunks are undone
            return e
        return xxhash.xxh3_128_digest(arrays[tensor_of[c]][starts[c] : stops[c]]) == d.target_hashes[c]

    ok = parallel_map(one, changed, threads)
    if not all(r is True for r in ok):
        # XOR is its own inverse: every chunk that was XOR-ed goes back
        parallel_map(xor, [c for c, r in zip(changed, ok) if not isinstance(r, Exception)], threads)
        for c, r in zip(changed, ok):
            if isinstance(r, Exception):
                raise DeltaFormatError(f"{layout.chunk_name(c)}: cannot apply ({r!r}); "
                                       "all changes were undone") from r
        bad = changed[ok.index(False)]
        raise DeltaVerifyError(
            f"{layout.chunk_name(bad)} does not match the delta's target hash after applying "
            f"version {_v(d.base_version)} -> {d.target_version}; all changes were undone "
            "(the weights differ from the claimed base)"
        )
    return [
        ChangedRange(tensor_of[c], starts[c], stops[c],
                     d.positions[sp_off[c] : sp_off[c + 1]] if kinds[c] == SPARSE else None)
        for c in changed
    ]


def _v(v: int) -> str:
    return "none" if v == NO_VERSION else str(v)


# ----------------------------------------------------------------------------- compose


def compose(first: Delta, second: Delta, layout: Layout, params: CodecParams = DEFAULT_PARAMS) -> Delta:
    """One delta equal to applying ``first`` then ``second``.

    XOR deltas compose by merging sorted positions and XOR-ing values at equal positions
    (entries that cancel drop out); any dense side makes the chunk dense, and the result is
    re-sparsified by ``params.dense_threshold``. Composing an anchor with a delta gives an
    anchor of the later version.
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
    n = layout.n_chunks
    kinds = np.zeros(n, dtype=np.uint8)
    counts = np.zeros(n, dtype=np.int64)
    hashes: list[bytes] = []
    pos_parts, val_parts, dense_parts = [], [], []
    for c in range(n):
        k1, a1, b1 = first.chunk(c, layout)
        k2, a2, b2 = second.chunk(c, layout)
        if k2 == UNCHANGED:
            kind, a, b, h = k1, a1, b1, first.target_hashes[c]
        elif k1 == UNCHANGED:
            kind, a, b, h = k2, a2, b2, second.target_hashes[c]
        else:
            h = second.target_hashes[c]
            if k1 == SPARSE and k2 == SPARSE:
                a, b = _merge_xor(a1, b1, a2, b2)
                kind = SPARSE
            else:
                words = _densify(k1, a1, b1, int(layout.lengths[c])) ^ _densify(k2, a2, b2, int(layout.lengths[c]))
                nz = np.flatnonzero(words)
                if nz.size > params.dense_threshold * words.size:
                    kind, a, b = DENSE, words, None
                else:
                    kind, a, b = SPARSE, nz, words[nz]
            if kind == SPARSE and a.size == 0:
                kind = UNCHANGED
        kinds[c] = kind
        if kind == UNCHANGED:
            hashes.append(b"")
        elif kind == SPARSE:
            counts[c] = a.size
            pos_parts.append(a)
            val_parts.append(b)
            hashes.append(h)
        else:
            dense_parts.append(a)
            hashes.append(h)
    return Delta(
        run=first.run, fingerprint=first.fingerprint, chunk_elems=first.chunk_elems,
        base_version=first.base_version, base_digest=first.base_digest,
        target_version=second.target_version, target_digest=second.target_digest,
        kinds=kinds, counts=counts, target_hashes=tuple(hashes),
        positions=_cat(pos_parts, np.int64), values=_cat(val_parts, np.uint16),
        dense=_cat(dense_parts, np.uint16),
    )


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

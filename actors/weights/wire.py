"""A delta's bytes (format version 2): :func:`serialize` writes them; :func:`read` checks
them without decompressing anything and :func:`parse` decodes them too.

The byte layout is in docs/reference/delta-format.md: a fixed header, the run id, the stream
table (stored length, raw length and hash of each of :data:`.delta.STREAMS`), the chunk
kinds, the sparse chunks' table, the changed chunks' target hashes, the stored streams
(:mod:`.streams`), and a trailer hash over every byte before it. Pure; see :mod:`.codec`.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash

from . import streams
from .delta import DENSE, SPARSE, STREAMS, UNCHANGED, Delta, PackedDelta
from .errors import DeltaFormatError, StreamError
from .params import DEFAULT_PARAMS, CodecParams

__all__ = ["MAGIC", "FORMAT_VERSION", "serialize", "read", "parse"]

MAGIC = b"FRLD"
FORMAT_VERSION = 2
_HASH = 16

_FIXED = struct.Struct("<4sHBB16sQ16sQ16sIIIIQH")
_STREAM = struct.Struct("<QQ16s")
_ITEMSIZE = (1, 1, 1, 1, 2)


def serialize(d: Delta, params: CodecParams = DEFAULT_PARAMS, *, threads: int | None = None) -> bytes:
    """Bytes of ``d`` in format version 2 (docs/reference/delta-format.md); stream parts are
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
        except StreamError as e:
            raise DeltaFormatError(str(e)) from None
    if r.at != len(r.buf):
        raise DeltaFormatError(f"{len(r.buf) - r.at} unexpected bytes before the trailer")
    return PackedDelta(run=run, fingerprint=bytes(fp), chunk_elems=chunk_elems, base_version=base_v,
                       base_digest=bytes(base_d), target_version=tgt_v, target_digest=bytes(tgt_d),
                       kinds=kinds, table=table, target_hashes=hashes,
                       raw_lengths=tuple(row[1] for row in table_rows), parts=tuple(parts))

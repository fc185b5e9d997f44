"""The stored form of a delta's streams (pure, no I/O): parts, blosc2 settings, checks.

A stored stream is a u32 part count, the u64 stored size of each part, then the parts,
each one blosc2 chunk (docs/reference/delta-format.md, "Streams"); the writer picks the part size
(:data:`PART_BYTES` by default), a reader takes any. This module cuts raw streams into
parts and compresses them, splits stored streams back into parts with every size
checked, and decompresses one part into a slice of a preallocated output. Which parts
a reader decompresses when, and on which thread, is the codec's business
(:meth:`.codec.PackedDelta.decode`: all of them, on its workers).

blosc2 holds the GIL while it (de)compresses unless told otherwise, which serialised
every "parallel" part on the codec's worker threads; importing this module turns its
GIL release on for the process (``blosc2.set_releasegil(True)``): blosc2 then works
on buffers the caller keeps alive and unresized for the call (memoryviews and numpy
arrays do), which is all it needs.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import blosc2
import numpy as np

from .errors import StreamError
from .version import parallel_map

__all__ = ["PART_BYTES", "ONE_BLOCK_FROM", "Part", "StreamError", "pack", "split", "decompress_into"]

blosc2.set_releasegil(True)

PART_BYTES = 1 << 20
"""Raw bytes per blosc2 chunk of a stream (1 MiB). Parts are (de)compressed on the
codec's worker threads with one blosc2 thread each, so the bytes do not depend on the
thread count (blosc2's own threads write blocks in completion order), and 1 MiB keeps
two threads evenly busy on a few MiB of heads at no measurable cost in size."""

ONE_BLOCK_FROM = 1 << 19
"""A byte-stream part of at least this many raw bytes is written as one blosc2 block
(one zstd frame): it decompresses about 1.8x faster than blosc2's default 32 KiB blocks
and is 0.2-0.6 points of the entropy bound smaller at 1.7-11% changed. Smaller parts
(the heads of deltas well under 1% changed) keep blosc2's blocks, which adapt to the
changing statistics of successive tensors and are 0.2 points smaller there
(bench/deltas.py, "alternatives")."""

Part = tuple[memoryview, int, int]
"""One stored part and the raw byte range ``[lo, hi)`` of its stream it decompresses to."""


def pack(arrays: Sequence[np.ndarray], cparams: Callable[[int, int], dict], part_bytes: int,
         threads: int | None) -> list[bytes]:
    """Every array in its stored form: nothing when empty, else the part table and the
    parts of at most ``part_bytes`` raw bytes (whole items). ``cparams(itemsize, raw part
    bytes)`` gives blosc2's settings for a part. All parts of all arrays are compressed
    on ``threads`` workers."""
    jobs: list[tuple[int, np.ndarray, dict]] = []
    for s, arr in enumerate(arrays):
        raw = arr.view(np.uint8)
        step = max(part_bytes - part_bytes % arr.itemsize, arr.itemsize)
        for i in range(0, raw.size, step):
            part = raw[i : i + step]
            jobs.append((s, part, cparams(arr.itemsize, part.size)))
    packed = parallel_map(lambda j: blosc2.compress2(jobs[j][1], **jobs[j][2]), range(len(jobs)), threads)
    out = []
    for s in range(len(arrays)):
        parts = [p for (js, _, _), p in zip(jobs, packed) if js == s]
        head = struct.pack(f"<I{len(parts)}Q", len(parts), *(len(p) for p in parts)) if parts else b""
        out.append(head + b"".join(parts))
    return out


def split(name: str, data: memoryview, raw_len: int) -> list[Part]:
    """The parts of one stored stream, every size checked against ``data`` and
    ``raw_len`` (the raw sizes blosc2's headers declare must tile ``[0, raw_len)``).
    Raises StreamError naming the stream and part."""
    if raw_len == 0:
        if len(data):
            raise StreamError(f"stream {name!r}: {len(data)} bytes for an empty stream")
        return []
    at = 0

    def take(n: int, what: str) -> memoryview:
        nonlocal at
        if at + n > len(data):
            raise StreamError(f"truncated delta: stream {name!r} {what} needs {n} bytes, "
                              f"{len(data) - at} left")
        out = data[at : at + n]
        at += n
        return out

    (n_parts,) = struct.unpack("<I", take(4, "part count"))
    sizes = struct.unpack(f"<{n_parts}Q", take(8 * n_parts, "part sizes"))
    out, raw_at = [], 0
    for i, sz in enumerate(sizes):
        part = take(sz, f"part {i}")
        try:
            nbytes = blosc2.get_cbuffer_sizes(part)[0]
        except Exception as e:  # blosc2 raises several types for garbage headers
            raise StreamError(f"stream {name!r} part {i}: not a blosc2 chunk ({e})") from e
        if raw_at + nbytes > raw_len:
            raise StreamError(f"stream {name!r}: parts exceed the declared {raw_len} bytes")
        out.append((part, raw_at, raw_at + nbytes))
        raw_at += nbytes
    if raw_at != raw_len or at != len(data):
        raise StreamError(f"stream {name!r}: parts hold {raw_at} bytes, header says {raw_len}")
    return out


def decompress_into(name: str, i: int, part: Part, out: np.ndarray) -> None:
    """Decompress part ``i`` of stream ``name`` into ``out[lo:hi]`` (uint8, preallocated;
    blosc2 writes straight into it, no copy). Raises StreamError if blosc2 cannot."""
    mv, lo, hi = part
    try:
        blosc2.decompress2(mv, dst=out[lo:hi], nthreads=1)
    except Exception as e:  # noqa: BLE001 - any blosc2 failure is a malformed part
        raise StreamError(f"stream {name!r} part {i}: cannot decompress ({e})") from e

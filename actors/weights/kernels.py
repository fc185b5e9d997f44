"""Compiled per-chunk kernels of the delta codec (numba, pure, no I/O).

A sparse chunk is stored as two *split varints* (docs/reference/delta-format.md): its gaps
(``position - previous position - 1``; the first gap is the first position) and its XOR
words. A split varint is the LEB128 encoding of each number with the first byte of every
number in a *head* stream (low 7 bits; bit 7 set when more bytes follow) and the other
bytes in a *tail* stream. Heads are one byte per entry, so a chunk's heads are found from
the entry counts alone; tails are rare (a gap of 128 or more, a XOR word of 128 or more).

Every kernel is ``nogil``: the codec runs them on its worker threads for disjoint chunks.
``cache=True`` keeps the compiled code in ``__pycache__``: the first call in a fresh
checkout compiles (1-5 s per kernel and argument types, once), later processes load the
cached code on first use (LLVM start-up: tens to hundreds of milliseconds).

Error codes (negative returns) are turned into DeltaFormatError messages by
:func:`error_text`; a kernel that fails has left its target exactly as it found it.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["diff_chunk", "encode_entries", "decode_entries", "xor_chunk", "error_text",
           "tail_bound"]

OK = 0
E_OUTSIDE = -1  # a position lies beyond the chunk
E_TAIL = -2  # a varint runs past its tail stream, or the tail has bytes left over
E_OVERFLOW = -3  # a gap or XOR word too large for its field
E_ZERO = -4  # a XOR word of 0 (the writer never stores one)

_MESSAGES = {
    E_OUTSIDE: "a position lies beyond the chunk",
    E_TAIL: "varint tail bytes do not match the chunk table",
    E_OVERFLOW: "a gap or XOR word overflows its field",
    E_ZERO: "a stored XOR word is 0",
}

_GAP_MAX = (1 << 31) - 1
_WORD_MAX = 0xFFFF

_jit = numba.njit(nogil=True, cache=True, boundscheck=False)


def error_text(code: int) -> str:
    return _MESSAGES.get(code, f"kernel error {code}")


def tail_bound(n: int) -> tuple[int, int]:
    """Most tail bytes (gaps, XOR words) a chunk of ``n`` elements can need.

    A gap of 128 or more skips at least 128 elements and needs at most 4 tail bytes
    (gaps are < 2**31); a XOR word needs at most 2 (16 bits = 7 + 7 + 2)."""
    return 4 * (n // 128 + 1), 2 * n


@_jit
def _put(x, head, h, tail, t):
    """Write ``x`` as a split varint: head byte at ``head[h]``, the rest from ``tail[t]``;
    the new tail cursor."""
    if x < 128:
        head[h] = x
        return t
    head[h] = (x & 0x7F) | 0x80
    x >>= 7
    while x >= 128:
        tail[t] = (x & 0x7F) | 0x80
        t += 1
        x >>= 7
    tail[t] = x
    return t + 1


@_jit
def diff_chunk(old, new, has_old, limit, gh, gt, vh, vt):
    """Diff one chunk (``old`` XOR ``new``, or ``new`` alone when ``has_old`` is False)
    straight into split-varint gaps and XOR words, in one pass.

    Returns ``(k, gap tail bytes, value tail bytes)``; ``k`` is -1 as soon as more than
    ``limit`` elements differ (the chunk goes dense). Buffers: ``gh``/``vh`` at least
    ``limit`` bytes, ``gt``/``vt`` at least :func:`tail_bound`.
    """
    k = 0
    ti = 0
    tv = 0
    prev = -1
    for i in range(new.size):
        x = new[i] ^ old[i] if has_old else new[i]
        if x != 0:
            if k == limit:
                return -1, 0, 0
            ti = _put(np.int64(i - prev - 1), gh, k, gt, ti)
            tv = _put(np.int64(x), vh, k, vt, tv)
            prev = i
            k += 1
    return k, ti, tv


@_jit
def encode_entries(positions, values, gh, gt, vh, vt):
    """Split-varint encoding of sorted, distinct ``positions`` and their non-zero
    ``values``; returns ``(gap tail bytes, value tail bytes)``."""
    ti = 0
    tv = 0
    prev = -1
    for j in range(positions.size):
        p = positions[j]
        ti = _put(np.int64(p - prev - 1), gh, j, gt, ti)
        tv = _put(np.int64(values[j]), vh, j, vt, tv)
        prev = p
    return ti, tv


@_jit
def _get(head, h, tail, t, limit):
    """Read the split varint at ``head[h]`` / ``tail[t]``: ``(value, new tail cursor)``;
    the cursor is -1 on a tail overrun, the value -1 when it exceeds ``limit``."""
    b = np.int64(head[h])
    x = b & 0x7F
    shift = 7
    while b & 0x80:
        if t >= tail.size or shift > 28:
            return np.int64(-1), np.int64(-1)
        b = np.int64(tail[t])
        t += 1
        x |= (b & 0x7F) << shift
        shift += 7
    if x > limit:
        return np.int64(-1), t
    return x, t


@_jit
def _walk(seg, gh, gt, vh, vt, n, stop, xor, pos_out, val_out):
    """Decode the first ``stop`` entries of a chunk of ``n`` elements; XOR them into
    ``seg`` when ``xor``, else store them in ``pos_out``/``val_out``.
    Returns ``(entries done, error code)``."""
    ti = 0
    tv = 0
    p = np.int64(-1)
    for j in range(stop):
        g = np.int64(gh[j])
        v = np.int64(vh[j])
        if (g | v) & 0x80:  # a tail byte follows (rare: a gap or XOR word of 128 or more)
            g, ti = _get(gh, j, gt, ti, _GAP_MAX)
            if ti < 0:
                return j, E_TAIL
            if g < 0:
                return j, E_OVERFLOW
            v, tv = _get(vh, j, vt, tv, _WORD_MAX)
            if tv < 0:
                return j, E_TAIL
            if v < 0:
                return j, E_OVERFLOW
        if v == 0:
            return j, E_ZERO
        p += g + 1
        if p >= n:
            return j, E_OUTSIDE
        if xor:
            seg[p] ^= np.uint16(v)
        else:
            pos_out[j] = p
            val_out[j] = v
    if stop == gh.size and (ti != gt.size or tv != vt.size):
        return stop, E_TAIL
    return stop, OK


@_jit
def xor_chunk(seg, gh, gt, vh, vt):
    """XOR a sparse chunk's entries into ``seg`` in place (gaps -> positions -> XOR in
    one pass). Returns 0, or an error code after XOR-ing back what it had applied (the
    chunk is then exactly as before)."""
    dummy_p = np.empty(0, np.int64)
    dummy_v = np.empty(0, np.uint16)
    done, err = _walk(seg, gh, gt, vh, vt, seg.size, gh.size, True, dummy_p, dummy_v)
    if err != OK:
        _walk(seg, gh, gt, vh, vt, seg.size, done, True, dummy_p, dummy_v)  # undo
    return err


@_jit
def decode_entries(gh, gt, vh, vt, n, pos_out, val_out):
    """Positions (chunk-relative, in a chunk of ``n`` elements) and XOR words of a sparse
    chunk into ``pos_out``/``val_out`` (``gh.size`` entries each). Returns 0 or an
    error code."""
    dummy = np.empty(0, np.uint16)
    return _walk(dummy, gh, gt, vh, vt, n, gh.size, False, pos_out, val_out)[1]

"""The compiled varint kernels against a plain-Python oracle of docs/reference/delta-format.md."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.weights import kernels


def leb128(x: int) -> list[int]:
    out = []
    while True:
        b, x = x & 0x7F, x >> 7
        out.append(b | (0x80 if x else 0))
        if not x:
            return out


def split_varints(numbers) -> tuple[bytes, bytes]:
    """The oracle: first LEB128 byte of each number to the heads, the rest to the tails."""
    head, tail = bytearray(), bytearray()
    for x in numbers:
        first, *rest = leb128(int(x))
        head.append(first)
        tail.extend(rest)
    return bytes(head), bytes(tail)


def oracle_diff(old, new):
    pos = [i for i in range(len(new)) if old[i] != new[i]]
    gaps = [p - q - 1 for p, q in zip(pos, [-1, *pos[:-1]])]
    return pos, split_varints(gaps), split_varints([int(old[p] ^ new[p]) for p in pos])


def encoded(positions, values):
    k = len(positions)
    gh, vh = np.empty(k, np.uint8), np.empty(k, np.uint8)
    g_tail, v_tail = kernels.tail_bound(int(positions[-1]) + 1 if k else 0)
    gt, vt = np.empty(g_tail, np.uint8), np.empty(max(v_tail, 2 * k), np.uint8)
    nt_g, nt_v = kernels.encode_entries(np.asarray(positions, np.int64), np.asarray(values, np.uint16),
                                        gh, gt, vh, vt)
    return gh, gt[:nt_g].copy(), vh, vt[:nt_v].copy()


def test_the_documented_example():
    """docs/reference/delta-format.md: positions 0, 5, 300 with XOR words 0x0001, 0x0080, 0xFFFF."""
    gh, gt, vh, vt = encoded([0, 5, 300], [0x0001, 0x0080, 0xFFFF])
    assert gh.tobytes() == bytes([0x00, 0x04, 0xA6]) and gt.tobytes() == bytes([0x02])
    assert vh.tobytes() == bytes([0x01, 0x80, 0xFF]) and vt.tobytes() == bytes([0x01, 0xFF, 0x03])


chunks = st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 3000),
                   st.sampled_from([0.0, 0.002, 0.05, 0.3, 1.0]), st.sampled_from(["small", "any"]))


@settings(max_examples=80, deadline=None)
@given(chunks, st.floats(0.0, 1.0), st.booleans())
def test_diff_chunk_matches_the_oracle_and_goes_dense_past_the_limit(case, threshold, has_old):
    seed, n, density, words = case
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 1 << 16, n, dtype=np.uint16) if has_old else np.zeros(n, np.uint16)
    new = old.copy()
    m = rng.random(n) < density
    flips = rng.integers(1, 4 if words == "small" else 1 << 16, int(m.sum()), dtype=np.uint16)
    new[m] ^= flips
    limit = int(threshold * n)
    gh, vh = np.empty(n, np.uint8), np.empty(n, np.uint8)
    g_tail, v_tail = kernels.tail_bound(n)
    gt, vt = np.empty(g_tail, np.uint8), np.empty(v_tail, np.uint8)
    k, nt_g, nt_v = kernels.diff_chunk(old if has_old else new, new, has_old, limit, gh, gt, vh, vt)
    pos, (ogh, ogt), (ovh, ovt) = oracle_diff(old, new)
    if len(pos) > limit:
        assert k == -1
        return
    assert k == len(pos)
    assert gh[:k].tobytes() == ogh and gt[:nt_g].tobytes() == ogt
    assert vh[:k].tobytes() == ovh and vt[:nt_v].tobytes() == ovt
    # and the XOR kernel takes old to new, the decoder gives the positions back
    seg = old.copy()
    assert kernels.xor_chunk(seg, gh[:k], gt[:nt_g], vh[:k], vt[:nt_v]) == 0
    assert seg.tobytes() == new.tobytes()
    p, v = np.empty(k, np.int64), np.empty(k, np.uint16)
    assert kernels.decode_entries(gh[:k], gt[:nt_g], vh[:k], vt[:nt_v], n, p, v) == 0
    assert p.tolist() == pos and v.tolist() == [int(old[i] ^ new[i]) for i in pos]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2**31 - 1), st.integers(1, 0xFFFF)), min_size=1, max_size=40))
def test_encode_entries_matches_the_oracle_over_the_whole_range(entries):
    entries = sorted(dict(entries).items())
    pos, val = [p for p, _ in entries], [v for _, v in entries]
    gh, gt, vh, vt = encoded(pos, val)
    gaps = [p - q - 1 for p, q in zip(pos, [-1, *pos[:-1]])]
    assert (gh.tobytes(), gt.tobytes()) == split_varints(gaps)
    assert (vh.tobytes(), vt.tobytes()) == split_varints(val)
    p, v = np.empty(len(pos), np.int64), np.empty(len(pos), np.uint16)
    assert kernels.decode_entries(gh, gt, vh, vt, 2**31, p, v) == 0
    assert p.tolist() == pos and v.tolist() == val


def bad_cases():
    gh, gt, vh, vt = encoded([1, 3, 200], [5, 0x1234, 7])  # gap 196 and 0x1234 have tails
    b = lambda *xs: np.array(xs, np.uint8)  # noqa: E731
    yield "outside", (gh, gt, vh, vt), 100, kernels.E_OUTSIDE  # 200 is beyond 100 elements
    yield "tail left over", (gh, np.append(gt, 1).astype(np.uint8), vh, vt), 256, kernels.E_TAIL
    yield "tail overrun", (gh, gt, vh, vt[:-1]), 256, kernels.E_TAIL
    yield "zero word", (gh, gt, b(5, 0x80, 0), b(0x24, 0x01)), 256, kernels.E_ZERO
    yield "word overflow", (gh, gt, b(5, 0xFF, 7), b(0xFF, 0x04)), 256, kernels.E_OVERFLOW
    yield "overlong gap", (b(1, 0x81, 0x80), b(0x80, 0x80, 0x80, 0x80, 0x01), vh, vt), 256, kernels.E_TAIL


@pytest.mark.parametrize("name,streams,n,code", list(bad_cases()), ids=[c[0] for c in bad_cases()])
def test_malformed_entries_are_refused_and_the_chunk_left_as_it_was(name, streams, n, code):
    rng = np.random.default_rng(0)
    seg = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    before = seg.copy()
    assert kernels.xor_chunk(seg, *streams) == code
    assert seg.tobytes() == before.tobytes()  # entries applied before the bad one were undone
    k = streams[0].size
    assert kernels.decode_entries(*streams, n, np.empty(k, np.int64), np.empty(k, np.uint16)) == code
    assert "kernel error" not in kernels.error_text(code)  # every code has its message

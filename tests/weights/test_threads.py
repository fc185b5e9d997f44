"""Threaded diff, gap coding, scatter-XOR and hashing: the bytes, the weights and the undo
do not depend on the thread count; the linear merge used by compose matches a reference."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.actors.weights import codec, streams
from fleetrl.actors.weights.composer import _merge_xor
from fleetrl.actors.weights.version import (
    Layout,
    TensorSpec,
    chunk_hashes,
    digest_of,
    parallel_map,
    resolve_threads,
)

SPECS = [TensorSpec("emb", (61, 13)), TensorSpec("norm", (29,)), TensorSpec("empty", (0, 3)),
         TensorSpec("w", (9, 7, 5))]


def model(rng, specs=SPECS):
    """Random bf16 bit patterns, one array per spec (test_streams uses it too)."""
    return [rng.integers(0, 1 << 16, s.numel, dtype=np.uint16) for s in specs]


def mutated(rng, arrays, density):
    out = []
    for a in arrays:
        b = a.copy()
        m = rng.random(a.size) < density
        b[m] ^= rng.integers(1, 1 << 16, int(m.sum()), dtype=np.uint16)
        out.append(b)
    return out


def encode(layout, old, new, threads, params=codec.DEFAULT_PARAMS):
    return codec.encode(layout, old, new, run="r", base_version=0,
                        base_digest=digest_of(chunk_hashes(layout, old)), target_version=1,
                        params=params, threads=threads)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 7, 64, 1 << 20]),
       st.sampled_from([0.0, 0.01, 0.2, 0.6]), st.sampled_from([0.0, 0.25, 1.0]))
def test_thread_count_changes_neither_bytes_nor_result(seed, chunk, density, threshold):
    rng = np.random.default_rng(seed)
    layout = Layout(SPECS, chunk)
    old = model(rng)
    new = mutated(rng, old, density)
    params = codec.CodecParams(dense_threshold=threshold)
    blobs = {t: encode(layout, old, new, t, params) for t in (1, 2, 3)}
    assert blobs[1] == blobs[2] == blobs[3]
    assert chunk_hashes(layout, new, threads=1) == chunk_hashes(layout, new, threads=3)
    base = digest_of(chunk_hashes(layout, old))
    results = {}
    for t in (1, 2, 4):
        d = codec.parse(blobs[1], threads=t)
        w = [a.copy() for a in old]
        ranges = codec.apply(w, d, layout, current_version=0, current_digest=base, threads=t)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(w, new))
        results[t] = [(r.tensor, r.start, r.stop, None if r.positions is None else r.positions.tolist())
                      for r in ranges]
    assert results[1] == results[2] == results[4]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_threaded_apply_undoes_every_chunk_when_several_fail(threads):
    rng = np.random.default_rng(11)
    layout = Layout(SPECS, 16)
    old = model(rng)
    new = mutated(rng, old, 0.3)
    blob = encode(layout, old, new, threads)
    d = codec.parse(blob)
    changed = np.flatnonzero(d.kinds != codec.UNCHANGED)
    assert changed.size > 10
    w = [a.copy() for a in old]
    for c in (changed[3], changed[len(changed) // 2], changed[-1]):  # silent corruption
        w[int(layout.tensor_of[c])][int(layout.starts[c])] ^= 0x4
    before = [a.copy() for a in w]
    with pytest.raises(codec.DeltaVerifyError, match=f"chunk {changed[3]}\\).*undone"):
        codec.apply(w, d, layout, current_version=0,
                    current_digest=digest_of(chunk_hashes(layout, old)), threads=threads)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w, before))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_chunk_that_cannot_be_applied_is_reported_and_the_rest_undone(threads):
    """A hand-built Delta (no trailer to catch it) whose second gap in one chunk jumps past
    the chunk's end: the kernel has already XOR-ed that chunk's first entry and must undo
    it; the error names the chunk, and every other chunk is undone too."""
    rng = np.random.default_rng(2)
    layout = Layout(SPECS, 16)
    old = model(rng)
    new = mutated(rng, old, 0.1)
    d = codec.parse(encode(layout, old, new, 1))
    c = int(np.flatnonzero(d.counts >= 3)[1])
    lo = int(d.offsets[c, 0])
    gap_head = d.gap_head.copy()
    gap_head[lo + 1] = 100  # a gap of 100 in a chunk of 16 elements
    bad = dataclasses.replace(d, gap_head=gap_head)
    assert int(np.flatnonzero(d.kinds != codec.UNCHANGED)[-1]) > c  # chunks after it too
    w = [a.copy() for a in old]
    with pytest.raises(codec.DeltaFormatError, match=f"chunk {c}\\): cannot apply \\(a position lies beyond"):
        codec.apply(w, bad, layout, current_version=0,
                    current_digest=digest_of(chunk_hashes(layout, old)), threads=threads)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w, old))


sorted_sparse = st.lists(st.tuples(st.integers(0, 200), st.integers(0, 3)), max_size=60).map(
    lambda xs: sorted({p: v for p, v in xs}.items()))


@settings(max_examples=100, deadline=None)
@given(sorted_sparse, sorted_sparse)
def test_merge_xor_matches_a_dictionary_reference(a, b):
    ref: dict[int, int] = {}
    for p, v in a + b:
        ref[p] = ref.get(p, 0) ^ v
    ref = {p: v for p, v in ref.items() if v}
    pos, val = _merge_xor(
        np.array([p for p, _ in a], dtype=np.int64), np.array([v for _, v in a], dtype=np.uint16),
        np.array([p for p, _ in b], dtype=np.int64), np.array([v for _, v in b], dtype=np.uint16))
    assert pos.tolist() == sorted(ref)
    assert val.tolist() == [ref[p] for p in sorted(ref)]


def test_parallel_map_keeps_order_and_rejects_bad_thread_counts():
    assert parallel_map(lambda i: i * i, list(range(50)), 3) == [i * i for i in range(50)]
    assert parallel_map(lambda i: -i, range(1000), 2) == [-i for i in range(1000)]  # batched
    assert parallel_map(lambda i: i, [], 2) == []
    assert resolve_threads(None) >= 1
    with pytest.raises(ValueError, match="threads must be >= 1"):
        parallel_map(lambda i: i, [1, 2], 0)


def test_multi_part_streams_serialize_to_the_same_bytes_on_any_thread_count():
    """Streams of several parts over many blosc2 blocks: blosc2's own threads would order
    blocks by completion; the writer's bytes must not depend on threads, and the reader
    must stitch the parts of every stream back in order."""
    rng = np.random.default_rng(4)
    specs = [TensorSpec("big", (3 << 20,))]
    layout = Layout(specs, 1 << 18)
    old = [rng.integers(0, 1 << 16, 3 << 20, dtype=np.uint16)]
    new = mutated(rng, old, 0.8)
    params = codec.CodecParams(dense_threshold=1.0)  # all sparse: 2.5 M entries
    blobs = [encode(layout, old, new, t, params) for t in (1, 2, 2, 3)]
    assert all(b == blobs[0] for b in blobs)
    d = codec.parse(blobs[0])
    assert d.n_entries > 2 * streams.PART_BYTES and d.value_tail.size > streams.PART_BYTES  # 3+ parts each
    w = [old[0].copy()]
    codec.apply(w, blobs[0], layout, current_version=0,
                current_digest=digest_of(chunk_hashes(layout, old)), threads=2)
    assert w[0].tobytes() == new[0].tobytes()

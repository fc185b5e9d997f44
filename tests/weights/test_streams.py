"""Stored streams: any part layout and block size a writer chooses reads back and
applies bit-exactly on any thread count; the default writer's byte-stream settings; a
part that cannot be decompressed is refused with the weights untouched."""

import struct

import blosc2
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.actors.weights import codec, streams, wire
from fleetrl.actors.weights.version import Layout, TensorSpec, chunk_hashes, digest_of

from .test_threads import SPECS, model, mutated

def encode(layout, old, new, params):
    return codec.encode(layout, old, new, run="r", base_version=0,
                        base_digest=digest_of(chunk_hashes(layout, old)), target_version=1, params=params)


def summary(ranges):
    return [(r.tensor, r.start, r.stop, None if r.positions is None else r.positions.tolist()) for r in ranges]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 7, 64, 1 << 20]), st.sampled_from([0.01, 0.2, 0.6]),
       st.sampled_from([0.0, 0.25, 1.0]), st.sampled_from([2, 3, 7, 64, 1 << 20]),
       st.sampled_from([-1, 0, 64]), st.sampled_from([1, 2, 3]))
def test_any_part_layout_applies_exactly_on_any_thread_count(seed, chunk, density, threshold, part_bytes,
                                                              blocksize, threads):
    """Parts that split chunks anywhere (2-byte parts: every chunk spans many) give the
    same weights and the same changed ranges from bytes, from read() and from parse()."""
    rng = np.random.default_rng(seed)
    layout = Layout(SPECS, chunk)
    old = model(rng)
    new = mutated(rng, old, density)
    params = codec.CodecParams(dense_threshold=threshold, part_bytes=part_bytes, blocksize=blocksize)
    blob = encode(layout, old, new, params)
    base = digest_of(chunk_hashes(layout, old))
    packed = codec.read(blob)
    assert all(len(ps) == (0 if n == 0 else -(-n // (part_bytes - part_bytes % size)))
               for ps, n, size in zip(packed.parts, packed.raw_lengths, (1, 1, 1, 1, 2)))
    w = [a.copy() for a in old]
    ranges = codec.apply(w, packed, layout, current_version=0, current_digest=base, threads=threads)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w, new))
    w2 = [a.copy() for a in old]
    decoded = codec.apply(w2, codec.parse(blob), layout, current_version=0, current_digest=base, threads=1)
    assert summary(ranges) == summary(decoded)
    w3 = [a.copy() for a in old]
    from_bytes = codec.apply(w3, blob, layout, current_version=0, current_digest=base, threads=threads)
    assert summary(from_bytes) == summary(decoded) and all(a.tobytes() == b.tobytes() for a, b in zip(w3, new))


def _stored_streams(blob: bytes) -> tuple[int, list[int]]:
    """Offset of the stream table and of each stored stream in ``blob``."""
    d = codec.read(blob)
    run_len = len(d.run.encode())
    table = wire._FIXED.size + run_len
    lens = [struct.unpack_from("<Q", blob, table + 32 * s)[0] for s in range(len(codec.STREAMS))]
    at = (table + 32 * len(codec.STREAMS) + d.n_chunks + 12 * int((d.kinds == codec.SPARSE).sum())
          + 16 * int((d.kinds != codec.UNCHANGED).sum()))
    starts = []
    for n in lens:
        starts.append(at)
        at += n
    assert at == len(blob) - 16
    return table, starts


def _with_bad_part(blob: bytes, s: int, i: int) -> bytes:
    """``blob`` with part ``i`` of stream ``s`` made undecompressable: its blosc2 header
    (sizes) intact, its compressed body overwritten; stream hash and trailer re-made, so
    only decompression can notice."""
    packed = codec.read(blob)
    table, starts = _stored_streams(blob)
    n_parts = len(packed.parts[s])
    bad = bytearray(blob)
    at = starts[s] + 4 + 8 * n_parts
    for k in range(i):
        at += len(packed.parts[s][k][0])
    size = len(packed.parts[s][i][0])
    bad[at + 40 : at + size] = b"\xff" * (size - 40)  # past the header, block start and stream size
    stored_len = struct.unpack_from("<Q", blob, table + 32 * s)[0]
    bad[table + 32 * s + 16 : table + 32 * s + 32] = xxhash.xxh3_128_digest(
        bytes(bad[starts[s] : starts[s] + stored_len]))
    bad[-16:] = xxhash.xxh3_128_digest(bytes(bad[:-16]))
    return bytes(bad)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_part_that_cannot_be_decompressed_is_refused_with_the_weights_untouched(threads):
    rng = np.random.default_rng(8)
    specs = [TensorSpec("big", (1 << 16,))]
    layout = Layout(specs, 1 << 10)
    old = model(rng, specs)
    new = mutated(rng, old, 0.1)
    params = codec.CodecParams(part_bytes=1 << 11)  # about 100 entries per chunk: 20 chunks per part
    blob = encode(layout, old, new, params)
    packed = codec.read(blob)
    last = len(packed.parts[0]) - 1
    assert last >= 2
    bad = _with_bad_part(blob, 0, last)  # the gap heads of the last chunks
    codec.read(bad)  # every check before decompression passes
    w = [old[0].copy()]
    with pytest.raises(codec.DeltaFormatError, match=f"stream 'gap_head' part {last}: cannot decompress"):
        codec.apply(w, bad, layout, current_version=0, current_digest=digest_of(chunk_hashes(layout, old)),
                    threads=threads)
    assert w[0].tobytes() == old[0].tobytes()
    with pytest.raises(codec.DeltaFormatError, match=f"stream 'gap_head' part {last}: cannot decompress"):
        codec.parse(bad, threads=threads)


def test_byte_streams_skip_the_shuffle_and_large_parts_are_one_block():
    """Shuffling 1-byte items is the identity (blosc2 would still copy every block), so
    the default writes the byte streams as filter "none" does; a byte-stream part of
    ONE_BLOCK_FROM raw bytes or more is a single blosc2 block."""
    rng = np.random.default_rng(3)
    specs = [TensorSpec("big", (1 << 22,))]
    layout = Layout(specs, 1 << 20)
    old = model(rng, specs)
    new = mutated(rng, old, 0.2)  # sparse everywhere, ~840 k entries: 1 MiB heads
    blob = encode(layout, old, new, codec.DEFAULT_PARAMS)
    assert blob == encode(layout, old, new, codec.CodecParams(filter="none"))
    packed = codec.read(blob)
    sizes = [blosc2.get_cbuffer_sizes(mv) for mv, _, _ in packed.parts[0]]
    assert any(n >= streams.ONE_BLOCK_FROM for n, _, _ in sizes)
    for nbytes, _, block in sizes:
        assert block == nbytes if nbytes >= streams.ONE_BLOCK_FROM else block < nbytes
    auto = codec.read(encode(layout, old, new, codec.CodecParams(blocksize=-1)))
    assert all(blosc2.get_cbuffer_sizes(mv)[2] < hi - lo for mv, lo, hi in auto.parts[0])


def test_codec_params_refuse_bad_block_and_part_sizes():
    with pytest.raises(ValueError, match="blocksize must be"):
        codec.CodecParams(blocksize=-2)
    with pytest.raises(ValueError, match="part_bytes must be in"):
        codec.CodecParams(part_bytes=1)


def test_blosc2_releases_the_gil_once_the_codec_is_imported():
    """Without it every blosc2 call holds the GIL and the 'parallel' parts run one at a time."""
    assert blosc2.set_releasegil(True) is True

"""The delta codec: exact round trips, empty deltas, composition, corruption, undo."""

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetrl.actors.weights import codec, wire
from fleetrl.actors.weights.version import (
    NO_VERSION,
    Layout,
    TensorSpec,
    chunk_hashes,
    digest_of,
)

SPECS = [TensorSpec("emb", (37, 11)), TensorSpec("norm", (29,)), TensorSpec("empty", (0, 3)),
         TensorSpec("w", (5, 7, 3))]


def digest(layout, arrays):
    return digest_of(chunk_hashes(layout, arrays))


def random_model(rng, specs):
    """Random finite bf16 bit patterns."""
    out = []
    for s in specs:
        t = torch.randn(s.numel, generator=torch.Generator().manual_seed(int(rng.integers(1 << 31))))
        out.append(t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy())
    return out


def mutate(rng, arrays, density, mode):
    """A random change pattern: one-ulp steps, random XOR bits, or fresh values."""
    out = []
    for a in arrays:
        b = a.copy()
        mask = rng.random(a.size) < density
        k = int(mask.sum())
        if mode == "ulp":
            step = rng.choice(np.array([1, -1], dtype=np.int32), k)
            b[mask] = (b[mask].astype(np.int32) + step).astype(np.uint16)
        elif mode == "xor":
            b[mask] ^= rng.integers(1, 1 << 16, k, dtype=np.uint16)
        else:
            b[mask] = rng.integers(0, 1 << 16, k, dtype=np.uint16)
        out.append(b)
    return out


case = st.fixed_dictionaries(
    {
        "seed": st.integers(0, 2**32 - 1),
        "chunk": st.sampled_from([1, 3, 16, 64, 1 << 20]),
        "density": st.sampled_from([0.0, 0.001, 0.02, 0.2, 0.5, 1.0]),
        "mode": st.sampled_from(["ulp", "xor", "fresh"]),
        "threshold": st.sampled_from([0.0, 0.25, 1.0]),
    }
)


def enc(layout, old, new, v0=0, v1=1, params=codec.DEFAULT_PARAMS, run="run-1"):
    return codec.encode(layout, old, new, run=run, base_version=v0,
                        base_digest=digest(layout, old), target_version=v1, params=params)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case)
def test_apply_encode_is_bit_identical(c):
    rng = np.random.default_rng(c["seed"])
    layout = Layout(SPECS, c["chunk"])
    old = random_model(rng, SPECS)
    new = mutate(rng, old, c["density"], c["mode"])
    params = codec.CodecParams(dense_threshold=c["threshold"])
    blob = enc(layout, old, new, params=params)
    w = [a.copy() for a in old]
    changed = codec.apply(w, blob, layout, current_version=0, current_digest=digest(layout, old))
    for a, b in zip(w, new):
        assert a.tobytes() == b.tobytes()
    d = codec.parse(blob)
    assert d.target_digest == digest(layout, new)
    # the reported ranges cover exactly the changed elements
    touched = [np.zeros(a.size, bool) for a in old]
    for r in changed:
        if r.positions is None:
            touched[r.tensor][r.start : r.stop] = True
        else:
            touched[r.tensor][r.start + r.positions] = True
    for a, b, t in zip(old, new, touched):
        assert not ((a != b) & ~t).any()


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([1, 5, 64, 1 << 20]))
def test_unchanged_model_gives_an_empty_delta(seed, chunk):
    rng = np.random.default_rng(seed)
    layout = Layout(SPECS, chunk)
    old = random_model(rng, SPECS)
    blob = enc(layout, old, [a.copy() for a in old])
    d = codec.parse(blob)
    assert d.is_empty and d.n_entries == 0 and d.dense.size == 0
    # header + run + stream table + one byte per chunk + trailer; no stream bytes
    assert len(blob) == (wire._FIXED.size + len("run-1") + len(codec.STREAMS) * wire._STREAM.size
                         + layout.n_chunks + 16)
    w = [a.copy() for a in old]
    assert codec.apply(w, blob, layout, current_version=0, current_digest=digest(layout, old)) == []


def test_unchanged_tensor_costs_one_byte_per_chunk():
    rng = np.random.default_rng(7)
    layout = Layout(SPECS, 8)
    old = random_model(rng, SPECS)
    new = [a.copy() for a in old]
    new[0][3] ^= 1  # only "emb" changes
    d = codec.parse(enc(layout, old, new))
    norm = slice(layout.first_chunk[1], layout.first_chunk[2])
    assert (d.kinds[norm] == codec.UNCHANGED).all()
    assert int((d.kinds != codec.UNCHANGED).sum()) == 1 and d.entries(0)[0].tolist() == [3]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case, st.integers(2, 5))
def test_chains_and_combined_deltas_agree(c, n):
    rng = np.random.default_rng(c["seed"])
    layout = Layout(SPECS, c["chunk"])
    params = codec.CodecParams(dense_threshold=c["threshold"])
    versions = [random_model(rng, SPECS)]
    for _ in range(n):
        versions.append(mutate(rng, versions[-1], c["density"], c["mode"]))
    deltas = [codec.parse(enc(layout, versions[i], versions[i + 1], i, i + 1, params))
              for i in range(n)]
    combined = deltas[0]
    for d in deltas[1:]:
        combined = codec.compose(combined, d, layout, params)
    assert (combined.base_version, combined.target_version) == (0, n)
    # the serialized combined delta round-trips and takes v0 straight to vN
    blob = codec.serialize(combined, params)
    w = [a.copy() for a in versions[0]]
    codec.apply(w, blob, layout, current_version=0, current_digest=digest(layout, versions[0]))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w, versions[-1]))
    # the chain of single steps reaches the same bytes and digest
    w2 = [a.copy() for a in versions[0]]
    for i, d in enumerate(deltas):
        codec.apply(w2, d, layout, current_version=i, current_digest=d.base_digest)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w2, w))
    assert digest(layout, w2) == combined.target_digest
    # composing in the other grouping gives the same combined delta
    if n >= 3:
        right = codec.compose(deltas[1], deltas[2], layout, params)
        left = codec.compose(deltas[0], right, layout, params)
        for d in deltas[3:]:
            left = codec.compose(left, d, layout, params)
        assert codec.serialize(left, params) == blob


def test_changes_that_cancel_drop_out_of_a_combined_delta():
    rng = np.random.default_rng(3)
    layout = Layout(SPECS, 16)
    v0 = random_model(rng, SPECS)
    v1 = mutate(rng, v0, 0.1, "xor")
    d01 = codec.parse(enc(layout, v0, v1, 0, 1))
    d12 = codec.parse(enc(layout, v1, [a.copy() for a in v0], 1, 2))
    both = codec.compose(d01, d12, layout)
    assert both.is_empty and both.target_digest == digest(layout, v0)


def test_anchor_is_a_delta_from_zero_and_composes_to_a_later_anchor():
    rng = np.random.default_rng(4)
    layout = Layout(SPECS, 16)
    v0 = random_model(rng, SPECS)
    v0[0][:20] = 0  # an all-zero chunk stays UNCHANGED even in an anchor
    v1 = mutate(rng, v0, 0.05, "ulp")
    anchor = codec.parse(codec.encode_anchor(layout, v0, run="run-1", version=0))
    assert anchor.is_anchor and anchor.base_digest == layout.zero_digest()
    assert anchor.kinds[0] == codec.UNCHANGED
    later = codec.compose(anchor, codec.parse(enc(layout, v0, v1)), layout)
    assert later.is_anchor and later.target_version == 1
    w = [np.zeros_like(a) for a in v0]
    codec.apply(w, codec.serialize(later), layout, current_version=NO_VERSION,
                current_digest=layout.zero_digest())
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w, v1))


@pytest.fixture(scope="module")
def corruptible():
    rng = np.random.default_rng(5)
    layout = Layout(SPECS, 16)
    old = random_model(rng, SPECS)
    new = mutate(rng, old, 0.05, "ulp")
    new[3][:] = mutate(rng, [new[3]], 0.9, "fresh")[0]  # a dense chunk too
    blob = enc(layout, old, new)
    d = codec.parse(blob)
    assert (d.kinds == codec.SPARSE).any() and (d.kinds == codec.DENSE).any()
    return layout, old, blob


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_flipped_byte_anywhere_is_detected_and_weights_stay_unchanged(corruptible, data):
    layout, old, blob = corruptible
    i = data.draw(st.integers(0, len(blob) - 1), label="offset")
    bit = data.draw(st.integers(0, 7), label="bit")
    bad = bytearray(blob)
    bad[i] ^= 1 << bit
    w = [a.copy() for a in old]
    with pytest.raises(codec.DeltaFormatError):
        codec.apply(w, bytes(bad), layout, current_version=0, current_digest=digest(layout, old))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w, old))


def test_truncated_and_foreign_bytes_are_rejected_clearly(corruptible):
    layout, old, blob = corruptible
    with pytest.raises(codec.DeltaFormatError, match="truncated"):
        codec.parse(blob[:20])
    with pytest.raises(codec.DeltaFormatError, match="trailer"):
        codec.parse(blob[:-1])
    with pytest.raises(codec.DeltaFormatError, match="magic"):
        codec.parse(b"PK\x03\x04" + blob[4:])
    for version, why in ((1, "format version 1 .*older publisher"), (3, "format version 3")):
        other = bytearray(blob)
        other[4:6] = version.to_bytes(2, "little")
        other[-16:] = xxhash.xxh3_128_digest(bytes(other[:-16]))  # intact but for the version
        with pytest.raises(codec.DeltaFormatError, match=why):
            codec.parse(bytes(other))
        w = [a.copy() for a in old]
        with pytest.raises(codec.DeltaFormatError, match="unsupported delta format"):
            codec.apply(w, bytes(other), layout, current_version=0, current_digest=digest(layout, old))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(w, old))


def test_wrong_base_weights_are_detected_and_every_touched_chunk_is_undone(corruptible):
    """Weights that claim the base digest but differ in a late chunk: the early chunks are
    applied, the bad one fails its target hash, and everything is XORed back."""
    layout, old, blob = corruptible
    d = codec.parse(blob)
    last = int(np.flatnonzero(d.kinds != codec.UNCHANGED)[-1])
    w = [a.copy() for a in old]
    t, lo = int(layout.tensor_of[last]), int(layout.starts[last])
    w[t][lo] ^= 0x10  # silent corruption inside a chunk the delta touches
    before = [a.copy() for a in w]
    with pytest.raises(codec.DeltaVerifyError, match="undone"):
        codec.apply(w, d, layout, current_version=0, current_digest=digest(layout, old))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w, before))


def test_out_of_order_and_foreign_deltas_are_refused(corruptible):
    layout, old, blob = corruptible
    w = [a.copy() for a in old]
    dg = digest(layout, old)
    with pytest.raises(codec.DeltaMismatchError, match="version 0"):
        codec.apply(w, blob, layout, current_version=1, current_digest=dg)
    with pytest.raises(codec.DeltaMismatchError, match="digest"):
        codec.apply(w, blob, layout, current_version=0, current_digest=b"\0" * 16)
    with pytest.raises(codec.DeltaMismatchError, match="fingerprint"):
        codec.apply(w, blob, Layout([TensorSpec("x", (10,))], 16), current_version=0, current_digest=dg)
    with pytest.raises(codec.DeltaMismatchError, match="chunking"):
        codec.apply(w, blob, Layout(SPECS, 32), current_version=0, current_digest=dg)
    with pytest.raises(codec.DeltaMismatchError, match="run"):
        codec.apply(w, blob, layout, current_version=0, current_digest=dg, run="other")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(w, old))


def test_bf16_arithmetic_deltas_are_lossy_so_the_format_has_none():
    """Why deltas are XOR of bit patterns: shipping new - old as bf16 and adding it back
    in bf16 does not reproduce new. Two rounding steps (the difference, then the sum)
    lose bits whenever the exponents differ; here a large fraction of elements comes back
    wrong, while the XOR delta is exact."""
    g = torch.Generator().manual_seed(0)
    old = (torch.randn(100_000, generator=g) * 0.02).to(torch.bfloat16)
    master = old.float() + torch.randn(100_000, generator=g) * 1e-3  # an optimizer step
    new = master.to(torch.bfloat16)
    arith = (new.float() - old.float()).to(torch.bfloat16)  # a "bf16 delta"
    rebuilt = (old + arith)  # applied in bf16
    wrong = (rebuilt.view(torch.int16) != new.view(torch.int16)).float().mean().item()
    assert wrong > 0.01, wrong
    # even a tiny example: exact difference not representable in bf16
    a, b = torch.tensor(1.0, dtype=torch.bfloat16), torch.tensor(-0.0039215, dtype=torch.bfloat16)
    assert (a + (b.float() - a.float()).to(torch.bfloat16)).item() != b.item()
    # the XOR codec reproduces every bit
    layout = Layout([TensorSpec("w", (100_000,))], 4096)
    o = [old.view(torch.int16).numpy().view(np.uint16).copy()]
    n = [new.view(torch.int16).numpy().view(np.uint16).copy()]
    codec.apply(o, enc(layout, o, n), layout, current_version=0, current_digest=digest(layout, o))
    assert o[0].tobytes() == n[0].tobytes()
    # and the reader knows no arithmetic mode: any flag bit is refused
    blob = bytearray(enc(layout, o, n))
    blob[6] = 1
    blob[-16:] = xxhash.xxh3_128_digest(bytes(blob[:-16]))
    with pytest.raises(codec.DeltaFormatError, match="flags"):
        codec.parse(bytes(blob))


def test_codec_params_refuse_a_dense_threshold_outside_0_1():
    with pytest.raises(ValueError, match="dense_threshold must be in"):
        codec.CodecParams(dense_threshold=1.5)
    with pytest.raises(ValueError, match="dense_threshold must be in"):
        codec.CodecParams(dense_threshold=-0.1)


def test_changed_ranges_decode_positions_only_when_read(corruptible):
    """apply never materialises positions; a range decodes its chunk's on first read."""
    layout, old, blob = corruptible
    d = codec.parse(blob)
    w = [a.copy() for a in old]
    ranges = codec.apply(w, d, layout, current_version=0, current_digest=digest(layout, old))
    sparse = [r for r in ranges if r._delta is not None]
    assert sparse and all(r._positions is None for r in sparse)
    for r in sparse:
        c = int(np.searchsorted(layout.starts[layout.tensor_of == r.tensor], r.start)) + int(
            layout.first_chunk[r.tensor])
        assert r.positions.tolist() == d.entries(c)[0].tolist()
        assert (w[r.tensor][r.start + r.positions] != old[r.tensor][r.start + r.positions]).all()
    assert any(r.positions is None for r in ranges)  # the dense chunk: the whole range

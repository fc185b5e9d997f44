"""A remote sampler follows the daemon's delta store through an S3 mirror (moto's S3
server on 127.0.0.1 standing in for S3/R2/GCS): versions the mirror holds come from it
(the origin serves no blob), a version announced before the mirror has it comes from the
origin; the backend holds each published digest exactly."""

from __future__ import annotations

import collections

import torch
import trio
from s3server import S3_ENV, moto_s3

from fleetrl.actors.model.tiny_llama import read_state_dict
from fleetrl.actors.pool import SamplerPool
from fleetrl.actors.pool.remote_client import RemoteClientConfig, run_remote
from fleetrl.actors.pool.remote_server import fleet_app
from fleetrl.actors.samplers import TorchBackend, TorchBackendConfig
from fleetrl.actors.weights import LocalDirStore, Publisher, PublisherConfig
from fleetrl.actors.weights.http import blob_app
from fleetrl.actors.weights.mirror import mirror_current
from fleetrl.actors.weights.s3 import S3Store
from fleetrl.daemon import messages as m
from fleetrl.daemon.control import MountTable, build_app, serve_control

from .test_remote import TOKEN, _Plane


class _Counting:
    def __init__(self, app):
        self.app, self.blobs = app, collections.Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and "/blobs/" in scope["path"]:
            self.blobs[scope["path"]] += 1
        await self.app(scope, receive, send)


async def test_remote_sampler_follows_through_an_s3_mirror_and_falls_back_when_it_lags(model_dir, tmp_path,
                                                                                       monkeypatch):
    import boto3

    with moto_s3(tmp_path) as endpoint:
        for k, v in {"AWS_ENDPOINT_URL": endpoint, **S3_ENV}.items():
            monkeypatch.setenv(k, v)
        boto3.client("s3").create_bucket(Bucket="weights")
        mirror = S3Store.from_url("s3://weights/run-1")

        origin = LocalDirStore(tmp_path / "origin")
        pub = Publisher(origin, PublisherConfig(run="run-1"))
        weights = {k: v.to(torch.bfloat16) for k, v in read_state_dict(model_dir).items()}
        pub.publish(weights)
        mirror_current(origin, mirror)
        pool = SamplerPool()
        counting = _Counting(blob_app(origin))
        mounts = MountTable()
        mounts.add("/fleet", fleet_app(pool, token=TOKEN, run_id="run-1", heartbeat_s=0.5), auth=False, owner="pool")
        mounts.add("/weights", counting, auth=True, owner="trainer")
        backend = TorchBackend(TorchBackendConfig(model_dir=str(model_dir), dtype="bf16"))
        stop = trio.Event()
        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                host, port = await n.start(lambda task_status: serve_control(
                    build_app(_Plane(), "control-token", mounts), "127.0.0.1", 0,
                    shutdown_trigger=stop.wait, task_status=task_status))
                cfg = RemoteClientConfig(join_url=f"ws://{host}:{port}/fleet/join", token=TOKEN, dtype="bf16",
                                         weights_url=f"http://{host}:{port}/weights", weights_token="control-token",
                                         weights_mirror="s3://weights/run-1")
                scope = trio.CancelScope()

                async def remote() -> None:
                    with scope:
                        await run_remote(cfg, backend)
                n.start_soon(remote)

                async def announce_and_wait() -> None:
                    pool.announce(m.WeightVersionAvailable(version=pub.version, digest=pub.digest.hex(), base=None,
                                                           blobs=()), n)
                    while backend.weight_version.digest != pub.digest.hex():
                        await trio.sleep(0.05)

                await announce_and_wait()  # v0: from the mirror
                name = "model.layers.0.mlp.down_proj.weight"
                weights[name] = weights[name].clone()
                weights[name][1, :8] += 0.25
                pub.publish(weights)
                mirror_current(origin, mirror)
                await announce_and_wait()  # v1: from the mirror
                assert sum(counting.blobs.values()) == 0
                weights[name][2, :8] += 0.25
                pub.publish(weights)  # v2: announced, not mirrored yet
                await announce_and_wait()
                assert sum(counting.blobs.values()) >= 1  # the stale mirror's gap came from the origin
                assert backend.weight_version.version == 2
                scope.cancel()
                stop.set()

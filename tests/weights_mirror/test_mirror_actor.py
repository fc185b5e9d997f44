"""The weights mirror actor under the real supervisor: each announced version lands in an
S3 bucket (moto's S3 server on 127.0.0.1), announcements that queue are collapsed, a copy
that fails (no bucket yet) is retried without a new announcement, and a follower reading
only the bucket reaches the publisher's exact digest."""

from __future__ import annotations

import random
from functools import partial

import boto3
import pytest
import torch
import trio
from s3server import S3_ENV, moto_s3

from fleetrl.actors.weights import Follower, LocalDirStore, Publisher, PublisherConfig, StoreSource
from fleetrl.actors.weights.s3 import S3Store
from fleetrl.daemon import messages as m
from fleetrl.daemon.config import load_config_text
from fleetrl.daemon.state import StateDir
from fleetrl.daemon.supervisor import Supervisor


@pytest.fixture
def s3_endpoint(monkeypatch, tmp_path):
    """moto's S3 server (a subprocess); boto3 in this process points at it by its environment."""
    with moto_s3(tmp_path) as endpoint:
        for k, v in {"AWS_ENDPOINT_URL": endpoint, **S3_ENV}.items():
            monkeypatch.setenv(k, v)
        yield endpoint


async def test_announced_versions_are_mirrored_and_a_failed_copy_is_retried(tmp_path, s3_endpoint):
    origin = LocalDirStore(tmp_path / "weights")
    gen = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(64, 48, generator=gen).to(torch.bfloat16), "b": torch.randn(300, generator=gen).to(
        torch.bfloat16)}
    pub = Publisher(origin, PublisherConfig(run="mirror-test", chunk_elems=1024))
    cfg = load_config_text(f"""
[daemon]
grace_s = 10.0
checkpoint_interval_s = 1000.0
[http]
enabled = false
[logging]
file = false
[actors.mirror]
factory = "fleetrl.actors.weights_mirror:run"
config = {{ to = "s3://bucket/run-1", store_dir = "{origin.root}", retry_s = 0.2 }}
""", source="mirror.toml")
    state = StateDir(tmp_path / "state").open()
    sup = Supervisor(cfg, state, rng=random.Random(0))
    bucket = S3Store("bucket", "run-1/")
    with state, trio.fail_after(60):
        async with trio.open_nursery() as n:
            await n.start(partial(sup.run, handle_signals=False))
            handle = await sup.wait_handle("mirror")
            inbox = sup.inbox_sender("mirror").clone()

            async def announce() -> None:
                await inbox.send(m.WeightVersionAvailable(version=pub.version, digest=pub.digest.hex(), base=None,
                                                          blobs=()))

            pub.publish(w)
            await announce()  # the bucket does not exist yet: the copy fails ...
            while handle.failures == 0:
                await trio.sleep(0.02)
            assert "NoSuchBucket" in (handle.last_error or "")
            boto3.client("s3").create_bucket(Bucket="bucket")
            while handle.version != 0:  # ... and is tried again without a new announcement
                await trio.sleep(0.02)
            copies = handle.copies
            for k in range(1, 4):  # three versions announced at once: collapsed
                w["a"] = w["a"].clone()
                w["a"][k, :5] += 1
                pub.publish(w)
                await announce()
            while handle.version != 3:
                await trio.sleep(0.02)
            assert handle.copies - copies <= 3
            f = await trio.to_thread.run_sync(lambda: Follower.from_manifest(StoreSource(bucket).manifest()))
            await trio.to_thread.run_sync(f.sync, StoreSource(bucket))
            assert (f.version, f.digest) == (3, pub.digest)
            assert all(torch.equal(f.weights[k].view(torch.int16), w[k].view(torch.int16)) for k in w)
            sup.request_shutdown("test over")

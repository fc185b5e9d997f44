"""Delta fan-out through existing parts: followers behind a real nginx cache fetch each
immutable blob from the origin once (the version pointer is never cached); an S3 mirror
(moto's S3 server on 127.0.0.1, a stand-in for S3/R2/GCS) copied from the origin serves
followers through boto3, and a follower that finds the mirror stale or missing a blob
falls back to the origin. Every follower ends on the publisher's exact digest."""

from __future__ import annotations

import collections
import shutil
import socket
import subprocess
import time

import httpx
import pytest
import trio
from fakes import NullControlPlane
from s3server import S3_ENV, moto_s3

from fleetrl.actors.pool.local import AsyncStoreSource
from fleetrl.actors.weights.follower import Follower, StoreSource
from fleetrl.actors.weights.http import HttpBlobSource, blob_app
from fleetrl.actors.weights.mirror import MirrorSource, mirror_current, referenced_keys
from fleetrl.actors.weights.publisher import Publisher, PublisherConfig
from fleetrl.actors.weights.store import LocalDirStore
from fleetrl.daemon.control import MountTable, build_app, serve_control
from fleetrl.daemon.credentials import CredentialStore

FOLLOWERS = 8
NGINX = shutil.which("nginx") or "/usr/sbin/nginx"  # scripts/setup.sh installs it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _workers_as_us() -> str:
    """nginx started by root runs its workers as nobody, who cannot write the test's
    private directory: keep them as root (started by anyone else they stay that user)."""
    import os

    return "user root;" if os.geteuid() == 0 else ""


class _Counting:
    """ASGI middleware: counts the origin's requests by path."""

    def __init__(self, app):
        self.app, self.paths = app, collections.Counter()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.paths[scope["path"]] += 1
        await self.app(scope, receive, send)


NGINX_CONF = """
daemon off;
{user}
worker_processes 2;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 512; }}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/body; proxy_temp_path {d}/proxy; fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi; scgi_temp_path {d}/scgi;
    proxy_cache_path {d}/cache levels=1:2 keys_zone=weights:10m max_size=1g inactive=7d use_temp_path=off;
    server {{
        listen 127.0.0.1:{port};
        # the cache's own credential: a weights-read token (it can read weights, nothing else)
        proxy_set_header Authorization "Bearer {token}";
        proxy_http_version 1.1;
        location /weights/blobs/ {{
            proxy_pass http://127.0.0.1:{origin};
            proxy_cache weights;
            proxy_cache_key $uri;
            proxy_cache_lock on;             # concurrent misses of one blob: one origin request
            proxy_cache_lock_timeout 120s;
            proxy_cache_valid 200 365d;
            add_header X-Cache $upstream_cache_status;
        }}
        location /weights/ {{                 # refs: the version pointer, never cached
            proxy_pass http://127.0.0.1:{origin};
            proxy_cache off;
        }}
    }}
}}
"""


def _publish_versions(make_trainer, store, n):
    tr = make_trainer(lr=1e-4)
    pub = Publisher(store, PublisherConfig(run="fan-out", window=4, anchor_every=64, chunk_elems=4096))
    pub.publish(tr.bf16())
    yield pub
    for _ in range(n):
        tr.step()
        pub.publish(tr.bf16())
        yield pub


async def test_eight_followers_behind_nginx_fetch_each_blob_from_the_origin_once(tmp_path, make_trainer):
    store = LocalDirStore(tmp_path / "origin")
    creds = CredentialStore(tmp_path / "state", admin_token="admin")
    _, cache_token = creds.create("weights-read", "nginx")
    mounts = MountTable()
    mounts.add("/weights", blob_app(store), auth=True, owner="trainer", roles=("weights-read",))
    origin_app = _Counting(build_app(NullControlPlane(), "admin", mounts, creds))
    versions = _publish_versions(make_trainer, store, 3)
    pub = next(versions)
    stop = trio.Event()
    with trio.fail_after(120):
        async with trio.open_nursery() as n:
            host, origin_port = await n.start(lambda task_status: serve_control(
                origin_app, "127.0.0.1", 0, shutdown_trigger=stop.wait, task_status=task_status))
            port = _free_port()
            conf = tmp_path / "nginx"
            conf.mkdir()
            (conf / "nginx.conf").write_text(NGINX_CONF.format(d=conf, port=port, origin=origin_port,
                                                               token=cache_token, user=_workers_as_us()))
            with open(conf / "stderr.log", "wb") as err:
                proc = subprocess.Popen([NGINX, "-c", str(conf / "nginx.conf"), "-p", str(conf)],
                                        stdout=subprocess.DEVNULL, stderr=err)
            try:
                async with httpx.AsyncClient(timeout=30) as client:
                    deadline = time.monotonic() + 20
                    while True:  # nginx up: a ref through it
                        try:
                            if (await client.get(f"http://127.0.0.1:{port}/weights/refs/manifest")).status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        assert proc.poll() is None, (conf / "stderr.log").read_text()
                        assert time.monotonic() < deadline, "nginx did not come up"
                        await trio.sleep(0.1)
                    cache = HttpBlobSource(client, f"http://127.0.0.1:{port}/weights")
                    # the followers' origin: refused (no credential), so any fallback would fail the sync
                    origin = HttpBlobSource(client, f"http://127.0.0.1:{origin_port}/weights")
                    sources = [MirrorSource(cache, origin) for _ in range(FOLLOWERS)]
                    followers = [Follower.from_manifest(await cache.manifest()) for _ in range(FOLLOWERS)]
                    fetched: set[str] = set()
                    for _ in range(4):  # versions 0..3: every follower syncs at once
                        fetched.update(referenced_keys(pub.manifest) if pub.version == 0 else
                                       [pub.manifest.catchup[-1].key, pub.manifest.anchor.key])
                        async with trio.open_nursery() as group:
                            for f, s in zip(followers, sources, strict=True):
                                group.start_soon(f.sync_async, s)
                        assert {f.digest.hex() for f in followers} == {pub.digest.hex()}
                        assert {f.version for f in followers} == {pub.version}
                        pub = next(versions, pub)
                    assert all(s.stats.blobs_from_origin == 0 and s.stats.manifests_from_origin == 0 for s in sources)
            finally:
                proc.terminate()
                proc.wait(timeout=10)
            stop.set()
    blob_paths = {p: c for p, c in origin_app.paths.items() if p.startswith("/weights/blobs/")}
    # every blob the followers fetched came from the origin exactly once ...
    assert blob_paths and set(blob_paths.values()) == {1}, blob_paths
    served = sum(s.stats.blobs_from_mirror for s in sources)
    assert served >= FOLLOWERS * len(blob_paths) // 2, (served, len(blob_paths))
    # ... while the version pointer went to the origin on every read (never cached)
    refs = sum(c for p, c in origin_app.paths.items() if p.startswith("/weights/refs/"))
    assert refs >= FOLLOWERS * 4 + 1


@pytest.fixture
def s3_server(tmp_path):
    """moto's S3 server (a subprocess) on a free 127.0.0.1 port."""
    with moto_s3(tmp_path) as endpoint:
        yield endpoint


def _s3(endpoint, bucket="weights", create=True):
    import boto3

    from fleetrl.actors.weights.s3 import S3Store

    client = boto3.client("s3", endpoint_url=endpoint, region_name=S3_ENV["AWS_DEFAULT_REGION"],
                          aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"])
    if create:
        client.create_bucket(Bucket=bucket)
    return S3Store(bucket, "run-1/", client=client)


async def test_an_s3_mirror_serves_followers_and_a_stale_one_falls_back_to_the_origin(tmp_path, make_trainer,
                                                                                     s3_server):
    origin_store = LocalDirStore(tmp_path / "origin")
    s3 = _s3(s3_server)
    versions = _publish_versions(make_trainer, origin_store, 3)
    pub = next(versions)
    m, copied = await trio.to_thread.run_sync(mirror_current, origin_store, s3)
    assert m.version == 0 and copied == len(referenced_keys(m))
    assert (await trio.to_thread.run_sync(mirror_current, origin_store, s3))[1] == 0  # nothing twice
    head = s3.client.head_object(Bucket="weights", Key=f"run-1/blobs/{m.anchor.key[:2]}/{m.anchor.key}")
    assert "immutable" in head["CacheControl"]

    source = MirrorSource(AsyncStoreSource(StoreSource(s3)), AsyncStoreSource(StoreSource(origin_store)))
    f = Follower.from_manifest(await source.manifest())
    await f.sync_async(source)
    assert (f.version, f.digest.hex()) == (0, pub.digest.hex())
    assert source.stats.blobs_from_origin == 0 and source.stats.blobs_from_mirror >= 1

    # the publisher moves on; the mirror is copied for version 1 but lags at 2 (stale)
    pub = next(versions)
    await trio.to_thread.run_sync(mirror_current, origin_store, s3)
    source.expect(1)
    await f.sync_async(source)
    assert (f.version, f.digest.hex()) == (1, pub.digest.hex()) and source.stats.manifests_from_origin == 0
    pub = next(versions)
    source.expect(2)  # announced, not mirrored yet: the mirror's manifest is stale
    await f.sync_async(source)
    assert (f.version, f.digest.hex()) == (2, pub.digest.hex())
    assert source.stats.manifests_from_origin >= 1 and source.stats.blobs_from_origin >= 1
    assert source.stats.stale_manifests == 1

    # a blob lost from the mirror (or corrupted there) comes from the origin
    pub = next(versions)
    await trio.to_thread.run_sync(mirror_current, origin_store, s3)
    lost = pub.manifest.catchup[-1].key
    s3.delete(lost)
    before = source.stats.blobs_from_origin
    source.expect(3)
    await f.sync_async(source)
    assert (f.version, f.digest.hex()) == (3, pub.digest.hex())
    assert source.stats.blobs_from_origin == before + 1 and lost in (source.stats.last_problem or "")

    # the store itself: ranges, refs, missing keys
    assert s3.read(m.anchor.key, 3, 10) == origin_store.read(m.anchor.key, 3, 10)
    assert s3.read(m.anchor.key, 5, 5) == b"" and s3.size(m.anchor.key) == origin_store.size(m.anchor.key)
    from fleetrl.actors.weights.errors import BlobNotFound

    with pytest.raises(BlobNotFound):
        s3.read(lost)
    with pytest.raises(BlobNotFound):
        s3.get_ref("no-such-ref")
    assert set(referenced_keys(pub.manifest)) - {lost} <= set(s3.keys())


def test_s3_urls_name_what_is_wrong():
    from fleetrl.actors.weights.s3 import parse_s3_url

    assert parse_s3_url("s3://b") == ("b", "")
    assert parse_s3_url("s3://b/run/1/") == ("b", "run/1/")
    for bad in ("http://b/x", "s3:///x", "s3://b/x?y=1"):
        with pytest.raises(ValueError, match="must look like s3://BUCKET"):
            parse_s3_url(bad)

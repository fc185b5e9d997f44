"""The blob HTTP app under a real hypercorn server on 127.0.0.1, fetched with httpx."""

import httpx
import torch
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from fleetrl.actors.weights.follower import BlobIntegrityError, Fp8Follower
from fleetrl.actors.weights.http import HttpBlobSource, blob_app
from fleetrl.actors.weights.publisher import Publisher, PublisherConfig
from fleetrl.actors.weights.quant import quantize_fp8
from fleetrl.actors.weights.store import LocalDirStore, MemoryStore, key_of


async def _serve(nursery, app) -> tuple[str, trio.Event]:
    cfg = Config()
    cfg.bind = ["127.0.0.1:0"]
    cfg.accesslog = None
    cfg.errorlog = None
    stop = trio.Event()
    binds = await nursery.start(lambda task_status: serve(app, cfg, shutdown_trigger=stop.wait,
                                                          task_status=task_status))
    return binds[0], stop


@pytest.fixture
def store(tmp_path):
    return LocalDirStore(tmp_path / "blobs")


async def test_whole_blobs_ranges_etags_and_errors(store):
    data = bytes(range(256)) * 5000  # ~1.2 MB, several streaming reads would be 4 MiB each
    key = store.put(data)
    store.set_ref("manifest", key)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            base, stop = await _serve(nursery, blob_app(store))
            async with httpx.AsyncClient() as c:
                r = await c.get(f"{base}/blobs/{key}")
                assert r.status_code == 200 and r.content == data
                assert r.headers["etag"] == f'"{key}"' and "immutable" in r.headers["cache-control"]
                assert r.headers["accept-ranges"] == "bytes"
                r = await c.get(f"{base}/blobs/{key}", headers={"Range": "bytes=10-19"})
                assert r.status_code == 206 and r.content == data[10:20]
                assert r.headers["content-range"] == f"bytes 10-19/{len(data)}"
                r = await c.get(f"{base}/blobs/{key}", headers={"Range": "bytes=-5"})
                assert r.status_code == 206 and r.content == data[-5:]
                r = await c.get(f"{base}/blobs/{key}", headers={"Range": f"bytes={len(data) - 3}-"})
                assert r.content == data[-3:]
                r = await c.get(f"{base}/blobs/{key}", headers={"Range": "bytes=5-999999999"})
                assert r.status_code == 206 and r.content == data[5:]
                for bad in [f"bytes={len(data)}-", "bytes=9-3", "bytes=0-1,5-6", "items=0-1", "bytes=-0"]:
                    r = await c.get(f"{base}/blobs/{key}", headers={"Range": bad})
                    assert r.status_code == 416, bad
                    assert r.headers["content-range"] == f"bytes */{len(data)}"
                r = await c.get(f"{base}/blobs/{key}", headers={"If-None-Match": f'"{key}"'})
                assert r.status_code == 304 and r.content == b""
                r = await c.head(f"{base}/blobs/{key}")
                assert r.status_code == 200 and int(r.headers["content-length"]) == len(data)
                r = await c.get(f"{base}/blobs/{'0' * 32}")
                assert r.status_code == 404
                r = await c.get(f"{base}/blobs/not-a-key")
                assert r.status_code == 400 and "32 lowercase hex" in r.text
                r = await c.get(f"{base}/refs/manifest")
                assert r.text == key and r.headers["cache-control"] == "no-cache"
                assert (await c.get(f"{base}/refs/nothing")).status_code == 404
                src = HttpBlobSource(c, base)
                assert await src.get_range(key, 100, 200) == data[100:200]
                assert await src.get(key) == data
            stop.set()


async def test_client_rejects_a_blob_that_does_not_match_its_key():
    class LyingStore(MemoryStore):
        def read(self, key, start=0, stop=None):
            out = bytearray(super().read(key, start, stop))
            out[0] ^= 1
            return bytes(out)

    st = LyingStore()
    key = st.put(b"some delta bytes")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            base, stop = await _serve(nursery, blob_app(st))
            async with httpx.AsyncClient() as c:
                with pytest.raises(BlobIntegrityError):
                    await HttpBlobSource(c, base).get(key)
            stop.set()
    assert key_of(b"some delta bytes") == key


async def test_follower_catches_up_over_http(store, make_trainer):
    tr = make_trainer(lr=3e-5)
    pub = Publisher(store, PublisherConfig(run="http-run", window=3, anchor_every=4, chunk_elems=4096))
    pub.publish(tr.bf16())
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            base, stop = await _serve(nursery, blob_app(store))
            async with httpx.AsyncClient() as c:
                src = HttpBlobSource(c, base)
                f = Fp8Follower.from_manifest(await src.manifest(), scheme="row")
                routes = [(await f.sync_async(src)).route]
                for lag in [1, 2, 5, 0]:  # catch-up, catch-up, beyond the window, current
                    for _ in range(lag):
                        tr.step()
                        pub.publish(tr.bf16())
                    routes.append((await f.sync_async(src)).route)
                    assert f.digest == pub.digest
                assert routes == ["anchor", "catchup", "catchup", "anchor", "current"]
                for n, t in tr.bf16().items():
                    q, _ = quantize_fp8(t, "row")
                    assert q.view(torch.uint8).equal(f.q[n].view(torch.uint8))
                # corrupted weights: the cheap route fails its hash, the anchor route repairs
                tr.step()
                pub.publish(tr.bf16())
                f.shadow["embed"].view(-1)[:50] = 0
                rep = await f.sync_async(src)
                assert rep.fallback and f.digest == pub.digest and f.verify()
            stop.set()

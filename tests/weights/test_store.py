"""Blob stores: content addressing, immutability, ranges, atomic refs."""

import os

import pytest

from fleetrl.actors.weights.store import BlobNotFound, LocalDirStore, MemoryStore, key_of


@pytest.fixture(params=["dir", "memory"])
def store(request, tmp_path):
    return LocalDirStore(tmp_path / "s") if request.param == "dir" else MemoryStore()


def test_put_is_content_addressed_and_idempotent(store):
    k = store.put(b"hello weights")
    assert k == key_of(b"hello weights") and len(k) == 32
    assert store.put(b"hello weights") == k
    assert store.read(k) == b"hello weights" and store.size(k) == 13 and store.has(k)
    assert store.read(k, 6, 13) == b"weights"
    with pytest.raises(ValueError, match="outside"):
        store.read(k, 5, 99)


def test_missing_and_malformed_keys(store):
    with pytest.raises(BlobNotFound):
        store.read("0" * 32)
    with pytest.raises(ValueError, match="32 lowercase hex"):
        store.read("../../etc/passwd")
    with pytest.raises(ValueError, match="ref name"):
        store.set_ref("../x", "0" * 32)
    with pytest.raises(BlobNotFound):
        store.get_ref("manifest")


def test_refs_replace_atomically(store):
    a, b = store.put(b"a"), store.put(b"b")
    store.set_ref("manifest", a)
    assert store.get_ref("manifest") == a
    store.set_ref("manifest", b)
    assert store.get_ref("manifest") == b
    store.delete(a)
    assert not store.has(a) and store.has(b)


def test_dir_store_layout_leaves_no_temp_files(tmp_path):
    s = LocalDirStore(tmp_path)
    k = s.put(b"x" * 1000)
    s.set_ref("manifest", k)
    assert s.path(k) == tmp_path / "blobs" / k[:2] / k
    assert os.listdir(tmp_path / "tmp") == []
    assert s.keys() == [k]
    # a second store on the same directory sees the same state
    assert LocalDirStore(tmp_path).get_ref("manifest") == k

"""Checkpoint files and the state directory."""

from __future__ import annotations

import os
import stat

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.daemon.checkpoint import CheckpointStore, decode, encode, Checkpoint
from fleetrl.daemon.faults import CheckpointCorrupt, StateDirLocked
from fleetrl.daemon.state import StateDir, daemon_alive


class Snap(msgspec.Struct):
    step: int
    weights: bytes


def test_write_load_roundtrip_and_keep_last(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for i in range(5):
        store.write("run-1", {"a": Snap(i, b"\x00\x01"), "b": b"raw"})
    files = store.files()
    assert [f.name for f in files] == ["ckpt-000000000005.bin", "ckpt-000000000004.bin"]
    ckpt, problems = store.load_latest()
    assert problems == []
    assert ckpt.seq == 5 and ckpt.run_id == "run-1"
    assert ckpt.actors == {"a": {"step": 4, "weights": b"\x00\x01"}, "b": b"raw"}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "empty"])
def test_damaged_newest_falls_back_to_previous_with_a_note(tmp_path, damage):
    store = CheckpointStore(tmp_path, keep=3)
    store.write("r", {"a": 1})
    store.write("r", {"a": 2})
    newest = store.files()[0]
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        data = data[:-3]
    elif damage == "flip":
        data[-1] ^= 0xFF
    elif damage == "magic":
        data[:8] = b"NOTACKPT"
    else:
        data = bytearray()
    newest.write_bytes(bytes(data))
    ckpt, problems = store.load_latest()
    assert ckpt is not None and ckpt.actors == {"a": 1}
    assert len(problems) == 1 and str(newest) in problems[0]
    # the next write does not reuse the damaged file's sequence number
    assert store.write("r", {"a": 3}).seq == 3


def test_no_checkpoint_at_all(tmp_path):
    assert CheckpointStore(tmp_path / "new").load_latest() == (None, [])


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8),
                       st.one_of(st.binary(max_size=64), st.integers(-2**63, 2**63 - 1),
                                 st.lists(st.floats(allow_nan=False), max_size=4),
                                 st.text(max_size=20))),
       st.data())
def test_any_single_byte_corruption_is_detected(actors, data):
    blob = encode(Checkpoint(seq=1, written_at=1.0, run_id="r", actors=actors))
    assert decode(blob).actors == actors
    i = data.draw(st.integers(0, len(blob) - 1))
    bad = bytearray(blob)
    bad[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CheckpointCorrupt):
        decode(bytes(bad))


def test_state_dir_layout_token_mode_and_persistent_run_id(tmp_path):
    sd = StateDir(tmp_path / "s").open()
    try:
        assert stat.S_IMODE((sd.path / "token").stat().st_mode) == 0o600
        assert len(sd.token) >= 32
        for sub in ("checkpoints", "logs", "actors"):
            assert (sd.path / sub).is_dir()
        inst = msgspec.json.decode((sd.path / "instance.json").read_bytes())
        assert inst["pid"] == os.getpid() and inst["instance_id"] == sd.instance_id
        assert daemon_alive(sd.path)
        with pytest.raises(StateDirLocked, match=f"pid {os.getpid()}"):
            StateDir(sd.path).open()
        run_id, token = sd.run_id, sd.token
        sd.write_control("127.0.0.1", 1234)
    finally:
        sd.close()
    assert not daemon_alive(sd.path)
    assert not (sd.path / "control.json").exists()
    os.chmod(sd.path / "token", 0o644)
    again = StateDir(sd.path).open()
    try:
        assert (again.run_id, again.token) == (run_id, token)
        assert again.instance_id != sd.instance_id
        assert stat.S_IMODE((sd.path / "token").stat().st_mode) == 0o600
    finally:
        again.close()

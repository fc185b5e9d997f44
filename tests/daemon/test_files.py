"""daemon.files.write_atomic: all-or-nothing writes with the asked permissions."""

from __future__ import annotations

import os
import stat

import pytest

from fleetrl.daemon.files import write_atomic


def test_replaces_content_with_mode_and_leaves_no_temp(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    write_atomic(target, b"new", mode=0o600)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["f.bin"]


def test_failure_keeps_the_old_file_and_removes_the_temp(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    with pytest.raises(TypeError):
        write_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]


def test_temp_dir_on_the_same_filesystem(tmp_path):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "out").mkdir()
    write_atomic(tmp_path / "out" / "x", b"data", tmp_dir=tmp_path / "tmp")
    assert (tmp_path / "out" / "x").read_bytes() == b"data"
    assert os.listdir(tmp_path / "tmp") == []

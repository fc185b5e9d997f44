"""Checkpoint files: atomic on disk, self-checking, newest-valid-wins.

A checkpoint holds, per actor, whatever its checkpoint hook returned (bytes or any
msgspec-encodable object), encoded as msgpack. File layout::

    b"FLRLCKP1" | payload length (u64 BE) | xxh64(payload) (u64 BE) | payload

Writes go to a temp file in the same directory, which is fsync-ed, renamed over the
final name, and the directory fsync-ed: a crash leaves either the old set of files
or the new one, never a half-written checkpoint under a final name. Only the last
``keep`` files are kept. At start the newest file that verifies is loaded; a damaged
newer file is reported (so the caller can warn) and the previous one is used.

Pure file I/O, synchronous: the supervisor calls it through ``trio.to_thread``.
"""

from __future__ import annotations

import re
import struct
import time
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from .faults import CheckpointCorrupt
from .files import write_atomic

__all__ = ["Checkpoint", "CheckpointStore"]

MAGIC = b"FLRLCKP1"
_HEADER = struct.Struct(">8sQQ")
_NAME = re.compile(r"^ckpt-(\d{12})\.bin$")


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    """One checkpoint: sequence number, when, which run, and each actor's state."""

    seq: int
    written_at: float
    run_id: str
    actors: dict[str, Any]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Checkpoint)


def encode(ckpt: Checkpoint) -> bytes:
    payload = _encoder.encode(ckpt)
    return _HEADER.pack(MAGIC, len(payload), xxhash.xxh64_intdigest(payload)) + payload


def decode(data: bytes, *, name: str = "checkpoint") -> Checkpoint:
    """Verify and decode one file's bytes; raises `CheckpointCorrupt` saying why."""
    if len(data) < _HEADER.size:
        raise CheckpointCorrupt(f"{name}: truncated header ({len(data)} bytes)")
    magic, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointCorrupt(f"{name}: not a fleetrl checkpoint (bad magic)")
    payload = data[_HEADER.size:]
    if len(payload) != length:
        raise CheckpointCorrupt(f"{name}: truncated payload ({len(payload)} of {length} bytes)")
    if xxhash.xxh64_intdigest(payload) != digest:
        raise CheckpointCorrupt(f"{name}: checksum mismatch")
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise CheckpointCorrupt(f"{name}: cannot decode: {exc}") from None


class CheckpointStore:
    """The ``checkpoints/`` directory of a state directory."""

    def __init__(self, directory: str | Path, *, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.dir = Path(directory)
        self.keep = keep
        self.dir.mkdir(parents=True, exist_ok=True)

    def files(self) -> list[Path]:
        """Checkpoint files, newest (highest sequence number) first."""
        found = [(int(m.group(1)), p) for p in self.dir.iterdir()
                 if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def next_seq(self) -> int:
        files = self.files()
        return int(_NAME.match(files[0].name).group(1)) + 1 if files else 1  # type: ignore[union-attr]

    def write(self, run_id: str, actors: dict[str, Any]) -> Checkpoint:
        """Atomically write a new checkpoint and prune old ones; returns it."""
        ckpt = Checkpoint(seq=self.next_seq(), written_at=time.time(), run_id=run_id,
                          actors=dict(actors))
        data = encode(ckpt)
        final = self.dir / f"ckpt-{ckpt.seq:012d}.bin"
        write_atomic(final, data, mode=0o600)
        for old in self.files()[self.keep:]:
            old.unlink(missing_ok=True)
        return ckpt

    def load_latest(self) -> tuple[Checkpoint | None, list[str]]:
        """The newest checkpoint that verifies, and a note for each damaged newer one."""
        problems: list[str] = []
        for path in self.files():
            try:
                return decode(path.read_bytes(), name=str(path)), problems
            except (CheckpointCorrupt, OSError) as exc:
                problems.append(str(exc))
        return None, problems

"""Atomic file writes: readers see the old file or the new one, never a part.

The one implementation used for checkpoints, state files, weight blobs and task files:
write a temp file beside the target (or in ``tmp_dir`` on the same filesystem), fsync
it, rename it over the target, fsync the directory so the rename survives a crash.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["fsync_dir", "write_atomic"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o644,
                 tmp_dir: str | os.PathLike[str] | None = None) -> None:
    """Write ``data`` to ``path`` atomically with permissions ``mode``.

    ``tmp_dir`` (default: the target's directory) must be on the same filesystem.
    On any error the temp file is removed and the target is left as it was.
    """
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:32]}.", suffix=".tmp",
                               dir=tmp_dir if tmp_dir is not None else directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)

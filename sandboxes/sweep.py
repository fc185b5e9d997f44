"""Ownership labels and the orphan sweep (see docs/reference/contracts.md, "Sandbox container labels").

Every sandbox container carries ``fleetrl.owner`` (daemon instance id), ``fleetrl.run``
(run id), ``fleetrl.state`` (first 16 hex digits of sha256 of the state directory's
real path) and ``fleetrl.created`` (unix time). The live daemon of a state directory
holds ``<state>/daemon.lock`` (flock, exclusive) for its whole life and describes itself
in ``<state>/instance.json``.

The sweep removes containers of one state directory that no live daemon owns. It only
ever lists containers by the ``fleetrl.state=<hash>`` label filter, so containers
without our labels (or of another state directory) are never touched.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import time
from pathlib import Path

import docker
import docker.errors
import msgspec
import trio

__all__ = [
    "Ownership",
    "SweepReport",
    "state_hash",
    "sweep",
    "sweep_blocking",
    "LABEL_OWNER",
    "LABEL_RUN",
    "LABEL_STATE",
    "LABEL_CREATED",
]

LABEL_OWNER = "fleetrl.owner"
LABEL_RUN = "fleetrl.run"
LABEL_STATE = "fleetrl.state"
LABEL_CREATED = "fleetrl.created"


def state_hash(state_dir: str | os.PathLike) -> str:
    """First 16 hex digits of sha256 of the state directory's real path."""
    return hashlib.sha256(os.path.realpath(state_dir).encode()).hexdigest()[:16]


class Ownership(msgspec.Struct, frozen=True, kw_only=True):
    """Who a container belongs to; becomes its labels."""

    owner: str
    run: str
    state: str

    def __post_init__(self) -> None:
        for name in ("owner", "run", "state"):
            v = getattr(self, name)
            if not v or len(v) > 128 or any(c in v for c in "\n\r\0,="):
                raise ValueError(f"Ownership.{name}: {v!r} must be 1-128 characters without newline, NUL, ',' or '='")

    @classmethod
    def for_state_dir(cls, state_dir: str | os.PathLike, *, owner: str, run: str | None = None) -> "Ownership":
        """Ownership for a process using ``state_dir``; ``run`` defaults to its ``run_id`` file, else 'adhoc'."""
        if run is None:
            try:
                run = (Path(state_dir) / "run_id").read_text().strip() or "adhoc"
            except OSError:
                run = "adhoc"
        return cls(owner=owner, run=run, state=state_hash(state_dir))

    def labels(self, now: float | None = None) -> dict[str, str]:
        return {
            LABEL_OWNER: self.owner,
            LABEL_RUN: self.run,
            LABEL_STATE: self.state,
            LABEL_CREATED: f"{time.time() if now is None else now:.3f}",
        }


class SweepReport(msgspec.Struct, frozen=True, kw_only=True):
    state: str
    """The state hash swept."""
    live_owner: str | None
    """Instance id of the daemon that holds the lock (spared), or None."""
    removed: tuple[str, ...]
    """Short ids of the removed containers."""
    spared: tuple[str, ...]
    """Short ids of containers of this state kept because a live daemon owns them."""
    errors: tuple[str, ...] = ()
    """Containers that could not be removed, with the reason."""


def _live_owner(state_dir: Path) -> tuple[bool, str | None]:
    """(is a daemon alive, its instance id if readable). Takes the lock briefly when free."""
    lock_path = state_dir / "daemon.lock"
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return False, None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            try:
                info = json.loads((state_dir / "instance.json").read_text())
                iid = info.get("instance_id") if isinstance(info, dict) else None
                return True, iid if isinstance(iid, str) else None
            except (OSError, ValueError):
                return True, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, None
    finally:
        os.close(fd)


def sweep_blocking(
    state_dir: str | os.PathLike,
    *,
    current_instance_id: str | None = None,
    client: docker.DockerClient | None = None,
) -> SweepReport:
    """Remove containers of ``state_dir`` that no live daemon owns (blocking).

    ``current_instance_id`` given: the caller is the daemon holding the lock; every
    container of this state not owned by it is removed. None: the lock is probed; if a
    daemon holds it, its containers (by ``instance.json``) are spared, and if its id
    cannot be read every container is spared.
    """
    sd = Path(state_dir)
    h = state_hash(sd)
    client = client or docker.from_env()
    if current_instance_id is not None:
        alive, live = True, current_instance_id
    else:
        alive, live = _live_owner(sd)
    removed: list[str] = []
    spared: list[str] = []
    errors: list[str] = []
    for c in client.containers.list(all=True, filters={"label": f"{LABEL_STATE}={h}"}):
        labels = c.labels or {}
        if labels.get(LABEL_STATE) != h:  # the filter already says so; never trust it blindly
            continue
        owner = labels.get(LABEL_OWNER)
        if alive and (live is None or owner == live):
            spared.append(c.short_id)
            continue
        try:
            c.remove(force=True)
            removed.append(c.short_id)
        except docker.errors.NotFound:
            removed.append(c.short_id)
        except docker.errors.APIError as e:
            errors.append(f"{c.short_id}: {e.explanation or e}")
    return SweepReport(
        state=h, live_owner=live if alive else None, removed=tuple(removed), spared=tuple(spared), errors=tuple(errors)
    )


async def sweep(
    state_dir: str | os.PathLike,
    *,
    current_instance_id: str | None = None,
    client: docker.DockerClient | None = None,
    metrics=None,
) -> SweepReport:
    """Async ``sweep_blocking`` (run in a worker thread); counts into ``metrics`` if given."""
    report = await trio.to_thread.run_sync(
        lambda: sweep_blocking(state_dir, current_instance_id=current_instance_id, client=client)
    )
    if metrics is not None:
        metrics.on_sweep(len(report.removed))
    return report

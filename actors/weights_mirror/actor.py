"""The weights mirror actor: after each `WeightVersionAvailable` (the trainer lists this
actor in ``announce_to``) it copies the delta store's current version into an
S3-compatible bucket (`fleetrl.actors.weights.mirror.mirror_current`: the blobs a
follower may need, then the manifest ref, so the bucket never points at a missing
blob). Announcements that queue while a copy runs are collapsed into the newest. A copy
that fails (the network, the bucket) is logged and tried again after ``retry_s`` or at
the next announcement; training never waits for it. Followers read the bucket with
``fleetrl sampler --weights-mirror s3://...`` and fall back to the daemon for what it
lacks (`MirrorSource`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import trio

from fleetrl.actors.weights.mirror import mirror_current
from fleetrl.actors.weights.s3 import S3Store
from fleetrl.actors.weights.store import LocalDirStore
from fleetrl.daemon import messages as m
from fleetrl.daemon.actor import ActorContext

from .config import WeightsMirrorConfig

__all__ = ["Inbox", "MirrorActorStatistics", "MirrorHandle", "run"]

Inbox = m.WeightVersionAvailable
"""The trainer's announcements."""


class MirrorActorStatistics(msgspec.Struct, frozen=True, kw_only=True):
    version: int | None
    """The newest version the bucket holds (None: none copied yet)."""
    copies: int
    blobs_copied: int
    failures: int
    last_error: str | None
    last_copy_s: float


class MirrorHandle:
    def __init__(self) -> None:
        self.version: int | None = None
        self.copies = self.blobs = self.failures = 0
        self.last_error: str | None = None
        self.last_copy_s = 0.0

    def statistics(self) -> MirrorActorStatistics:
        return MirrorActorStatistics(version=self.version, copies=self.copies, blobs_copied=self.blobs,
                                     failures=self.failures, last_error=self.last_error,
                                     last_copy_s=self.last_copy_s)


async def run(cfg: WeightsMirrorConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[MirrorHandle] = trio.TASK_STATUS_IGNORED) -> None:
    store_dir = Path(cfg.store_dir) if cfg.store_dir else ctx.daemon_dir / "actors" / "trainer" / "weights"
    origin = LocalDirStore(store_dir)
    bucket: Any = await ctx.run_blocking(lambda: S3Store.from_url(cfg.to, endpoint_url=cfg.endpoint_url))
    handle = MirrorHandle()
    copied = ctx.metrics.counter("weights_mirror_blobs", "Blobs copied into the weights mirror")
    task_status.started(handle)

    async def copy(version: int) -> bool:
        t0 = time.perf_counter()
        try:
            manifest, n = await ctx.run_blocking(mirror_current, origin, bucket)
        except Exception as exc:  # the network or the bucket: logged, tried again
            handle.failures += 1
            handle.last_error = f"{type(exc).__name__}: {exc}"
            ctx.log.warning("weights mirror copy failed", to=cfg.to, version=version, error=handle.last_error)
            return False
        handle.version, handle.copies, handle.blobs = manifest.version, handle.copies + 1, handle.blobs + n
        handle.last_copy_s = time.perf_counter() - t0
        copied.inc(n)
        ctx.report_version("mirrored", manifest.version)
        ctx.log.info("weights mirrored", to=cfg.to, version=manifest.version, blobs=n,
                     seconds=round(handle.last_copy_s, 3))
        return True

    owed: int | None = None  # a version announced and not yet copied
    while True:
        timeout = cfg.retry_s if owed is not None else float("inf")
        with trio.move_on_after(timeout):
            try:
                msg = await ctx.inbox.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                break
            owed = max(owed or 0, msg.version)
            while True:  # collapse what queued meanwhile into the newest
                try:
                    owed = max(owed, ctx.inbox.receive_nowait().version)
                except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                    break
        if owed is not None and handle.version is not None and owed <= handle.version:
            owed = None  # the bucket already holds it (a copy takes the store's newest)
        elif owed is not None and await copy(owed):
            owed = None
    if owed is not None:  # the run is ending: one last try, so the bucket holds the final version
        await copy(owed)

"""The warm-start actor: makes sure the embedded default's warm model exists before
anyone loads it.

``fleetrl.actors.warm_start:run`` calls `ensure_warm_model(cache_dir, recipe)`
(a cached build: the first start trains the supervised warm-up, later starts find it),
then points ``link`` (a symlink, replaced atomically) at the model directory, and only
then reports started. The trainer, the sampler pool, the environment workers and the
evaluator list it in ``after`` and load ``link``. It holds no state, reads no messages
and idles until the daemon drains.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Never

import msgspec
import trio

from fleetrl.actors.recipe import ensure_warm_model
from fleetrl.daemon.actor import ActorContext

from .config import WarmStartConfig

__all__ = ["Inbox", "WarmStartHandle", "WarmStartStatistics", "point_link", "run"]

Inbox = Never
"""The warm-start actor takes no messages."""


class WarmStartStatistics(msgspec.Struct, frozen=True, kw_only=True):
    model_dir: str
    """The warm model directory the link points at."""
    seconds: float
    """How long finding or building it took."""


class WarmStartHandle:
    def __init__(self, model_dir: Path, seconds: float) -> None:
        self.model_dir = model_dir
        self.seconds = seconds

    def statistics(self) -> WarmStartStatistics:
        return WarmStartStatistics(model_dir=str(self.model_dir), seconds=round(self.seconds, 3))


class _Bar:
    """The warm-up's progress bar on stderr (nothing when `enabled` is false)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None

    def say(self, line: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)

    def step(self, done: int, steps: int, loss: float) -> None:  # from the build's thread
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=steps, desc="warm-up", unit="step", file=sys.stderr, dynamic_ncols=True)
        self._bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def point_link(link: Path, target: Path) -> None:
    """Make ``link`` a symlink to ``target`` (absolute), atomically: a temporary link
    renamed over it. A real directory or file at ``link`` is refused (never deleted)."""
    target = target.absolute()
    if link.is_symlink():
        if Path(os.readlink(link)) == target:
            return
    elif link.exists():
        raise ValueError(f"warm_start.link {str(link)!r} exists and is not a symlink; "
                         "remove it or choose another path")
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.tmp-{os.getpid()}")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


async def run(cfg: WarmStartConfig, ctx: ActorContext, *,
              task_status: trio.TaskStatus[WarmStartHandle] = trio.TASK_STATUS_IGNORED) -> None:
    """Ensure the warm model, point the link at it, start, idle until drained."""
    bar = _Bar(cfg.progress)

    def say(line: str) -> None:
        ctx.log.info("warm start", detail=line)
        if line.startswith(("warm model found", "building", "rebuilding")):
            bar.say(f"warm start: {line}")

    ctx.log.info("ensuring the warm model", cache_dir=cfg.cache_dir, steps=cfg.recipe.warmup.steps)
    t0 = trio.current_time()
    # abandoned when cancelled (grace deadline of a shutdown during the build): the build
    # is atomic and locked, so an unfinished one leaves nothing a later start would trust
    try:
        path = await trio.to_thread.run_sync(
            lambda: ensure_warm_model(cfg.cache_dir, cfg.recipe, log=say, threads=cfg.threads, on_step=bar.step),
            abandon_on_cancel=True)
    finally:
        bar.close()
    await trio.to_thread.run_sync(point_link, Path(cfg.link), path)
    ctx.report_version("model", path.name)
    seconds = trio.current_time() - t0
    ctx.log.info("warm model ready", model_dir=str(path), link=cfg.link, seconds=round(seconds, 1))
    task_status.started(WarmStartHandle(path, seconds))
    await ctx.wait_draining()

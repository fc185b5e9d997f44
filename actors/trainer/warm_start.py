"""The warm-start actor: makes sure the embedded default's warm model exists before
anyone loads it.

``fleetrl.actors.trainer.warm_start:run`` calls `ensure_warm_model(cache_dir, recipe)`
(a cached build: the first start trains the supervised warm-up, later starts find it),
then points ``link`` (a symlink, replaced atomically) at the model directory, and only
then reports started. The trainer, the sampler pool, the environment workers and the
evaluator list it in ``after`` and load ``link``. It holds no state and idles until
the daemon drains.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import trio

from fleetrl.actors.recipe import DEFAULT_RECIPE, WarmRecipe, ensure_warm_model

__all__ = ["WarmStartConfig", "point_link", "run"]


class WarmStartConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[actors.warm_start.config]``."""

    cache_dir: str
    """Where warm models are cached (``warm-<key>/`` per recipe)."""
    link: str
    """Path of the symlink to the warm model directory that the other actors load."""
    recipe: WarmRecipe = DEFAULT_RECIPE
    """The recipe (default: `DEFAULT_RECIPE`); any field may be overridden in the TOML."""
    threads: int = 1
    """torch intra-op threads for the build (1 is fastest on a CPU shared with samplers)."""

    def __post_init__(self) -> None:
        for name in ("cache_dir", "link"):
            if not getattr(self, name):
                raise ValueError(f"WarmStartConfig.{name} must be a non-empty path")
        if isinstance(self.threads, bool) or self.threads < 1:
            raise ValueError(f"WarmStartConfig.threads must be an int >= 1, got {self.threads!r}")


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


async def run(cfg: WarmStartConfig, ctx: Any, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Ensure the warm model, point the link at it, start, idle until drained."""
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        ctx.log.info("warm start", detail=line)

    ctx.log.info("ensuring the warm model", cache_dir=cfg.cache_dir, steps=cfg.recipe.warmup.steps)
    t0 = trio.current_time()
    # abandoned when cancelled (grace deadline of a shutdown during the build): the build
    # is atomic and locked, so an unfinished one leaves nothing a later start would trust
    path = await trio.to_thread.run_sync(
        lambda: ensure_warm_model(cfg.cache_dir, cfg.recipe, log=say, threads=cfg.threads),
        abandon_on_cancel=True)
    await trio.to_thread.run_sync(point_link, Path(cfg.link), path)
    ctx.report_version("model", path.name)
    ctx.log.info("warm model ready", model_dir=str(path), link=cfg.link,
                 seconds=round(trio.current_time() - t0, 1))
    task_status.started()
    await ctx.wait_draining()

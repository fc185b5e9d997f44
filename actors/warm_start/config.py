"""Settings of the warm-start actor (``[actors.warm_start.config]``)."""

from __future__ import annotations

import msgspec

from fleetrl.actors.recipe import DEFAULT_RECIPE, WarmRecipe

__all__ = ["WarmStartConfig"]


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
    progress: bool = False
    """Show the warm-up on the terminal: whether the model came from the cache, else a
    progress bar of its steps with the loss (stderr)."""

    def __post_init__(self) -> None:
        for name in ("cache_dir", "link"):
            if not getattr(self, name):
                raise ValueError(f"WarmStartConfig.{name} must be a non-empty path")
        if isinstance(self.threads, bool) or self.threads < 1:
            raise ValueError(f"WarmStartConfig.threads must be an int >= 1, got {self.threads!r}")


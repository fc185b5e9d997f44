"""Settings of the repository-task actor (``[actors.repo_tasks.config]``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from fleetrl.harness.task_schema import DEFAULT_IMAGE

__all__ = ["RepoTasksConfig"]


class RepoTasksConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[actors.repo_tasks.config]``."""

    out: str
    """The task file (JSONL) the environment workers read (``tasks = {kind = "jsonl", path = ...}``)."""
    packages: tuple[str, ...] | None = None
    """Package names of the bug file to build (None: every package it declares)."""
    bugs: str | None = None
    """A TOML bug file (docs/guides/tasks.md); None: the one shipped with fleetrl."""
    sdist_dir: str = "~/.cache/fleetrl/sdists"
    """Where sdists are cached; a missing one is downloaded with pip."""
    image: str = DEFAULT_IMAGE
    """The sandbox image of the tasks."""
    validate: bool = True
    """Keep a task only if doing nothing scores 0 and the reference fix scores 1 (in sandboxes)."""
    concurrency: Annotated[int, msgspec.Meta(ge=1)] = 2
    """Sandboxes at once while validating."""

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("RepoTasksConfig.out must be a non-empty path")
        if self.packages is not None and not self.packages:
            raise ValueError("RepoTasksConfig.packages must name at least one package (or be left out: all)")

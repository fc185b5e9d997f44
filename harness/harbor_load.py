"""A Harbor task directory made ready to run: read, turned into a `Task`, and its image
built locally when it needs one (blocking: reads files and talks to Docker).

The one path `fleetrl tasks import-harbor`, the ``harbor`` task source and the Harbor
templates of `fleetrl traces import --template-harbor` / the ingest actor take, so a
task never names an image that was not built. Raises `errors.TaskError` (the directory)
or `sandboxes.harbor_image.HarborImageError` (the build).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fleetrl.sandboxes.harbor_image import HarborImage, ensure_harbor_image

from .harbor import harbor_task_and_plan, read_harbor_dir
from .task_schema import Task

__all__ = ["load_built_harbor_task"]


def load_built_harbor_task(path: str | os.PathLike[str], image_map: Mapping[str, str] | None = None, *,
                           client: Any = None, build: bool = True) -> tuple[Task, HarborImage | None]:
    """The task of the Harbor directory `path` and its image: built (or found already
    built) when `build`, None when not building or when the directory is an unchanged
    ``export-harbor`` one (its task keeps its own image). `client`: a docker client
    (default: one from the environment)."""
    task, plan = harbor_task_and_plan(read_harbor_dir(path), image_map)
    if plan is None or not build:
        return task, None
    if client is None:
        import docker

        client = docker.from_env()
    return task, ensure_harbor_image(plan, client=client)

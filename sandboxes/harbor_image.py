"""Build a Harbor task's image locally, offline: the Docker side of
``fleetrl.harness.harbor`` (which plans the build purely: `BuildPlan`).

Every image a FROM starts from must already be local (``docker image inspect``),
after the task's image mapping (``python:3.11-slim=fleetrl-sandbox:py311``): nothing is
pulled. A missing one is a `HarborImageError` naming the image, the Dockerfile line and
the fix. The build is ``docker build`` of the rewritten Dockerfile (given on stdin)
with the task's environment/ as context, tagged with the plan's content hash; it is
skipped when an image of that tag exists and was built on the same base images (their
ids are kept in the label ``fleetrl.harbor.bases``, so a rebuilt base image rebuilds
the task's). Blocking (call from a thread in async code).
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

import docker
import docker.errors
import msgspec

from .errors import ImageBuildError

__all__ = ["BASES_LABEL", "HarborImage", "HarborImageError", "base_image_ids", "ensure_harbor_image"]

BASES_LABEL = "fleetrl.harbor.bases"
DEFAULT_BUILD_TIMEOUT_S = 600.0
SUGGESTED_BASE = "fleetrl-sandbox:py311"


class HarborImageError(ImageBuildError):
    """A Harbor task's image cannot be had: a base image is not local, or the build failed."""


class HarborImage(msgspec.Struct, frozen=True, kw_only=True):
    tag: str
    built: bool
    """False: an image of this tag, on the same bases, already existed."""
    seconds: float


def base_image_ids(plan: Any, client: docker.DockerClient) -> str:
    """The ids of the plan's base images (comma-separated), each checked to be local."""
    ids = []
    for image in plan.bases:
        try:
            ids.append(client.images.get(image).id)
        except docker.errors.ImageNotFound:
            origin = next((o for o in plan.origins if o.image == image), None)
            where = f"{plan.context_dir}/Dockerfile line {origin.line}: {origin.text!r}" if origin and origin.line \
                else (origin.text if origin else image)
            raise HarborImageError(
                f"base image {image!r} is not available locally ({where}); nothing is pulled. Fix: build or load "
                f"it (docker load / docker build), or map it to a local image: --map-image {image}={SUGGESTED_BASE} "
                f"(image_map in a task source config)") from None
    return ",".join(ids)


def ensure_harbor_image(plan: Any, *, client: docker.DockerClient | None = None, force: bool = False,
                        log: Any = None) -> HarborImage:
    """Build `plan` (a ``harness.harbor.BuildPlan``) unless its tag exists on the same
    bases. The build's limit is the plan's ``timeout_s`` (``[environment].build_timeout_sec``),
    else 600 s; a failure or timeout is a `HarborImageError` with the build output's tail."""
    client = client or docker.from_env()
    t0 = time.monotonic()
    bases = base_image_ids(plan, client)
    if not force:
        try:
            labels = client.images.get(plan.tag).labels or {}
        except docker.errors.ImageNotFound:
            labels = None
        if labels is not None and labels.get(BASES_LABEL) == bases:
            return HarborImage(tag=plan.tag, built=False, seconds=time.monotonic() - t0)
    timeout = plan.timeout_s or DEFAULT_BUILD_TIMEOUT_S
    if log is not None:
        log(f"docker build {plan.tag} (context {plan.context_dir}, limit {timeout:g} s)")
    argv = ["docker", "build", "--quiet", "--tag", plan.tag, "--label", f"{BASES_LABEL}={bases}", "--file", "-",
            plan.context_dir]
    try:
        r = subprocess.run(argv, input=plan.dockerfile.encode(), capture_output=True, timeout=timeout)
    except FileNotFoundError:
        raise HarborImageError("the docker executable is not on PATH") from None
    except subprocess.TimeoutExpired:
        raise HarborImageError(f"docker build {plan.tag} ({plan.context_dir}) ran past its build_timeout_sec "
                               f"of {timeout:g} s") from None
    if r.returncode != 0:
        tail = (r.stderr or b"")[-3000:].decode(errors="replace")
        raise HarborImageError(f"docker build {plan.tag} ({plan.context_dir}) exited {r.returncode}: {tail}")
    return HarborImage(tag=plan.tag, built=True, seconds=time.monotonic() - t0)

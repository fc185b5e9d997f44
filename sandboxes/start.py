"""Start a sandbox: create and start one container with the ``Limits`` enforced and the
ownership labels set (``start_sandbox``), or hold one for an ``async with``
(``open_sandbox``). A start that fails or is cancelled after the container exists
removes it (shielded) before the error escapes, so starting never leaks a container.
"""

from __future__ import annotations

import docker
import docker.errors

from .errors import SandboxStartError
from .limits import DEFAULT_LIMITS, Limits, host_config_kwargs
from .metrics import SandboxMetrics
from .programs import KEEPER_ARGV
from .sandbox import Sandbox
from .sweep import Ownership
from .transport import Engine, remove_container

__all__ = ["start_sandbox", "open_sandbox"]


async def start_sandbox(
    engine: Engine,
    *,
    image: str,
    limits: Limits = DEFAULT_LIMITS,
    ownership: Ownership,
    metrics: SandboxMetrics | None = None,
) -> Sandbox:
    """Create and start one sandbox container. If this is cancelled or fails after the
    container exists, the container is removed (shielded) before the error escapes."""
    api = engine.api
    cid: str | None = None
    try:
        try:
            hc = api.create_host_config(**host_config_kwargs(limits))
            cid = (
                await engine.call(
                    api.create_container,
                    image,
                    command=KEEPER_ARGV,
                    user=limits.user,
                    working_dir=limits.workdir,
                    labels=ownership.labels(),
                    host_config=hc,
                    network_disabled=limits.network == "none",
                    stop_signal="SIGKILL",
                )
            )["Id"]
            await engine.call(api.start, cid)
        except docker.errors.ImageNotFound as e:
            raise SandboxStartError(
                f"image {image!r} not found locally: build it with `fleetrl sandbox build-image` or name a local image"
            ) from e
        except docker.errors.APIError as e:
            raise SandboxStartError(f"starting a sandbox of image {image!r} failed: {e.explanation or e}") from e
    except BaseException:
        if cid is not None:
            try:
                await remove_container(engine, cid)  # shielded: even when this start is cancelled
            except docker.errors.APIError:
                pass  # left for the sweep: it carries our labels
        raise
    if metrics is not None:
        metrics.on_created()
    return Sandbox(engine, cid, image=image, limits=limits, metrics=metrics)


class open_sandbox:
    """``async with open_sandbox(engine, image=..., ownership=...) as sb``: one fresh
    container, removed on exit (no pool)."""

    def __init__(self, engine: Engine, *, image: str, limits: Limits = DEFAULT_LIMITS, ownership: Ownership, metrics=None):
        self._args = dict(image=image, limits=limits, ownership=ownership, metrics=metrics)
        self._engine = engine
        self._sb: Sandbox | None = None

    async def __aenter__(self) -> Sandbox:
        self._sb = await start_sandbox(self._engine, **self._args)
        return self._sb

    async def __aexit__(self, *exc: object) -> None:
        assert self._sb is not None
        await self._sb.aclose()

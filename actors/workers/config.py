"""Typed settings of the remote workers actor (``[actors.NAME.config]``).

The environment worker's own settings (`EnvWorkerConfig`: tasks, harness, model,
group size, retries, sandbox limits), which every remote worker runs its attempts under,
plus how workers join. The model must be the sampler pool (``model.kind = "pool"``):
remote workers call it through their connection.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from fleetrl.actors.envworker.config import EXTERNAL, EnvWorkerConfig, PoolModel

__all__ = ["RemoteWorkersConfig"]


class RemoteWorkersConfig(EnvWorkerConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`EnvWorkerConfig` and the join endpoint (docs/guides/remote-workers.md)."""

    join_prefix: Annotated[str, msgspec.Meta(pattern=r"^/[A-Za-z0-9_/-]+$")] = "/workers"
    """Where the join endpoint is mounted on the control plane: ``<prefix>/join``."""
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0.0, le=60.0)] = 2.0
    heartbeat_timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=600.0)] = 10.0
    """A worker silent this long is lost: its unfinished tasks go to other workers."""
    ship_harness: Literal["auto", "import", "pickle"] = "auto"
    """How the harness reaches workers (`shipping`): ``import`` (its import path; the
    module must be installed on every worker host), ``pickle`` (the object, signed, over
    TLS only), ``auto``: by import path for fleetrl's own harnesses, else pickled."""
    max_tokenizer_mb: Annotated[float, msgspec.Meta(gt=0.0, le=1024.0)] = 64.0
    """Largest tokenizer (its files together) sent to workers in their welcome."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.harness == EXTERNAL:
            raise ValueError('harness = "external" is not supported on remote workers yet: run the external '
                             "harness in the daemon's own environment worker (fleetrl.actors.envworker:run)")
        if not isinstance(self.model, PoolModel):
            raise ValueError('model.kind must be "pool": remote workers call the sampler pool through their '
                             "connection to the daemon")
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ValueError(f"heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed "
                             f"heartbeat_s={self.heartbeat_s}")

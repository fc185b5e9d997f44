"""Typed settings of the remote workers actor (``[actors.NAME.config]``).

The environment worker's own settings (`EnvWorkerConfig`: tasks, harness, model,
group size, retries, sandbox limits), which every remote worker runs its attempts under,
plus how workers join. The model must be the sampler pool (``model.kind = "pool"``):
remote workers call it through their connection. With ``harness = "external"`` each
worker serves its command an OpenAI-compatible endpoint of its own (``endpoint_config``)
that answers through that connection.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from fleetrl.actors.envworker.config import EXTERNAL, EnvWorkerConfig, PoolModel
from fleetrl.harness.openai_request import EndpointConfig

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
    endpoint_config: EndpointConfig = EndpointConfig()
    """With ``harness = "external"``: how the OpenAI-compatible endpoint each worker serves
    its command on 127.0.0.1 answers (``model_name``, ``context_length``, limits: the
    endpoint actor's settings, docs/reference/openai-endpoint.md)."""

    def _check_harness_and_model(self) -> None:
        if not isinstance(self.model, PoolModel):
            raise ValueError('model = {kind = "pool", ...} is required: remote workers call the sampler pool '
                             "through their connection to the daemon")
        if self.endpoint is not None:
            raise ValueError(f"endpoint = {self.endpoint!r} is not used by remote workers: each serves the external "
                             "command an endpoint of its own (endpoint_config)")
        if self.harness == EXTERNAL:
            self.external_command()
            if self.ship_harness == "pickle":
                raise ValueError('ship_harness = "pickle" does not apply to harness = "external" (a command, '
                                 "not code: it travels as its argv)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heartbeat_timeout_s <= self.heartbeat_s:
            raise ValueError(f"heartbeat_timeout_s={self.heartbeat_timeout_s} must exceed "
                             f"heartbeat_s={self.heartbeat_s}")

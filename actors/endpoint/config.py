"""Settings of the endpoint actor (``[actors.NAME.config]``; docs/reference/openai-endpoint.md)."""

from __future__ import annotations

from fleetrl.actors.envworker.config import LocalModel, PoolModel
from fleetrl.harness.openai_api import EndpointConfig

__all__ = ["EndpointActorConfig"]


class EndpointActorConfig(EndpointConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of the endpoint actor (``[actors.NAME.config]``; see docs/reference/openai-endpoint.md):
    ``model``, and every setting of the endpoint itself (`EndpointConfig`: ``model_name``,
    ``context_length``, ``default_max_tokens``, ``max_body_bytes``, ``max_n``,
    ``max_concurrent_calls_per_attempt``, ``max_waiting_calls``, ``sampling``: the sampling
    policy, `fleetrl.harness.sampling_policy.SamplingPolicy`), checked at load time."""

    model: LocalModel | PoolModel
    """``{kind = "local", model_dir = ...}`` or ``{kind = "pool", pool = "pool", tokenizer_dir = ...}``."""

    def endpoint_config(self) -> EndpointConfig:
        """The endpoint's own settings (without ``model``)."""
        return EndpointConfig(**{f: getattr(self, f) for f in EndpointConfig.__struct_fields__})

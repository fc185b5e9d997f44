"""Settings of the endpoint actor (``[actors.NAME.config]``; docs/reference/openai-endpoint.md)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from fleetrl.actors.envworker.config import LocalModel, PoolModel
from fleetrl.harness.openai_api import EndpointConfig

__all__ = ["EndpointActorConfig"]

PosInt = Annotated[int, msgspec.Meta(ge=1)]


class EndpointActorConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of the endpoint actor (``[actors.NAME.config]``; see docs/reference/openai-endpoint.md)."""

    model: LocalModel | PoolModel
    """``{kind = "local", model_dir = ...}`` or ``{kind = "pool", pool = "pool", tokenizer_dir = ...}``."""
    model_name: str = "fleetrl"
    """The one model id served (requests naming another get 404)."""
    context_length: PosInt = 4096
    default_max_tokens: PosInt = 512
    max_body_bytes: PosInt = 8 << 20

    def __post_init__(self) -> None:
        self.endpoint_config()  # its checks, at load time

    def endpoint_config(self) -> EndpointConfig:
        return EndpointConfig(model_name=self.model_name, context_length=self.context_length,
                              default_max_tokens=self.default_max_tokens, max_body_bytes=self.max_body_bytes)

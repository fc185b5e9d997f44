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
    """Larger request bodies get 413."""
    max_concurrent_calls_per_attempt: PosInt = 8
    """Calls of one attempt in flight at once; the next gets 429 ``too_many_concurrent_calls``."""
    max_waiting_calls: PosInt = 256
    """Calls of all attempts waiting for the model at once; the next gets 429 ``endpoint_busy``."""

    def __post_init__(self) -> None:
        self.endpoint_config()  # its checks, at load time

    def endpoint_config(self) -> EndpointConfig:
        return EndpointConfig(model_name=self.model_name, context_length=self.context_length,
                              default_max_tokens=self.default_max_tokens, max_body_bytes=self.max_body_bytes,
                              max_concurrent_calls_per_attempt=self.max_concurrent_calls_per_attempt,
                              max_waiting_calls=self.max_waiting_calls)

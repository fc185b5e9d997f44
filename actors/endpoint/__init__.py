"""The endpoint actor (``fleetrl.actors.endpoint:run``): the OpenAI-compatible,
token-recording endpoint on the daemon's control plane (docs/reference/openai-endpoint.md)."""

from .actor import PREFIX, EndpointHandle, EndpointStatistics, Inbox, base_url_of, client_host, run
from .config import EndpointActorConfig

__all__ = ["PREFIX", "EndpointActorConfig", "EndpointHandle", "EndpointStatistics", "Inbox", "base_url_of",
           "client_host", "run"]

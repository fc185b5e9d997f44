"""The sandbox janitor actor (``fleetrl.actors.sandbox_janitor:run``)."""

from .actor import Inbox, JanitorHandle, JanitorStatistics, run
from .config import JanitorConfig

__all__ = ["Inbox", "JanitorConfig", "JanitorHandle", "JanitorStatistics", "run"]

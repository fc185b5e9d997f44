"""The warm-start actor (``fleetrl.actors.warm_start:run``)."""

from .actor import Inbox, WarmStartHandle, WarmStartStatistics, point_link, run
from .config import WarmStartConfig

__all__ = ["Inbox", "WarmStartConfig", "WarmStartHandle", "WarmStartStatistics", "point_link", "run"]

"""The weights mirror actor (``fleetrl.actors.weights_mirror:run``): copies each
published version into an S3-compatible bucket for followers far from the daemon."""

from .actor import Inbox, MirrorHandle, MirrorActorStatistics, run
from .config import WeightsMirrorConfig

__all__ = ["Inbox", "MirrorActorStatistics", "MirrorHandle", "WeightsMirrorConfig", "run"]

"""fleetrl.actors.tracker: a run's step scalars and report plots in W&B or trackio
(``fleetrl.actors.tracker:run``; docs/guides/trackers.md)."""

from .actor import Inbox, TrackerHandle, TrackerState, TrackerStatistics, run
from .config import TrackerConfig
from .scalars import scalars_of

__all__ = ["Inbox", "TrackerConfig", "TrackerHandle", "TrackerState", "TrackerStatistics", "run", "scalars_of"]

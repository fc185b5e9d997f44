"""The heartbeat actor (``fleetrl.daemon.ticker:run``): the kernel's own small workload."""

from .actor import Inbox, TickerHandle, TickerState, TickerStatistics, run
from .config import TickerConfig

__all__ = ["Inbox", "TickerConfig", "TickerHandle", "TickerState", "TickerStatistics", "run"]

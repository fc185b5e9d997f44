"""fleetrl.actors.dashboard: the live dashboard served by the daemon (``/ui``;
docs/guides/dashboard.md). Pure: `snapshot` (what the page shows), `sessions` (log-in);
`app` (the routes), `actor` (``fleetrl.actors.dashboard:run``); the page in ``static/``."""

from .actor import DashboardHandle, DashboardStatistics, Inbox, run
from .config import DashboardConfig

__all__ = ["DashboardConfig", "DashboardHandle", "DashboardStatistics", "Inbox", "run"]

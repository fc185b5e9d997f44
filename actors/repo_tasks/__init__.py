"""The repository-task actor (``fleetrl.actors.repo_tasks:run``)."""

from .actor import Inbox, RepoTasksHandle, RepoTasksStatistics, run
from .config import RepoTasksConfig

__all__ = ["Inbox", "RepoTasksConfig", "RepoTasksHandle", "RepoTasksStatistics", "run"]

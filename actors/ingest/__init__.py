"""The ingest actor (``fleetrl.actors.ingest:run``): trace files in while the daemon runs,
over ``POST /v1/traces`` or a watched directory, into a durable task store that
environment workers read (docs/guides/ingest.md)."""

from .actor import PREFIX, IngestHandle, IngestStatistics, Inbox, Ingested, run
from .config import IngestConfig
from .parse import FORMATS, ParseOptions, Problem, parse
from .store import StoredTask, StoreError, StoreReader, TaskStore, task_key

__all__ = ["FORMATS", "PREFIX", "Inbox", "IngestConfig", "IngestHandle", "IngestStatistics", "Ingested",
           "ParseOptions", "Problem", "StoreError", "StoreReader", "StoredTask", "TaskStore", "parse", "run",
           "task_key"]

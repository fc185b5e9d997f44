"""fleetrl.actors.envworker: environment workers (tasks -> attempts in sandboxes -> rollout groups).

Pure logic: `policy` (failure kinds, retry bounds), `group` (G attempts -> one group or
typed failures), `cursor` (checkpointed task position). I/O around it: `sources` (task
sources), `model` (model clients: a local torch backend, or the sampler pool),
`sandboxing` (lazy leases, group scoring with one ``exec_many``), `attempt` (one
attempt: lease, harness, score), `pacing` (groups through the pool's staleness pacer),
`harnesses` (loading a harness), `worker` (the task loop), `fleet_row` (a worker and its
sandboxes as /status shows them), `actor` (the actor
``fleetrl.actors.envworker:run``). docs/reference/envworkers.md is the guide.
"""

from .config import (
    EnvWorkerConfig,
    HumanEvalTasks,
    JsonlTasks,
    LocalModel,
    PoolModel,
    SandboxSettings,
    SyntheticTasks,
    ToolLookupTasks,
)
from .cursor import CursorState, TaskCursor
from .fleet_row import WorkerRow
from .group import AttemptTicket, GroupResult, GroupStateError, GroupTracker
from .actor import Inbox, run
from .attempt import Failed, sandbox_limits
from .harnesses import load_harness
from .model import LocalModelClient, PoolModelClient, open_model
from .policy import DEFAULT_MAX_TRIES, FAILURE_KINDS, RetryPolicy
from .worker import EnvWorkerStatistics, group_id_of

__all__ = ["DEFAULT_MAX_TRIES", "FAILURE_KINDS", "AttemptTicket", "CursorState", "EnvWorkerConfig",
           "EnvWorkerStatistics", "Failed", "Inbox", "open_model",
           "GroupResult", "GroupStateError", "GroupTracker", "HumanEvalTasks", "JsonlTasks", "LocalModel",
           "LocalModelClient", "PoolModel", "PoolModelClient", "RetryPolicy", "SandboxSettings",
           "SyntheticTasks", "TaskCursor", "ToolLookupTasks", "WorkerRow", "group_id_of", "load_harness", "run",
           "sandbox_limits"]

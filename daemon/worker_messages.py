"""The `WORKERS` conversation: a remote environment worker's one connection to the daemon.

One binary WebSocket message = one msgpack message of this closed union (`protocol`):

1. worker -> daemon: `WorkerJoin` (token, protocol, how many groups it runs at once).
   Answered by `Refused` (a bad token, an old protocol) or `WorkerWelcome`: the worker's
   id, the run, the settings every attempt runs under (an `EnvWorkerConfig` as msgpack),
   the tokenizer files, and the key that signs the harness.
2. daemon -> worker: `HarnessShipped`: the harness, by import path or as cloudpickle
   bytes, with an HMAC-SHA256 over it under the key of step 1. A worker unpickles only a
   signed payload received over TLS.
3. worker -> daemon: a first `Heartbeat` once the harness loaded and its sandboxes are
   ready; only then do tasks come. daemon -> worker: `TaskAssigned` (the task number and the task as msgpack); worker
   -> daemon: `RolloutGroup`, `RolloutFailed` and `TaskEnded` (how the group ended);
   model calls as `GenerateRequest`, answered with `TokenChunk`s, then `Generation` or
   `GenerateFailed` (the sampler pool's own messages, in the other direction).
4. both ways: `Heartbeat` at least every ``heartbeat_s``; `Leave` or a closed
   connection ends it, and the daemon gives the worker's unfinished tasks to others.
   worker -> daemon: `WorkerLoad` with each heartbeat (what it runs now, for the
   dashboard's environment workers table).

Evolution: append fields with defaults only (`protocol`).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .messages import (Generation, GenerateFailed, GenerateRequest, Heartbeat, Leave, Refused, RolloutFailed,
                       RolloutGroup, TokenChunk)
from .protocol import PROTOCOL_VERSION, Codec, Message

__all__ = ["WORKERS", "HarnessShipped", "TaskAssigned", "TaskEnded", "WorkerJoin", "WorkerLoad", "WorkerWelcome"]

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class WorkerJoin(Message):
    """A remote environment worker asks to join; the first message on its connection."""

    token: str
    name: str = ""
    """Shown in the daemon's logs (the daemon assigns the worker id)."""
    protocol: NonNegInt = PROTOCOL_VERSION
    groups: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 2
    """Groups (tasks) the worker runs at once: the daemon never assigns more."""

    def __repr__(self) -> str:  # never print the credential
        return f"WorkerJoin(token='***', name={self.name!r}, protocol={self.protocol!r}, groups={self.groups!r})"


class WorkerWelcome(Message):
    """The daemon accepts a `WorkerJoin`."""

    worker_id: str
    run_id: str
    actor: str
    """The daemon's worker actor: group ids are ``<task>#<number>@<actor>`` whichever
    worker runs the task, so a task run again after a worker died is a duplicate."""
    protocol: NonNegInt
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0.0)]
    settings: bytes
    """The environment worker settings (`EnvWorkerConfig`, msgpack) every attempt runs under."""
    tokenizer: dict[str, bytes]
    """The tokenizer's files by name (config, vocabulary, chat template; no weights)."""
    harness_key: bytes
    """The HMAC-SHA256 key that signs `HarnessShipped` on this connection."""

    def __repr__(self) -> str:  # never print the key
        return (f"WorkerWelcome(worker_id={self.worker_id!r}, run_id={self.run_id!r}, actor={self.actor!r}, "
                f"files={sorted(self.tokenizer)!r})")


class HarnessShipped(Message):
    """The harness every attempt runs: an import path (with its config, JSON) the worker
    loads itself, or a cloudpickled object; ``mac`` signs ``kind``, ``ref`` and ``payload``."""

    kind: Literal["import", "pickle"]
    ref: str
    """``module:attribute`` (``import``), or what the pickled object was loaded from."""
    payload: bytes
    """``import``: the harness config as JSON; ``pickle``: the cloudpickle bytes."""
    mac: bytes


class TaskAssigned(Message):
    """Run task number ``index`` (one group of ``group_size`` attempts)."""

    index: NonNegInt
    task: bytes
    """The `Task` as msgpack (validated by the worker when it decodes it)."""


class TaskEnded(Message):
    """How the group of task number ``index`` ended on the worker. ``finished``: its
    `RolloutGroup` was sent before this, or too many attempts failed (the task is done
    either way); ``abandoned``: it could not finish (the daemon runs it again)."""

    index: NonNegInt
    outcome: Literal["finished", "abandoned"]


class WorkerLoad(Message):
    """What a worker runs now: its attempts, and its host's sandbox containers (warm: idle
    and reset, ready for a lease; leased: held by attempts)."""

    attempts_running: NonNegInt
    sandboxes_warm: NonNegInt | None = None
    sandboxes_leased: NonNegInt | None = None


WORKERS = Codec(
    "workers",
    [WorkerJoin, WorkerWelcome, HarnessShipped, TaskAssigned, TaskEnded, Refused, Heartbeat, Leave,
     RolloutGroup, RolloutFailed, GenerateRequest, Generation, GenerateFailed, TokenChunk, WorkerLoad],
    error_reply=True,
)

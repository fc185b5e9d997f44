"""One environment worker as ``/status`` shows it (`WorkerRow`): the ``worker_rows`` of
the statistics of an environment worker actor (one row: itself) and of the remote workers
actor (one per worker that joined; the latest that left are kept, marked ``left`` or
``lost``). The dashboard's "Environment workers" table lists them.

`sandbox_counts` reads a sandbox pool's warm and leased containers from its
``statistics()`` (`sandboxes.PoolStatistics`); a pool without one (a test's fake) has
none to report.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["HEALTH", "WorkerRow", "sandbox_counts"]

HEALTH = ("up", "joining", "draining", "left", "lost")
"""A row's ``health``: ``up`` (running groups, or ready to); ``joining`` (a remote worker
connected and not yet ready: its harness and sandboxes are being set up); ``draining``
(the daemon is shutting down); ``left`` (a remote worker that said so) or ``lost`` (one
whose connection broke or fell silent)."""


class WorkerRow(msgspec.Struct, frozen=True, kw_only=True):
    """One environment worker and its sandboxes."""

    worker: str
    """The actor's name (an environment worker of the daemon) or the worker id the remote
    workers actor gave it (``worker-3``)."""
    host: str
    """Where it runs: the daemon's host name, or the name a remote worker joined with (its
    host name unless ``fleetrl worker --name``)."""
    remote: bool
    address: str = ""
    """A remote worker's address as the daemon sees it (``IP:PORT``)."""
    attempts_running: int | None = None
    """Attempts running now (None: a remote worker does not report it)."""
    groups_running: int = 0
    """Groups (tasks) it holds now."""
    groups: dict[str, int] = {}
    """Groups that ended, by outcome: ``emitted`` (sent to the trainer), ``incomplete``
    (too many failed attempts), ``abandoned`` (its task runs again: shutdown, or a remote
    worker gave it up or was lost holding it)."""
    failures: dict[str, int] = {}
    """Failed attempts by kind (`policy.FAILURE_KINDS`), retried ones included."""
    sandboxes_warm: int | None = None
    """Idle, reset containers ready for a lease (None: not reported; a remote worker's
    sandboxes are on its own host)."""
    sandboxes_leased: int | None = None
    """Containers leased to attempts now (None: not reported)."""
    sandboxes_limit: int = 0
    """The most containers it may own at once (``sandbox.max_containers``)."""
    health: str = "up"
    """One of `HEALTH`."""
    last_seen_s: float | None = None
    """Seconds since a remote worker's last message (None: a worker of the daemon)."""
    ended: str | None = None
    """Why a remote worker's connection ended (``left`` and ``lost`` rows)."""


def sandbox_counts(pool: Any) -> tuple[int | None, int | None]:
    """``(warm, leased)`` containers of a sandbox pool; ``(None, None)`` without its statistics."""
    statistics = getattr(pool, "statistics", None)
    if statistics is None:
        return None, None
    try:
        s = statistics()
        return int(s.idle), int(s.leases_active)
    except (AttributeError, TypeError, ValueError):
        return None, None

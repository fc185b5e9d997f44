"""Errors of the runtime kernel, named after who broke things.

`DaemonError` (a `FleetrlError`, the project's one root in errors.py) is the root
of the kernel's own errors: the CLI catches it, prints its message and exits with
`exit_code`. Each subclass says whose fault it is:
the config file's, another process holding the state directory, an actor
that crashed too often, or a damaged checkpoint on disk.
"""

from __future__ import annotations

import enum

from .errors import FleetrlError


class ExitCode(enum.IntEnum):
    """Process exit codes of `fleetrl` commands (documented in docs/guides/daemon.md)."""

    OK = 0
    #: an actor exceeded its restart intensity; the daemon stopped
    ESCALATED = 1
    #: bad config file or command line (same code argparse uses)
    CONFIG = 2
    #: the state directory is locked by another live daemon
    LOCKED = 3
    #: a second SIGTERM/SIGINT forced the daemon out without a final checkpoint
    FORCED = 4
    #: `fleetrl status` / `stop` found no live daemon or could not reach it
    UNREACHABLE = 5
    #: shutdown was clean but the final checkpoint could not be written
    CHECKPOINT_FAILED = 6
    #: an actor halted the run on an error it cannot go on past (``ctx.halt``)
    HALTED = 7


class DaemonError(FleetrlError):
    """Root of every error the kernel raises on purpose."""

    exit_code: ExitCode = ExitCode.ESCALATED


class ConfigError(DaemonError):
    """The config file (or a value in it) is wrong.

    `str(err)` is the one clear message: ``FILE:LINE: key.path: what is wrong``
    (LINE omitted when the key has no line, e.g. a missing table).
    """

    exit_code = ExitCode.CONFIG

    def __init__(self, message: str, *, file: str | None = None,
                 key: str | None = None, line: int | None = None) -> None:
        self.file = file
        self.key = key
        self.line = line
        self.detail = message
        where = ""
        if file is not None:
            where = f"{file}:{line}: " if line is not None else f"{file}: "
        what = f"{key}: " if key else ""
        super().__init__(f"{where}{what}{message}")


class StateDirLocked(DaemonError):
    """Another live daemon holds `daemon.lock` of this state directory."""

    exit_code = ExitCode.LOCKED


class WrongHandle(DaemonError, TypeError):
    """An actor asked for another's handle as a kind it is not (``ctx.handle(name, kind)``):
    the config names the wrong actor (e.g. a trainer where a sampler pool belongs)."""


class ActorEscalated(DaemonError):
    """An actor crashed more often than its restart intensity allows."""

    exit_code = ExitCode.ESCALATED

    def __init__(self, actor: str, restarts: int, period_s: float, last_error: str) -> None:
        self.actor = actor
        self.last_error = last_error
        super().__init__(
            f"actor {actor!r} crashed {restarts} times within {period_s:g}s; "
            f"giving up. Last error: {last_error}"
        )


class CheckpointCorrupt(DaemonError):
    """A checkpoint file is truncated, has a bad checksum or cannot be decoded."""

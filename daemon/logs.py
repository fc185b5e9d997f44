"""structlog set-up: JSON lines in service mode, readable output on a terminal.

Every line carries ``run_id`` and ``actor``: the supervisor binds ``actor`` into the
context of each actor's Trio task (Trio copies context variables into child tasks),
so even a plain ``structlog.get_logger()`` inside an actor is labelled; lines from
outside any actor say ``actor="daemon"``. In service mode the same JSON lines are
also appended to ``<state>/logs/daemon.jsonl`` (rotated to ``daemon.jsonl.1`` at
start once it passes `ROTATE_BYTES`).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import structlog

__all__ = ["close_logging", "configure_logging", "service_mode"]

ROTATE_BYTES = 64 * 1024 * 1024
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def service_mode(fmt: str, stream: TextIO | None = None) -> bool:
    """JSON output unless asked for console, or auto on a terminal."""
    stream = stream or sys.stderr
    if fmt == "json":
        return True
    if fmt == "console":
        return False
    return not (hasattr(stream, "isatty") and stream.isatty())


class _Defaults:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("run_id", self.run_id)
        event.setdefault("actor", "daemon")
        return event


class _ConsoleFilter:
    """Drops events below ``minimum`` from the stream (after the file sink has them)."""

    def __init__(self, minimum: int) -> None:
        self.minimum = minimum

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        if _LEVELS.get(str(event.get("level", "info")), logging.INFO) < self.minimum:
            raise structlog.DropEvent
        return event


#: ``[logging] console``: which lines also go to the stream
CONSOLE_MINIMUM = {"all": 0, "warnings": logging.WARNING, "none": logging.CRITICAL + 1}


class _JsonFile:
    """Appends each event as one JSON line to a file, then passes it on."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size > ROTATE_BYTES:
            path.replace(path.with_name(path.name + ".1"))
        self._fh = open(path, "a", encoding="utf-8", buffering=1)

    def __call__(self, _logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        if not self._fh.closed:
            self._fh.write(json.dumps(event, default=str) + "\n")
        return event

    def close(self) -> None:
        self._fh.close()


_open_files: list[_JsonFile] = []


def close_logging() -> None:
    """Close the log file opened by `configure_logging` (lines after this go only
    to the stream)."""
    while _open_files:
        _open_files.pop().close()


def configure_logging(*, level: str = "info", fmt: str = "auto", run_id: str = "-",
                      log_dir: Path | None = None, stream: TextIO | None = None,
                      console: str = "all") -> bool:
    """Configure structlog for this process; returns True in service (JSON) mode.

    ``console``: "all" lines, only "warnings" (and errors), or "none" also go to the
    stream; the file (``log_dir``) always gets every line of ``level`` and above."""
    stream = stream or sys.stderr
    close_logging()
    json_mode = service_mode(fmt, stream)
    file_sink = None
    if log_dir is not None:
        file_sink = _JsonFile(log_dir / "daemon.jsonl")
        _open_files.append(file_sink)
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _Defaults(run_id),
    ]
    if json_mode:
        processors.append(structlog.processors.dict_tracebacks)
        if file_sink is not None:
            processors.append(file_sink)
        if CONSOLE_MINIMUM[console]:
            processors.append(_ConsoleFilter(CONSOLE_MINIMUM[console]))
        processors.append(structlog.processors.JSONRenderer(default=str))
    else:
        if file_sink is not None:
            processors.append(file_sink)
        if CONSOLE_MINIMUM[console]:
            processors.append(_ConsoleFilter(CONSOLE_MINIMUM[console]))
        colors = hasattr(stream, "isatty") and stream.isatty()
        processors.append(structlog.dev.ConsoleRenderer(colors=colors))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    return json_mode

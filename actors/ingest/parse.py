"""A trace file's bytes -> tasks and problems (pure apart from loading a template).

`parse` is the one dispatch on the format:

* ``"fleetrl"``: our own trace lines (`fleetrl.harness.traces.tasks_from_traces`): each
  line carries its workspace and grader, no template is needed;
* ``"atif"``, ``"mini-swe-agent"``, ``"openai-log"`` and ``"auto"`` (sniffed): read by
  `fleetrl.harness.trace_import.read_sessions` and turned into tasks on a template task
  by `tasks_from_sessions` (a recorded session says nothing of sandbox or grader).
  ``"auto"`` that sniffs ``"fleetrl"`` goes the first way.

Every entry that makes no task is one `Problem` naming where it is (``where:line`` or
``where``), the field at fault and why; the others become tasks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from fleetrl.harness.tasks import Task

__all__ = ["FORMATS", "ParseOptions", "Problem", "parse"]

FORMATS = ("fleetrl", "atif", "mini-swe-agent", "openai-log", "auto")
"""Accepted ``fmt`` values (``auto``: sniffed from the content)."""


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of the input that made no task."""

    where: str
    """``NAME:LINE`` for a line-oriented input, else the input's name."""
    field: str = ""
    """The field at fault, a dotted path in the input (``""``: the whole entry)."""
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.field}: {self.reason}" if self.field else f"{self.where}: {self.reason}"


class ParseOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How sessions become tasks (the query parameters of ``POST /v1/traces``)."""

    template: Task | None = None
    """The template task (workspace, grader) of the session formats; unused for ``fleetrl``."""
    template_name: str = ""
    from_turn: int | None = None
    at: str = "first"
    only_failed: bool = False
    fail_below: float = 1.0


def parse(body: bytes, fmt: str, where: str, options: ParseOptions | None = None) -> tuple[list[Task], list[Problem]]:
    """The tasks of ``body`` (a trace file's content, named ``where``) read as ``fmt``,
    and one `Problem` per unusable entry. Raises ``ValueError`` for an unknown format,
    bad options, or a session format without a template (the request is wrong, not an
    entry of it)."""
    options = options or ParseOptions()
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r} (expected one of {', '.join(FORMATS)})")
    if fmt == "auto":
        fmt = _sniff(body) or "auto"
    if fmt == "fleetrl":
        return _fleetrl(body, where, options)
    return _sessions(body, fmt, where, options)


def _sniff(body: bytes) -> str | None:
    try:
        from fleetrl.harness.trace_import import sniff_format
    except ImportError:
        return "fleetrl"  # only our own format can be read without trace_import
    return sniff_format(body)


def _fleetrl(body: bytes, where: str, options: ParseOptions) -> tuple[list[Task], list[Problem]]:
    from fleetrl.harness.traces import tasks_from_traces

    if options.at != "first":
        raise ValueError(f"at={options.at!r} is only for the session formats; use from_turn with format=fleetrl")
    result = tasks_from_traces(body.splitlines(), file=where, only_failed=options.only_failed,
                               from_turn=options.from_turn or 0, fail_below=options.fail_below)
    problems = [Problem(where=f"{where}:{s.line}", field=s.field,
                        reason=s.reason + (f" (trace {s.trace_id!r})" if s.trace_id else ""))
                for s in result.report.skipped]
    return list(result.tasks), problems


def _sessions(body: bytes, fmt: str, where: str, options: ParseOptions) -> tuple[list[Task], list[Problem]]:
    try:
        from fleetrl.harness import trace_import
    except ImportError as err:
        raise ValueError(f"format {fmt!r} needs fleetrl.harness.trace_import, which cannot be imported: "
                         f"{err}") from None
    read: Any = trace_import.read_sessions(body, fmt, where)
    problems = [Problem(where=p.where, field=p.field, reason=p.reason) for p in read.problems]
    if not read.sessions:
        return [], problems
    if read.format == "fleetrl":  # sniffed as our own lines
        return _fleetrl(body, where, options)
    if options.template is None:
        raise ValueError(f"format {read.format or fmt!r} needs a template task (its workspace and grader): "
                         "pass template=NAME (one of the ingest actor's templates) or configure "
                         "default_template")
    imported = trace_import.tasks_from_sessions(read.sessions, template=options.template,
                                                from_turn=options.from_turn, at=options.at,  # type: ignore[arg-type]
                                                only_failed=options.only_failed, fail_below=options.fail_below)
    problems += [Problem(where=s.ref, field=s.field, reason=f"{s.reason} (session {s.session_id!r})")
                 for s in imported.report.skipped]
    return list(imported.tasks), problems


def load_template(spec: str, image_map: Mapping[str, str] | None = None) -> Task:
    """The template named by an ingest actor's ``templates`` entry: ``FILE`` or ``FILE:ID``
    (a task JSONL file) or ``harbor:DIR`` (a Harbor task directory, its image built
    locally with `image_map`). Raises ``ValueError``."""
    from fleetrl.harness import trace_import

    if spec.startswith("harbor:"):
        return trace_import.load_template_harbor(spec[len("harbor:"):], image_map)
    return trace_import.load_template(spec)

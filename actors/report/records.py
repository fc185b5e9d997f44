"""Reading a run's logs: the trainer's ``metrics.jsonl`` and the evaluator's ``eval.jsonl``.

Both are JSON Lines written one object per line while the run goes. A crashed run can
leave its *last* line cut short: a final line without a terminating newline that does
not parse is dropped (``truncated`` says so). Any other line that is not a valid record
(bad JSON, wrong type, out of range, blank) is refused with a `ReportInputError` naming
``file:line`` and what is wrong, because a report that silently skipped the middle of a
run would misrepresent it.

Pure apart from reading the given files.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from fleetrl.actors.evaluator.records import EvalRecord
from fleetrl.actors.trainer.step import MismatchFigures, StepMetrics

from .errors import ReportInputError

__all__ = [
    "EvalRow", "Log", "ReportInputError", "parse_evals", "parse_metrics",
    "read_evals", "read_metrics",
]

T = TypeVar("T")


EvalRow = EvalRecord
"""One held-out evaluation: the evaluator's own record type (one line of ``eval.jsonl``;
extra keys are ignored)."""


class Log(msgspec.Struct, frozen=True, kw_only=True):
    """The records of one file, in file order."""

    path: str
    rows: tuple[Any, ...] = ()
    truncated: bool = False
    """The last line was cut short (a crashed writer) and was left out."""


def _check_eval(row: EvalRow) -> str | None:
    if row.n < 0 or not 0 <= row.passed <= row.n:
        return f"need 0 <= passed <= n, got passed={row.passed} n={row.n}"
    for name in ("pass_at_1", "ci_low", "ci_high", "mean_reward"):
        v = getattr(row, name)
        if not 0.0 <= v <= 1.0:  # also refuses NaN
            return f"{name} must be in [0, 1], got {v!r}"
    if not row.ci_low <= row.ci_high:
        return f"need ci_low <= ci_high, got [{row.ci_low!r}, {row.ci_high!r}]"
    if row.version < 0 or row.step < 0:
        return f"version and step must be >= 0, got version={row.version} step={row.step}"
    return None


def _eval_row(raw: dict[str, Any]) -> EvalRow:
    row = msgspec.convert(raw, EvalRow)
    problem = _check_eval(row)
    if problem:
        raise msgspec.ValidationError(problem)
    return row


_FIELDS = msgspec.structs.fields(StepMetrics)
_FLOATS = frozenset(f.name for f in _FIELDS if f.type is float)
_FLOAT_MAPS = frozenset(f.name for f in _FIELDS if f.type == dict[str, float])
_FIGURE_MAPS = frozenset(f.name for f in _FIELDS if f.type == dict[str, MismatchFigures])
_FIGURE_FLOATS = frozenset(f.name for f in msgspec.structs.fields(MismatchFigures) if f.type is float)


def _int_key(key: object) -> int:
    if isinstance(key, str) and key.lstrip("-").isdigit():
        return int(key)
    raise msgspec.ValidationError(f"staleness_hist key {key!r} is not an integer")


def _as_step_metrics(raw: dict[str, Any]) -> StepMetrics:
    """JSON object -> StepMetrics. The trainer's encoder writes non-finite floats (a
    non-finite grad norm of a skipped step) as null: those read back as NaN."""
    out = dict(raw)
    for name in _FLOATS & out.keys():
        if out[name] is None:
            out[name] = float("nan")
    for name in _FLOAT_MAPS & out.keys():
        if isinstance(out[name], dict):
            out[name] = {k: float("nan") if v is None else v for k, v in out[name].items()}
    for name in _FIGURE_MAPS & out.keys():
        if isinstance(out[name], dict):
            out[name] = {k: ({f: float("nan") if f in _FIGURE_FLOATS and x is None else x for f, x in v.items()}
                             if isinstance(v, dict) else v) for k, v in out[name].items()}
    hist = out.get("staleness_hist")
    if isinstance(hist, dict):
        out["staleness_hist"] = {_int_key(k): v for k, v in hist.items()}
    return msgspec.convert(out, StepMetrics)


def _parse(text: str, path: str, convert: Callable[[dict[str, Any]], T]) -> Log:
    lines = text.split("\n")
    ends_open = lines[-1] != ""  # no newline after the last line: it may be cut short
    if not ends_open:
        lines.pop()
    rows: list[T] = []
    truncated = False
    for i, line in enumerate(lines, start=1):
        last = i == len(lines)
        if not line.strip():
            raise ReportInputError(f"{path}:{i}: empty line (expected one JSON object)")
        try:
            raw = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            if last and ends_open:
                truncated = True
                break
            raise ReportInputError(f"{path}:{i}: not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ReportInputError(f"{path}:{i}: expected a JSON object, got {type(raw).__name__}")
        try:
            rows.append(convert(raw))
        except msgspec.ValidationError as exc:
            raise ReportInputError(f"{path}:{i}: {exc}") from None
    return Log(path=path, rows=tuple(rows), truncated=truncated)


def parse_metrics(text: str, path: str = "metrics.jsonl") -> Log:
    """``metrics.jsonl`` text -> `Log` of `StepMetrics` (``path`` is only used in errors)."""
    return _parse(text, path, _as_step_metrics)


def parse_evals(text: str, path: str = "eval.jsonl") -> Log:
    """``eval.jsonl`` text -> `Log` of `EvalRow` (``path`` is only used in errors)."""
    return _parse(text, path, _eval_row)


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ReportInputError(f"{path}: not UTF-8 text: {exc}") from None


def read_metrics(path: Path) -> Log:
    """Read a trainer ``metrics.jsonl`` (a missing file is an empty log)."""
    if not path.exists():
        return Log(path=str(path))
    return parse_metrics(_read(path), str(path))


def read_evals(path: Path) -> Log:
    """Read an evaluator ``eval.jsonl`` (a missing file is an empty log)."""
    if not path.exists():
        return Log(path=str(path))
    return parse_evals(_read(path), str(path))

"""An evaluator's output read as a reward, and a group evaluation's output split by attempt.

`reward_from_evaluator` turns the exit code and stdout of a task's evaluator into a
reward in [0, 1] by the task's ``evaluator.reward`` kind; output it cannot read is an
`EvaluatorOutputError` (the evaluator's fault, never the model's).
`split_group_output` cuts the stdout of an ``evaluator.group_command`` into the
sections of its attempts (`GROUP_DIR`, `GROUP_HEADER`, `GROUP_END`). Pure.
"""

from __future__ import annotations

import json
import re

from .errors import EvaluatorOutputError
from .task_schema import Task

__all__ = [
    "GROUP_DIR",
    "GROUP_END",
    "GROUP_HEADER",
    "reward_from_evaluator",
    "split_group_output",
]

_FRACTION = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def _last_line(stdout: str) -> str | None:
    for line in reversed(stdout.splitlines()):
        if line.strip():
            return line.strip()
    return None


GROUP_DIR = ".fleetrl-group"
"""Where a group evaluation places each attempt's files: ``<workdir>/GROUP_DIR/<k>/``."""
GROUP_HEADER = "@@fleetrl-attempt"
"""Starts each attempt's section: ``GROUP_HEADER <k> exit=<code>``."""
GROUP_END = f"{GROUP_HEADER} end"
"""Closes the last section."""
_GROUP_LINE = re.compile(rf"^{re.escape(GROUP_HEADER)} (\d+) exit=(-?\d+)$")


def split_group_output(stdout: str, n: int) -> dict[int, tuple[int, str]]:
    """The sections of a ``group_command``'s stdout: attempt index -> (exit code, what
    that attempt's own evaluation printed). A section runs from its header line to the
    next header or to the closing line ``@@fleetrl-attempt end``; text after the last
    header with no closing line (a run cut short) is no section. Only attempts
    ``0 .. n-1`` are returned, and an index reported twice is dropped (both copies),
    so a confused or forged output costs a re-run, never a wrong reward. Pure."""
    sections: dict[int, tuple[int, str]] = {}
    seen: dict[int, int] = {}
    open_: tuple[int, int, list[str]] | None = None

    def close() -> None:
        if open_ is not None:
            k, code, lines = open_
            if 0 <= k < n:
                sections[k] = (code, "".join(line + "\n" for line in lines))

    for line in stdout.splitlines():
        if line == GROUP_END:
            close()
            open_ = None
            continue
        m = _GROUP_LINE.match(line)
        if m is None:
            if open_ is not None:
                open_[2].append(line)
            continue
        close()
        k = int(m.group(1))
        seen[k] = seen.get(k, 0) + 1
        open_ = (k, int(m.group(2)), [])
    return {k: v for k, v in sections.items() if seen[k] == 1}


def reward_from_evaluator(task: Task, exit_code: int, stdout: str) -> float:
    """The reward in [0, 1] from the evaluator's exit code and stdout (pure).

    ``exit_code``: 0 -> 1.0, else 0.0. ``json``: the last non-empty stdout line is a
    JSON object whose ``"reward"`` is a number in [0, 1] (the exit code is then not
    used: an evaluator may exit 1 and still report partial credit). ``fraction``: the
    last non-empty line is ``passed/total`` with ``0 <= passed <= total`` and
    ``total > 0``. Malformed output raises ``EvaluatorOutputError``.
    """
    kind = task.evaluator.reward
    if kind == "exit_code":
        return 1.0 if exit_code == 0 else 0.0

    def fail(reason: str) -> EvaluatorOutputError:
        return EvaluatorOutputError(f"{reason} (exit code {exit_code})", task_id=task.id, kind=kind)

    last = _last_line(stdout)
    if last is None:
        raise fail("stdout is empty")
    if kind == "json":
        try:
            obj = json.loads(last)
        except ValueError:
            raise fail(f"last stdout line is not JSON: {last[:200]!r}") from None
        if not isinstance(obj, dict):
            raise fail(f"last stdout line is JSON but not an object: {last[:200]!r}")
        if "reward" not in obj:
            raise fail(f"JSON object has no 'reward': {last[:200]!r}")
        value = obj["reward"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail(f"'reward' is not a number: {value!r}")
        reward = float(value)
        if not (0.0 <= reward <= 1.0):
            raise fail(f"'reward' {value!r} is outside [0, 1]")
        return reward
    # fraction
    match = _FRACTION.match(last)
    if match is None:
        raise fail(f"last stdout line is not 'passed/total': {last[:200]!r}")
    passed, total = int(match[1]), int(match[2])
    if total == 0:
        raise fail("total is 0")
    if passed > total:
        raise fail(f"passed {passed} > total {total}")
    return passed / total

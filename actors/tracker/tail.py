"""Reading the rows appended to a JSONL file since a byte offset (the tracker's cursor)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_new_lines", "read_new_rows"]


def read_new_rows(path: Path, offset: int) -> tuple[list[dict[str, Any]], int, list[str]]:
    """``(rows, new offset, problems)``: `read_new_lines` without each row's offset."""
    lines, offset, problems = read_new_lines(path, offset)
    return [row for _, row in lines], offset, problems


def read_new_lines(path: Path, offset: int) -> tuple[list[tuple[int, dict[str, Any]]], int, list[str]]:
    """``(rows, new offset, problems)``, each row as ``(byte offset of its line, row)``:
    the complete lines after `offset` (a line still being written, without its newline,
    waits for the next read). A line that is not a JSON object is skipped and named in
    `problems` (file and line start offset). A file shorter than `offset` (replaced) is
    read from its start."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [], offset, []
    if size < offset:
        offset = 0
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read(size - offset)
    end = data.rfind(b"\n") + 1
    rows: list[tuple[int, dict[str, Any]]] = []
    problems: list[str] = []
    at = offset
    for line in data[:end].split(b"\n")[:-1]:
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as exc:
                problems.append(f"{path}: line at byte {at} is not JSON ({exc})")
            else:
                if isinstance(row, dict):
                    rows.append((at, row))
                else:
                    problems.append(f"{path}: line at byte {at} is not a JSON object")
        at += len(line) + 1
    return rows, offset + end, problems

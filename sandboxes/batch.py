"""The host side of ``Sandbox.exec_many``: what a batch is, and the pure codec of the
protocol spoken with the in-container runner (``batch_runner.py``).

A batch runs independent programs one after another in one ``docker exec`` (one engine
round trip instead of one per program). Before each program the runner resets the
sandbox (processes killed, writable dirs wiped), so each program sees what a freshly
leased sandbox shows; ``Sandbox.exec_many`` falls back to one exec per program for any
program the runner did not report (it was killed or stopped, or could not start it).
No I/O here: the encoder and parser are plain functions.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec

__all__ = ["ExecSpec", "RUNNER_SOURCE", "PreparedProgram", "RunnerRecord", "RunnerEnd", "BatchOutput",
           "encode_batch", "parse_runner_output"]  # fmt: skip

RUNNER_SOURCE = (Path(__file__).with_name("batch_runner.py")).read_text()
"""The runner program; run as ``python3 -I -S -c RUNNER_SOURCE`` inside the sandbox."""

RECORD_HEAD_MAX = 4096
"""Longest JSON head line the parser accepts."""


class ExecSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One program of a batch: the arguments of ``Sandbox.exec`` plus files to write
    (in the freshly reset sandbox) right before it starts."""

    cmd: str | Sequence[str]
    """argv, or a string run by ``/bin/sh -c``."""
    timeout: float | None = None
    """Wall-clock seconds (default ``limits.timeout_s``)."""
    stdin: bytes | str | None = None
    env: Mapping[str, str] | None = None
    workdir: str | None = None
    files: Mapping[str, bytes | str] = msgspec.field(default_factory=dict)
    """Path (relative to the work dir, or absolute in the work dir or /tmp) -> content."""


class PreparedProgram(msgspec.Struct, frozen=True):
    """An ``ExecSpec`` checked and resolved (``Sandbox`` does that)."""

    argv: list[str]
    env: dict[str, str] | None
    cwd: str
    timeout: float
    stdin: bytes | None
    files: list[tuple[str, bytes]]


class RunnerRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the runner reports for one program it ran (``R`` record)."""

    i: int
    exit_code: int
    timed_out: bool
    over_limit: bool
    oom: bool
    oom_count: int
    duration: float
    out_total: int
    err_total: int
    out_len: int
    err_len: int


class RunnerEnd(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The runner's last record: the status of its final reset (None: not asked for),
    an error that stopped the batch early, the cgroup's OOM kill count."""

    reset: int | None
    error: str
    oom_count: int


class BatchOutput(msgspec.Struct, frozen=True):
    records: dict[int, tuple[RunnerRecord, bytes, bytes]]
    """Program index -> record, kept stdout, kept stderr."""
    not_started: frozenset[int]
    """Programs the runner could not start (``S`` records)."""
    end: RunnerEnd | None
    """None when the output stops before the ``E`` record."""
    problem: str = ""
    """Why parsing stopped early (empty when the output was complete and well formed)."""


def encode_batch(
    programs: Sequence[PreparedProgram],
    *,
    dirs: Sequence[str],
    stdout_cap: int,
    stderr_cap: int,
    output_limit: int,
    final: bool,
    keeper: Sequence[str],
) -> bytes:
    """The runner's stdin: a JSON header line, then every program's files and stdin."""
    header = {
        "dirs": list(dirs),
        "stdout_cap": stdout_cap,
        "stderr_cap": stderr_cap,
        "output_limit": output_limit,
        "final": final,
        "keeper": list(keeper),
        "programs": [
            {
                "argv": p.argv,
                "env": p.env,
                "cwd": p.cwd,
                "timeout": p.timeout,
                "stdin": None if p.stdin is None else len(p.stdin),
                "files": [[path, len(data)] for path, data in p.files],
            }
            for p in programs
        ],
    }
    parts = [json.dumps(header, separators=(",", ":")).encode(), b"\n"]
    for p in programs:
        parts.extend(data for _, data in p.files)
        if p.stdin is not None:
            parts.append(p.stdin)
    return b"".join(parts)


_record = msgspec.json.Decoder(RunnerRecord)
_end = msgspec.json.Decoder(RunnerEnd)


class _Started(msgspec.Struct, forbid_unknown_fields=True):
    i: int


_started = msgspec.json.Decoder(_Started)


def parse_runner_output(data: bytes, n: int, *, stdout_cap: int, stderr_cap: int) -> BatchOutput:
    """Parse the runner's stdout for a batch of ``n`` programs. Complete, well-formed
    records are kept in order; parsing stops at the first thing that is not one (the
    runner was killed mid-write, or the output is not the runner's), saying why."""
    records: dict[int, tuple[RunnerRecord, bytes, bytes]] = {}
    not_started: set[int] = set()
    pos, last = 0, -1

    def stop(problem: str, end: RunnerEnd | None = None) -> BatchOutput:
        return BatchOutput(records, frozenset(not_started), end, problem)

    while pos < len(data):
        nl = data.find(b"\n", pos, pos + RECORD_HEAD_MAX)
        if nl < 0:
            return stop(f"record at byte {pos}: no complete head line")
        tag, head = data[pos : pos + 2], data[pos + 2 : nl]
        pos = nl + 1
        try:
            if tag == b"E ":
                end = _end.decode(head)
                if pos != len(data):
                    return stop(f"{len(data) - pos} bytes after the end record", end)
                return stop("", end)
            if tag == b"S ":
                i = _started.decode(head).i
                rec = None
            elif tag == b"R ":
                rec = _record.decode(head)
                i = rec.i
            else:
                return stop(f"record at byte {pos}: unknown tag {tag!r}")
        except msgspec.DecodeError as e:
            return stop(f"record at byte {pos}: {e}")
        if not last < i < n:
            return stop(f"record for program {i} out of order (after {last}, of {n})")
        last = i
        if rec is None:
            not_started.add(i)
            continue
        if not (
            0 <= rec.out_len <= min(rec.out_total, stdout_cap)
            and 0 <= rec.err_len <= min(rec.err_total, stderr_cap)
            and (rec.out_len == min(rec.out_total, stdout_cap))
            and (rec.err_len == min(rec.err_total, stderr_cap))
        ):
            return stop(f"record for program {i}: inconsistent output lengths")
        if pos + rec.out_len + rec.err_len > len(data):
            return stop(f"record for program {i}: output cut short")
        out = data[pos : pos + rec.out_len]
        pos += rec.out_len
        err = data[pos : pos + rec.err_len]
        pos += rec.err_len
        records[i] = (rec, out, err)
    return stop("no end record")

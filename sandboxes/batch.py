"""What a batch of ``Sandbox.exec_many`` is, its programs' checks, and the pure codec of
the protocol spoken with the in-container runner (``scripts/batch_runner.py``).

A batch runs independent programs one after another in one ``docker exec`` (one engine
round trip instead of one per program). Before each program the runner resets the
sandbox (processes killed, writable dirs wiped), so each program sees what a freshly
leased sandbox shows; ``Sandbox.exec_many`` falls back to one exec per program for any
program the runner did not report (it was killed or stopped, or could not start it).
No I/O here: the checks, the encoder and the parser are plain functions; the I/O side
is ``batch_exec.py``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import msgspec

from .checks import argv_of, check_workdir, env_list, exec_timeout, stdin_bytes, writable_files
from .limits import Limits
from .result import ExecResult

__all__ = ["ExecSpec", "PreparedProgram", "RunnerRecord", "RunnerEnd", "BatchOutput",
           "prepare", "runner_budget", "runner_report_cap", "encode_batch", "parse_runner_output"]  # fmt: skip

BATCH_SLACK_S = 15.0
"""Seconds per program, beyond the programs' own timeouts, a batch exec may take (the
runner's resets, files, kills) before the engine-side watchdog ends it."""

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
    """An ``ExecSpec`` checked and resolved (``prepare``)."""

    argv: list[str]
    env: dict[str, str] | None
    cwd: str
    timeout: float
    stdin: bytes | None
    files: list[tuple[str, bytes]]


def prepare(i: int, p: ExecSpec, limits: Limits) -> PreparedProgram:
    """Check program ``i`` of a batch as ``Sandbox.exec`` checks its arguments (errors
    name the index) and resolve its defaults from ``limits``."""
    where = f"Sandbox.exec_many: programs[{i}]"
    if not isinstance(p, ExecSpec):
        raise TypeError(f"{where} must be an ExecSpec, not {type(p).__name__}")
    try:
        argv = argv_of(p.cmd)
        envd = dict(p.env) if p.env is not None else None
        env_list(envd)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{where}: {e}") from None
    timeout = exec_timeout(p.timeout, limits.timeout_s, where)
    data = stdin_bytes(p.stdin, where)
    check_workdir(p.workdir, where)
    files = writable_files(p.files, limits.workdir, where)
    return PreparedProgram(
        argv=argv,
        env=envd,
        cwd=p.workdir or limits.workdir,
        timeout=float(timeout),
        stdin=None if data is None else bytes(data),
        files=files,
    )


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

    @property
    def oom_count(self) -> int:
        """The latest OOM kill count of the cgroup the runner reported (0: none)."""
        counts = [rec.oom_count for rec, _, _ in self.records.values()]
        if self.end is not None:
            counts.append(self.end.oom_count)
        return max(counts, default=0)

    def results(self, n: int) -> list[ExecResult | None]:
        """Program ``i``'s result as ``Sandbox.exec`` gives it, for each of the ``n``
        programs; None for those the runner did not report."""
        out: list[ExecResult | None] = [None] * n
        for i, (rec, so, se) in self.records.items():
            out[i] = ExecResult(
                exit_code=rec.exit_code,
                stdout=so,
                stderr=se,
                stdout_truncated=rec.out_total > len(so),
                stderr_truncated=rec.err_total > len(se),
                stdout_bytes=rec.out_total,
                stderr_bytes=rec.err_total,
                duration_s=rec.duration,
                timed_out=rec.timed_out,
                output_limit_exceeded=rec.over_limit,
                oom_killed=rec.oom,
            )
        return out


def runner_budget(programs: Sequence[PreparedProgram]) -> float:
    """Wall-clock seconds the runner's exec may take before the host ends it."""
    return sum(p.timeout for p in programs) + BATCH_SLACK_S * len(programs)


def runner_report_cap(programs: Sequence[PreparedProgram], limits: Limits) -> int:
    """Most bytes of the runner's report: every program's kept output and record."""
    return sum(limits.stdout_cap + limits.stderr_cap + 1024 for _ in programs) + 4096


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

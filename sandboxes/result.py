"""``ExecResult``: what one program run in a sandbox did (``Sandbox.exec``, one entry of
``Sandbox.exec_many``)."""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["ExecResult"]


class ExecResult(msgspec.Struct, frozen=True, kw_only=True):
    """The outcome of one ``Sandbox.exec``."""

    exit_code: int | None
    """Exit status (128+N after signal N, e.g. 137 when killed); None if unknown."""
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    """More stdout was written than the cap; only the first ``stdout_cap`` bytes are kept."""
    stderr_truncated: bool
    stdout_bytes: int
    """Bytes of stdout the process wrote (kept or not)."""
    stderr_bytes: int
    duration_s: float
    timed_out: bool
    """The wall-clock timeout passed and every process of the sandbox user was killed."""
    output_limit_exceeded: bool = False
    """More than ``limits.output_limit_bytes`` of output: every process was killed."""
    oom_killed: bool
    """The OOM killer killed a process of this sandbox during this exec."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def to_json_dict(self) -> dict[str, Any]:
        d = msgspec.to_builtins(self)
        d["stdout"] = self.stdout.decode("utf-8", errors="replace")
        d["stderr"] = self.stderr.decode("utf-8", errors="replace")
        return d

"""The programs a sandbox runs for us: its PID 1 (``KEEPER_ARGV``), and those kept as
files in ``scripts/`` (package data), read when this module is imported, with the pure
parsers of what they print.

  * ``RESET_SCRIPT``: ``fleetrl_reset.sh`` + ``reset.sh``, run by ``Sandbox.reset``;
  * ``FINAL_SCRIPT``: ``fleetrl_reset.sh`` + ``final.sh``, wraps a lease's final
    command (``Sandbox.exec(final=True)``); ``final_status`` reads its status line;
  * ``OOM_PROBE``: ``oom_probe.sh``; ``oom_count`` reads its output;
  * ``RUNNER_SOURCE``: ``batch_runner.py``, the in-container runner of
    ``Sandbox.exec_many`` (standard library only, run as ``python3 -I -S -c``).
"""

from __future__ import annotations

from importlib.resources import files

import msgspec

from .result import ExecResult

__all__ = [
    "KEEPER_ARGV",
    "KEEPER_CMDLINE",
    "SCRIPTS",
    "script_text",
    "RESET_SCRIPT",
    "FINAL_SCRIPT",
    "FINAL_MARK",
    "OOM_PROBE",
    "RUNNER_SOURCE",
    "final_status",
    "finish_final",
    "oom_count",
]

# PID 1 of every sandbox: `sleep` with SIGCHLD ignored. It never forks, so a fork bomb
# at the pids limit cannot take it down; with SIGCHLD ignored the kernel reaps every
# child at exit, so orphans reparented to it never pile up as zombies (which would keep
# holding the pids limit); `kill -9 -1` from the sandbox user spares it (a PID
# namespace's init is immune). `env --ignore-signal` is coreutils >= 8.31.
KEEPER_ARGV = ["env", "--ignore-signal=CHLD", "sleep", "infinity"]
KEEPER_CMDLINE = KEEPER_ARGV[2:]
"""PID 1's /proc/1/cmdline once ``env`` has exec'ed ``sleep``."""

SCRIPTS = files(__package__) / "scripts"
"""Where the programs are (a directory of the installed package)."""


def script_text(name: str) -> str:
    """The content of ``scripts/<name>``."""
    return (SCRIPTS / name).read_text(encoding="utf-8")


_RESET_FUNCTION = script_text("fleetrl_reset.sh")
RESET_SCRIPT = _RESET_FUNCTION + script_text("reset.sh")
"""``sh -c RESET_SCRIPT reset WORKDIR``: exit 0 when the sandbox is clean."""
FINAL_SCRIPT = _RESET_FUNCTION + script_text("final.sh")
"""``sh -c FINAL_SCRIPT final WORKDIR CMD [ARG...]``: CMD, then a reset, then a status line."""
FINAL_MARK = b"\nfleetrl-final "
"""How ``final.sh``'s status line starts (the newline keeps it off the command's last line)."""
OOM_PROBE = script_text("oom_probe.sh")
RUNNER_SOURCE = script_text("batch_runner.py")
"""The batch runner; run as ``python3 -I -S -c RUNNER_SOURCE`` inside the sandbox."""


def final_status(err_tail: bytes) -> tuple[int, int, int] | None:
    """(the command's exit status, the reset's status, the status line's length in
    bytes) from the last bytes of a final exec's stderr; None when they do not end with
    a well-formed status line. Trust it only when the wrapper shell itself exited 0."""
    at = err_tail.rfind(FINAL_MARK)
    if at < 0:
        return None
    fields = err_tail[at + len(FINAL_MARK) :].split()
    if len(fields) != 2 or not all(f.isdigit() for f in fields) or not err_tail.endswith(b"\n"):
        return None
    return int(fields[0]), int(fields[1]), len(err_tail) - at


def finish_final(r: ExecResult, err_tail: bytes) -> tuple[ExecResult, bool]:
    """(the command's result, whether the reset after it succeeded) from the raw result of
    a ``FINAL_SCRIPT`` exec and the last bytes of its stderr: the status line is read
    and stripped from stderr. The line is trusted only when the wrapper shell itself
    exited 0; otherwise (killed at the timeout or output limit, or the wrapper could not
    run) the result is what the engine saw and the reset did not happen."""
    st = None
    if r.exit_code == 0 and not r.timed_out and not r.output_limit_exceeded:
        st = final_status(err_tail)
    if st is None:
        return r, False
    rc, reset_status, line_len = st
    total = r.stderr_bytes - line_len  # the line was the last bytes of the stream
    stderr = r.stderr[:total]
    r = msgspec.structs.replace(r, exit_code=rc, stderr=stderr, stderr_bytes=total, stderr_truncated=total > len(stderr))
    return r, reset_status == 0


def oom_count(text: str) -> int:
    """The ``oom_kill`` counter in the OOM probe's output (cgroup v1 or v2); 0 if absent."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "oom_kill" and parts[1].isdigit():
            return int(parts[1])
    return 0

"""A watchdog that removes a process's sandbox containers once that process is gone.

``python -m fleetrl.sandboxes.reaper STATE_DIR`` waits until its standard input ends,
which happens when the process holding the other end of the pipe exits for any reason,
SIGKILL and the OOM killer included; then it sweeps ``STATE_DIR`` (`sweep.sweep_blocking`,
which spares the containers of a live owner of the state directory's lock, such as a
restarted process) and exits. Start it with `start_reaper`, in a session of its own so a
signal to the owner's process group does not reach it. A host that dies takes its
containers with it; this covers the process that dies while its host lives on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main", "start_reaper"]


def start_reaper(state_dir: str | os.PathLike) -> subprocess.Popen:
    """Start the watchdog for this process's containers of `state_dir`; it sweeps when
    this process exits (or when its ``stdin`` is closed)."""
    return subprocess.Popen([sys.executable, "-m", "fleetrl.sandboxes.reaper", str(Path(state_dir).absolute())],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fleetrl.sandboxes.reaper STATE_DIR", file=sys.stderr)
        return 2
    while sys.stdin.buffer.read(65536):
        pass
    from .sweep import sweep_blocking

    for attempt in range(5):  # the engine may be briefly busy; a sweep is idempotent
        try:
            report = sweep_blocking(args[0])
            print(f"reaper: removed {len(report.removed)} container(s) of {args[0]}", file=sys.stderr)
            return 0
        except Exception as exc:
            print(f"reaper: sweep failed ({type(exc).__name__}: {exc}); retrying", file=sys.stderr)
            time.sleep(1.0 + attempt)
    return 1


if __name__ == "__main__":
    sys.exit(main())

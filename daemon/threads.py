"""Compute threads of the daemon process (``[daemon] compute_threads``).

torch (and MKL/OpenBLAS under numpy) size their intra-op thread pools from
``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` when the library loads, and an OpenMP
thread's pool size is per thread: ``torch.set_num_threads`` called in one thread does
not reach the worker threads where the daemon's actors compute (samplers, trainer,
evaluator). The only setting that reaches every thread is the environment, before the
first import of torch. `fleetrl serve` reads this one key from the raw TOML (the full
config load imports actor factories, and with them torch) and sets the variables.

Why it matters: on a machine whose cores the actors saturate together (the embedded
default on 2 cores: three samplers, the trainer, the evaluator and the sandboxes), pools
of N threads per actor thread oversubscribe the cores; measured there (docs/results/tiny-run.md)
one thread per actor thread gave 7.4 s per training step against 8.6 s with torch's
default of one thread per core.
"""

from __future__ import annotations

import os
import sys
import tomllib
from collections.abc import MutableMapping
from pathlib import Path

__all__ = ["THREAD_VARIABLES", "apply_compute_threads", "compute_threads_of"]

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def compute_threads_of(path: str | Path) -> int | None:
    """``[daemon] compute_threads`` of the TOML file at `path`, or None when the key is
    absent or the file cannot be read or parsed here (the full config load reports
    every error with its line; this early peek stays silent)."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    daemon = data.get("daemon")
    value = daemon.get("compute_threads") if isinstance(daemon, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None  # absent, or invalid: load_config names the problem
    return value


def apply_compute_threads(threads: int | None, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set the thread variables to `threads` (None: leave them). Returns a warning when
    it is too late to take effect (torch already imported in this process), else None."""
    if threads is None:
        return None
    env = os.environ if environ is None else environ
    for name in THREAD_VARIABLES:
        env[name] = str(threads)
    if "torch" in sys.modules:
        return (f"[daemon] compute_threads = {threads}: torch was imported before the setting was applied, "
                f"so only threads started later with their own settings follow it")
    return None

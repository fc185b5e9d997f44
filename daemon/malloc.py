"""Bounding glibc's malloc arenas in the daemon process.

glibc gives each thread that allocates concurrently its own arena (up to 8 per core),
and an arena keeps the heaps it grew (64 MiB each) for reuse. The daemon runs many
threads that allocate and free short-lived buffers (torch in the trainer and every
local sampler, numba delta kernels, Trio's worker threads): measured on the embedded
default, the daemon held about 11 GiB of such heaps after ten minutes, against about
2.5 GiB with two arenas and the same throughput. `limit_arenas` sets ``M_ARENA_MAX``
with ``mallopt`` before those threads exist; it only affects arenas created later.

A ``MALLOC_ARENA_MAX`` in the environment (glibc reads it itself) wins: then nothing is
changed. Not glibc (musl, macOS): nothing to do, returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["M_ARENA_MAX", "limit_arenas"]

M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter number for the arena limit (malloc.h)."""


def limit_arenas(n: int) -> bool:
    """Cap this process's malloc arenas at `n` (>= 1); True if the limit was set."""
    if n < 1:
        raise ValueError(f"limit_arenas: n must be >= 1, got {n}")
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, n))

"""The daemon caps glibc's malloc arenas: checked through glibc's own malloc_info report
in fresh subprocesses (threads that allocate at once get their own arena otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fleetrl.daemon.malloc import limit_arenas

PROGRAM = r"""
import ctypes, ctypes.util, os, sys, tempfile, threading
limit = int(sys.argv[1])
if limit:
    from fleetrl.daemon.malloc import limit_arenas
    assert limit_arenas(limit)
libc = ctypes.CDLL(ctypes.util.find_library("c"))
start = threading.Barrier(8)
def work():
    start.wait()
    keep = [ctypes.create_string_buffer(4096) for _ in range(2000)]
    start.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.fclose.argtypes = [ctypes.c_void_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
path = tempfile.mktemp()
fh = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, fh)
libc.fclose(fh)
text = open(path).read()
os.unlink(path)
print(text.count("<heap nr="))
"""


def _arenas(limit: int) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(limit)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


def test_the_limit_bounds_the_arenas_threads_create():
    assert _arenas(0) > 2  # without the limit, 8 allocating threads take more arenas
    assert _arenas(2) <= 2


def test_bad_limit_and_environment_override(monkeypatch):
    with pytest.raises(ValueError, match="must be >= 1"):
        limit_arenas(0)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_arenas(2) is False  # the user's own setting wins

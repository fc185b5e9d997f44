"""An S3-compatible server for tests: moto's server mode in a subprocess on 127.0.0.1 (a
stand-in for S3/R2/GCS). A subprocess, not moto's threaded server in the test process:
that imports Flask, whose context-local proxies break code that scans modules (vLLM's
kernel registration calls ``hasattr`` on every module attribute)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["S3_ENV", "moto_s3"]

S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
"""Credentials and region boto3 needs for the test server (any values do)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_s3(log_dir: Path) -> Iterator[str]:
    """Start the server, yield its endpoint URL once it accepts connections, stop it."""
    port = _free_port()
    with open(log_dir / "moto.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **S3_ENV))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's S3 server did not start: {(log_dir / 'moto.log').read_text()[-2000:]}")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""The state directory (see docs/reference/contracts.md): one per run, owned by one daemon.

Layout: ``run_id`` (kept across restarts), ``token`` (control-plane bearer token,
mode 0600), ``instance.json`` (who holds the lock), ``daemon.lock`` (``flock``-ed by
the live daemon for its whole life), ``control.json`` (where the control plane
listens, removed at clean exit), ``checkpoints/``, ``logs/``, and ``actors/NAME/``
(each actor's private scratch directory).

A second daemon on the same directory is refused with `StateDirLocked`; a crashed
daemon's lock is released by the kernel when its process dies, so no stale-lock
cleanup is needed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import stat
import time
import uuid
from pathlib import Path
from typing import Any

from .faults import StateDirLocked
from .files import write_atomic

__all__ = ["StateDir", "client_host", "control_cert", "daemon_alive", "read_control", "read_token"]


def _atomic_write_text(path: Path, text: str, mode: int = 0o644) -> None:
    write_atomic(path, text.encode(), mode=mode)


class StateDir:
    """Owns a state directory for the life of one daemon (use as a context manager)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).absolute()
        self.instance_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.started_at = time.time()
        self._lock_fd: int | None = None
        self.run_id = ""
        self.token = ""

    # -- layout ---------------------------------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def actor_dir(self, name: str) -> Path:
        d = self.path / "actors" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    # -- life -----------------------------------------------------------------
    def open(self) -> "StateDir":
        """Create the layout, take the lock, load or create run id and token."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = self._read_instance()
            who = (f" (pid {holder.get('pid')}, instance {holder.get('instance_id')})"
                   if holder else "")
            raise StateDirLocked(
                f"state directory {self.path} is in use by another fleetrl daemon{who}; "
                "stop it first (fleetrl stop) or pass a different --state-dir") from None
        self._lock_fd = fd
        for d in (self.checkpoints, self.logs, self.path / "actors"):
            d.mkdir(exist_ok=True)
        self.run_id = self._load_or_create("run_id", lambda: f"run-{uuid.uuid4().hex[:12]}", 0o644)
        self.token = self._load_or_create("token", lambda: secrets.token_urlsafe(32), 0o600)
        tok = self.path / "token"
        if stat.S_IMODE(tok.stat().st_mode) != 0o600:
            os.chmod(tok, 0o600)
        _atomic_write_text(self.path / "instance.json", json.dumps({
            "instance_id": self.instance_id, "pid": os.getpid(), "started_at": self.started_at}))
        return self

    def close(self) -> None:
        """Remove `control.json` and release the lock (idempotent)."""
        if self._lock_fd is None:
            return
        try:
            (self.path / "control.json").unlink(missing_ok=True)
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> "StateDir":
        return self if self._lock_fd is not None else self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write_control(self, host: str, port: int, *, tls_cert: str | None = None) -> None:
        """Record where the control plane listens (and, when it serves TLS, its certificate)."""
        cert = str(Path(tls_cert).absolute()) if tls_cert is not None else None
        _atomic_write_text(self.path / "control.json", json.dumps({"host": host, "port": port, "tls_cert": cert}))

    # -- helpers --------------------------------------------------------------
    def _load_or_create(self, name: str, make: Any, mode: int) -> str:
        p = self.path / name
        try:
            value = p.read_text().strip()
            if value:
                return value
        except FileNotFoundError:
            pass
        value = make()
        _atomic_write_text(p, value + "\n", mode)
        return value

    def _read_instance(self) -> dict[str, Any]:
        try:
            return json.loads((self.path / "instance.json").read_text())
        except (OSError, ValueError):
            return {}


def daemon_alive(path: str | Path) -> bool:
    """True while some process holds ``daemon.lock`` of the state directory."""
    lock = Path(path) / "daemon.lock"
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def read_control(path: str | Path) -> tuple[str, int]:
    """(host, port) of the live daemon's control plane; raises FileNotFoundError."""
    data = json.loads((Path(path) / "control.json").read_text())
    return str(data["host"]), int(data["port"])


def control_cert(path: str | Path) -> str | None:
    """The certificate file of the live daemon's control plane when it serves TLS, else None."""
    data = json.loads((Path(path) / "control.json").read_text())
    cert = data.get("tls_cert")
    return str(cert) if cert else None


def client_host(host: str) -> str:
    """The address a local client dials for a server bound to ``host`` (wildcards -> loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def read_token(path: str | Path) -> str:
    return (Path(path) / "token").read_text().strip()

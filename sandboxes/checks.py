"""Argument checks of ``Sandbox.exec``, ``exec_many``, ``write_files`` and ``read_file``:
pure functions that turn what a caller passed into what the engine gets, or raise
``ValueError``/``TypeError`` naming the call (``where``) before anything reaches Docker."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["argv_of", "env_list", "resolve", "exec_timeout", "stdin_bytes", "check_workdir", "writable_files"]


def argv_of(cmd: str | Sequence[str]) -> list[str]:
    """argv for ``cmd``: a list of strings as is, a string run by ``/bin/sh -c``."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise ValueError("Sandbox.exec: cmd is an empty string")
        return ["/bin/sh", "-c", cmd]
    argv = list(cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"Sandbox.exec: cmd {cmd!r} must be a non-empty list of strings")
    if any("\0" in a for a in argv):
        raise ValueError("Sandbox.exec: arguments must not contain NUL bytes")
    return argv


def env_list(env: Mapping[str, str] | None) -> list[str] | None:
    """``["NAME=value", ...]`` for the engine; None (the image's environment) for None."""
    if env is None:
        return None
    out = []
    for k, v in env.items():
        if not isinstance(k, str) or not k or "=" in k or "\0" in k:
            raise ValueError(f"Sandbox.exec: env name {k!r} must be non-empty without '=' or NUL")
        if not isinstance(v, str) or "\0" in v:
            raise ValueError(f"Sandbox.exec: env[{k!r}] must be a string without NUL")
        out.append(f"{k}={v}")
    return out


def resolve(path: str, workdir: str) -> str:
    """The absolute, normalised form of ``path`` (relative paths are under ``workdir``)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"sandbox path {path!r} must be a non-empty string")
    full = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    parts = [p for p in full.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"sandbox path {path!r} must not contain '..'")
    return "/" + "/".join(parts)


def exec_timeout(timeout: float | None, default: float, where: str) -> float:
    """``timeout``, or ``default`` for None; a positive, finite number of seconds."""
    t = default if timeout is None else timeout
    if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
        raise ValueError(f"{where}: timeout={t!r} must be a positive number of seconds")
    return t


def stdin_bytes(stdin: bytes | bytearray | str | None, where: str) -> bytes | bytearray | None:
    """The bytes to feed (a string is encoded as UTF-8); None for no stdin."""
    data = stdin.encode() if isinstance(stdin, str) else stdin
    if data is not None and not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"{where}: stdin must be bytes or str, not {type(stdin).__name__}")
    return data


def check_workdir(workdir: str | None, where: str) -> None:
    """A program's work dir is absolute (None: the sandbox's work dir)."""
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise ValueError(f"{where}: workdir={workdir!r} must be an absolute path")


def writable_files(files: Mapping[str, bytes | str], workdir: str, where: str) -> list[tuple[str, bytes]]:
    """(absolute path, content) for each file, in order; every path must lie in the work
    dir or /tmp (the only places the sandbox user may write)."""
    if not isinstance(files, Mapping):
        raise TypeError(f"{where}: files must be a mapping of path -> content, not {type(files).__name__}")
    wd = workdir.rstrip("/")
    out: list[tuple[str, bytes]] = []
    for name, content in files.items():
        try:
            full = resolve(name, workdir)
        except ValueError as e:
            raise ValueError(f"{where}: files: {e}") from None
        if not (full.startswith(wd + "/") or full.startswith("/tmp/")):
            raise ValueError(f"{where}: file {name!r} is outside the work dir {wd} and /tmp")
        if not isinstance(content, (str, bytes, bytearray, memoryview)):
            raise TypeError(f"{where}: file {name!r} must be bytes or str, not {type(content).__name__}")
        out.append((full, content.encode() if isinstance(content, str) else bytes(content)))
    return out

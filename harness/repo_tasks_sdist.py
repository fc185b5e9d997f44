"""Reading what repository tasks are made from: an sdist tarball and a bug file.

`read_sdist` unpacks a source distribution (``.tar.gz``, ``.tar.bz2``, ``.tar.xz``,
``.tgz``) in memory into a `repo_tasks.SourceTree`: its name and version from its
``PKG-INFO``, and its UTF-8 text files relative to its single top directory (binary
files and links are listed as skipped). `load_bug_file` reads a TOML bug file,
`BUNDLED_BUGS` is the one shipped with fleetrl (``harness/repo_bugs.toml``).
`fetch_sdist` finds a package's sdist in a cache directory, downloading it with pip
(from the configured index) the first time. Problems are `TaskError`s naming the file
and what is wrong.
"""

from __future__ import annotations

import email.parser
import os
import posixpath
import re
import subprocess
import sys
import tarfile
import tomllib
from importlib import resources
from pathlib import Path

from .errors import TaskError
from .repo_tasks import RepoSpec, SourceTree, parse_bug_file
from .task_schema import _check_relative_path

__all__ = ["BUNDLED_BUGS", "MAX_FILE_BYTES", "bundled_bug_text", "fetch_sdist", "load_bug_file", "read_sdist"]

BUNDLED_BUGS = "repo_bugs.toml"
"""The bug file shipped with fleetrl (package data of ``fleetrl.harness``)."""
MAX_FILE_BYTES = 1 << 20
"""Larger members are left out of the repository (listed as skipped)."""


def read_sdist(path: str | os.PathLike[str]) -> SourceTree:
    """The text files of the sdist at ``path`` (module docstring)."""
    where = os.fspath(path)
    try:
        archive = tarfile.open(where, mode="r:*")
    except FileNotFoundError:
        raise TaskError("no such file", where=where) from None
    except (tarfile.TarError, OSError) as err:
        raise TaskError(f"not a readable tar archive: {err}", where=where) from None
    files: dict[str, str] = {}
    skipped: list[str] = []
    tops: set[str] = set()
    with archive:
        try:
            members = archive.getmembers()
        except (tarfile.TarError, OSError, EOFError) as err:
            raise TaskError(f"corrupt tar archive: {err}", where=where) from None
        for m in members:
            name = posixpath.normpath(m.name)
            if name == "." or name.startswith(("/", "../")) or name == "..":
                raise TaskError(f"member {m.name!r} lies outside the archive's directory", where=where)
            top, _, rel = name.partition("/")
            tops.add(top)
            if not rel or m.isdir():
                continue
            if not m.isfile() or m.size > MAX_FILE_BYTES or _check_relative_path(rel) is not None:
                skipped.append(rel)
                continue
            handle = archive.extractfile(m)
            data = handle.read() if handle is not None else b""
            try:
                files[rel] = data.decode("utf-8")
            except UnicodeDecodeError:
                skipped.append(rel)
    if len(tops) != 1:
        raise TaskError(f"an sdist has one top directory, this archive has {len(tops)}: "
                        f"{', '.join(sorted(tops)[:5]) or 'none'}", where=where)
    if "PKG-INFO" not in files:
        raise TaskError("no PKG-INFO at the top of the archive: not an sdist", where=where)
    info = email.parser.Parser().parsestr(files["PKG-INFO"], headersonly=True)
    name, version = info.get("Name"), info.get("Version")
    if not name or not version:
        raise TaskError("PKG-INFO lacks Name or Version", where=where)
    return SourceTree(name=name.strip(), version=version.strip(), files=files, skipped=tuple(sorted(skipped)))


def bundled_bug_text() -> str:
    """The text of the bug file shipped with fleetrl."""
    return resources.files(__package__).joinpath(BUNDLED_BUGS).read_text(encoding="utf-8")


def load_bug_file(path: str | os.PathLike[str] | None = None) -> dict[str, RepoSpec]:
    """Package name -> `RepoSpec` from the TOML bug file at ``path`` (default: the
    bundled one)."""
    where = os.fspath(path) if path is not None else f"fleetrl.harness/{BUNDLED_BUGS}"
    try:
        text = bundled_bug_text() if path is None else Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise TaskError(f"cannot read: {err.strerror or err}", where=where) from None
    except UnicodeDecodeError:
        raise TaskError("not UTF-8 text", where=where) from None
    try:
        obj = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise TaskError(f"invalid TOML: {err}", where=where) from None
    return parse_bug_file(obj, where=where)


def _sdist_in(cache_dir: Path, name: str, version: str) -> Path | None:
    # sdist file names normalise the project name (PEP 625: lower case, "_" for runs of -_.)
    wanted = {f"{n}-{version}.{ext}" for n in {name, re.sub(r"[-_.]+", "_", name).lower()}
              for ext in ("tar.gz", "tgz", "tar.bz2", "tar.xz")}
    found = sorted(p for p in cache_dir.iterdir() if p.name in wanted) if cache_dir.is_dir() else []
    return found[0] if found else None


def fetch_sdist(name: str, version: str, cache_dir: str | os.PathLike[str], *, timeout_s: float = 300.0) -> Path:
    """The sdist of ``name==version`` in ``cache_dir``, downloaded there with ``pip
    download --no-deps --no-binary :all:`` when it is not there yet (blocking)."""
    cache = Path(cache_dir).expanduser()
    hit = _sdist_in(cache, name, version)
    if hit is not None:
        return hit
    cache.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
            f"{name}=={version}", "-d", str(cache)]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TaskError(f"pip download {name}=={version} took over {timeout_s:g} s", where=str(cache)) from None
    hit = _sdist_in(cache, name, version)
    if r.returncode != 0 or hit is None:
        tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
        raise TaskError(f"pip download {name}=={version} found no sdist (exit {r.returncode}): "
                        f"{' | '.join(tail) or 'no output'}", where=str(cache))
    return hit

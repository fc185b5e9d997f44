"""Reading what repository tasks are made from: an sdist tarball and a bug file.

`read_sdist` unpacks a source distribution (``.tar.gz``, ``.tar.bz2``, ``.tar.xz``,
``.tgz``) in memory into a `repo_tasks.SourceTree`: its name and version from its
``PKG-INFO``, and its UTF-8 text files relative to its single top directory (binary
files and links are listed as skipped). `load_bug_file` reads a TOML bug file,
`BUNDLED_BUGS` is the one shipped with fleetrl (``harness/repo_bugs.toml``). Problems
are `TaskError`s naming the file and what is wrong.
"""

from __future__ import annotations

import email.parser
import os
import posixpath
import tarfile
import tomllib
from importlib import resources
from pathlib import Path

from .errors import TaskError
from .repo_tasks import RepoSpec, SourceTree, parse_bug_file
from .task_schema import _check_relative_path

__all__ = ["BUNDLED_BUGS", "MAX_FILE_BYTES", "bundled_bug_text", "load_bug_file", "read_sdist"]

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

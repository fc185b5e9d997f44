"""Repository tasks: real bug-fix tasks made from a source distribution and declared bugs.

A source distribution (sdist) that ships its own tests is unpacked into a fresh
repository with ONE commit (no history to mine for the fix); a declared bug is applied
in that commit; the test files that check it are left out of the repository and put
back only by the evaluator, after the agent stops. docs/guides/tasks.md ("Repository
tasks from source distributions") documents the bug file and the reward.

A bug (`BugSpec`) is an exact snippet ``old`` of one file and its buggy replacement
``new``, the test ids (pytest node ids, or whole test files) that fail with the bug and
pass without it, and the instruction the agent gets. `build_repo_tasks` turns a
`SourceTree` (the sdist's text files, read by `repo_tasks_sdist`) and a `RepoSpec` (one
package's bugs) into `RepoTask`s: the `Task` plus its reference fix. Which of them are
kept (doing nothing scores 0, the reference fix scores 1) is checked in real sandboxes
by `repo_tasks_check`.

The evaluator command carries `repo_tasks_runner` with the task's hidden tests filled
in, compressed into the command line (so nothing of it is in the sandbox while the agent
works); it prints ``{"reward": passed / declared, ...}`` (reward kind ``json``).

Every problem of the input is a `TaskError` naming the bug (``where``) and the field at
fault. Pure.
"""

from __future__ import annotations

import base64
import json
import posixpath
import re
import shlex
import zlib
from pathlib import Path
from typing import Annotated

import msgspec

from .errors import TaskError
from .program_files import fill_constants
from .task_codec import field_path_of
from .task_schema import DEFAULT_IMAGE, DEFAULT_WORKDIR, Evaluator, Limits, Setup, Source, Task, _check_relative_path

__all__ = [
    "BugSpec",
    "MAX_EVALUATOR_CHARS",
    "PYTEST_CONFIG_FILES",
    "RepoSpec",
    "RepoTask",
    "SourceTree",
    "apply_bug",
    "build_repo_tasks",
    "evaluator_command",
    "hidden_file_of",
    "parse_bug_file",
    "spec_for",
]

MAX_EVALUATOR_CHARS = 100_000
"""The longest evaluator command made: Linux caps one argument (``sh -c``'s command) at
128 KiB."""
PYTEST_CONFIG_FILES = ("pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
"""Root files that configure pytest: the evaluator writes them back too."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_RUNNER = Path(__file__).with_name("repo_tasks_runner.py")

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
Name = Annotated[str, msgspec.Meta(pattern=_NAME.pattern)]


class _Struct(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class BugSpec(_Struct, kw_only=True):
    """One declared bug of a package.

    ``file``: the source file (relative to the sdist's root) the bug is injected into;
    ``old``: a snippet found exactly once in it; ``new``: what replaces it (the bug);
    ``tests``: pytest node ids (``path.py::test``, ``path.py::Class::test``) or test
    files that fail with the bug and pass without it; their files are hidden from the
    agent; ``instruction``: what the agent is told (the symptom, as a user reports it).
    """

    id: Name
    file: NonEmptyStr
    old: NonEmptyStr
    new: str
    tests: Annotated[list[NonEmptyStr], msgspec.Meta(min_length=1)]
    instruction: NonEmptyStr


class RepoSpec(_Struct, kw_only=True):
    """The declared bugs of one package version. ``pythonpath``: the directories
    (relative to the root) its tests import the package from (``src`` for a src
    layout)."""

    name: Name
    version: Name
    bugs: Annotated[list[BugSpec], msgspec.Meta(min_length=1)]
    pythonpath: list[NonEmptyStr] = msgspec.field(default_factory=lambda: ["."])


class _RepoBody(_Struct, kw_only=True):
    version: Name
    bugs: Annotated[list[BugSpec], msgspec.Meta(min_length=1)]
    pythonpath: list[NonEmptyStr] = msgspec.field(default_factory=lambda: ["."])


class SourceTree(_Struct, kw_only=True):
    """An unpacked sdist: its name and version (from PKG-INFO), its text files
    (path relative to the root -> text) and the paths left out (binary, links)."""

    name: str
    version: str
    files: dict[str, str]
    skipped: tuple[str, ...] = ()


class RepoTask(_Struct, kw_only=True):
    """A built task, its bug and its reference fix (path -> original text)."""

    task: Task
    bug: BugSpec
    fix: dict[str, str]


def parse_bug_file(obj: object, *, where: str) -> dict[str, RepoSpec]:
    """A decoded bug file (TOML: one table per package, ``[name]`` with ``version``,
    ``pythonpath`` and ``[[name.bugs]]``) as package name -> `RepoSpec`."""
    if not isinstance(obj, dict) or not obj:
        raise TaskError("a bug file holds one table per package, found none", where=where)
    out: dict[str, RepoSpec] = {}
    for name, body in obj.items():
        if not _NAME.match(name):
            raise TaskError(f"{name!r} is not a package name", where=where, field=name)
        try:
            spec = msgspec.convert(body, _RepoBody)
        except msgspec.ValidationError as err:
            path, msg = field_path_of(err)
            raise TaskError(msg, where=where, field=f"{name}.{path}" if path else name) from None
        seen: set[str] = set()
        for i, bug in enumerate(spec.bugs):
            if bug.id in seen:
                raise TaskError(f"duplicate bug id {bug.id!r}", where=where, field=f"{name}.bugs[{i}].id")
            seen.add(bug.id)
        out[name] = RepoSpec(name=name, **msgspec.structs.asdict(spec))
    return out


def hidden_file_of(test_id: str) -> str:
    """The file part of a pytest node id (the whole id for a file)."""
    return test_id.split("::", 1)[0]


def _normal_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def spec_for(specs: dict[str, RepoSpec], name: str) -> RepoSpec | None:
    """The spec of package ``name`` (names compared as PyPI does: case, ``-_.``), or None."""
    return next((s for s in specs.values() if _normal_name(s.name) == _normal_name(name)), None)


def apply_bug(tree: SourceTree, bug: BugSpec) -> tuple[str, str]:
    """(original text, buggy text) of the bug's file. A file that is missing, a snippet
    ``old`` not found exactly once, or a ``new`` that is the same or cannot be found
    exactly once afterwards (the reference fix could not be located) is a `TaskError`."""
    where = f"bug {bug.id!r}"
    why = _check_relative_path(bug.file)
    if why is not None:
        raise TaskError(why, where=where, field="file")
    if bug.file not in tree.files:
        raise TaskError(f"{bug.file} is not a text file of {tree.name} {tree.version}", where=where, field="file")
    if bug.old == bug.new:
        raise TaskError("`new` is the same as `old`: no bug", where=where, field="new")
    text = tree.files[bug.file]
    n = text.count(bug.old)
    if n != 1:
        raise TaskError(f"snippet found {n} times in {bug.file}, must be exactly once", where=where, field="old")
    buggy = text.replace(bug.old, bug.new)
    if bug.new and buggy.count(bug.new) != 1:
        raise TaskError(f"after the bug the snippet `new` occurs {buggy.count(bug.new)} times in {bug.file}; "
                        "it must occur once so that the fix can be located", where=where, field="new")
    return text, buggy


def evaluator_command(spec: dict[str, object]) -> str:
    """The ``sh -c`` command that runs `repo_tasks_runner` with ``spec`` filled in,
    compressed into the command line itself (nothing is read from the sandbox)."""
    program = fill_constants(_RUNNER.read_text(encoding="utf-8"), {"SPEC": spec},
                             comment=("Filled in by fleetrl for one repository task.",),
                             where="harness/repo_tasks_runner.py")
    blob = base64.b64encode(zlib.compress(program.encode(), 9)).decode()
    return f"python3 -I -c \"import base64,zlib;exec(zlib.decompress(base64.b64decode('{blob}')))\""


def _prompt(tree: SourceTree, bug: BugSpec, workdir: str, pythonpath: list[str]) -> str:
    path = ":".join(posixpath.join(workdir, p).rstrip("/.") or workdir for p in pythonpath)
    return (
        f"{bug.instruction.strip()}\n\n"
        f"The repository of {tree.name} {tree.version} is checked out in {workdir} (a git repository). "
        "Find the cause in its source code and fix it there. Tests that check the fix are hidden from "
        "you and run after you finish; you may write and run your own (for example "
        f"`PYTHONPATH={path} python3 -m pytest`). The sandbox has no network access."
    )


def _setup_command(tree: SourceTree) -> str:
    message = shlex.quote(f"{tree.name} {tree.version}")
    return ("git init -q -b main && git add -A -f && "
            "GIT_AUTHOR_DATE='2000-01-01T00:00:00Z' GIT_COMMITTER_DATE='2000-01-01T00:00:00Z' "
            "git -c user.name=fleetrl -c user.email=fleetrl@localhost -c commit.gpgsign=false "
            f"commit -q -m {message}")


def build_repo_tasks(
    tree: SourceTree,
    spec: RepoSpec,
    *,
    image: str = DEFAULT_IMAGE,
    workdir: str = DEFAULT_WORKDIR,
    evaluator_timeout_s: float = 120.0,
    limits: Limits | None = None,
) -> list[RepoTask]:
    """One `RepoTask` per declared bug, in order (module docstring). The tree must be
    the spec's package and version; any bad bug raises `TaskError` naming it."""
    if _normal_name(tree.name) != _normal_name(spec.name) or tree.version != spec.version:
        raise TaskError(f"the sdist is {tree.name} {tree.version}, the bugs are declared for "
                        f"{spec.name} {spec.version}", where=f"package {spec.name!r}")
    conftests = sorted(p for p in tree.files if posixpath.basename(p) == "conftest.py")
    configs = {p: tree.files[p] for p in PYTEST_CONFIG_FILES if p in tree.files}
    out = []
    for bug in spec.bugs:
        where = f"bug {bug.id!r}"
        original, buggy = apply_bug(tree, bug)
        hidden: dict[str, str] = {}
        for i, test_id in enumerate(bug.tests):
            path = hidden_file_of(test_id)
            if _check_relative_path(path) is not None or not path.endswith(".py"):
                raise TaskError(f"{test_id!r} is not a pytest node id or test file (path.py[::name...])",
                                where=where, field=f"tests[{i}]")
            if path not in tree.files:
                raise TaskError(f"test file {path} is not in {tree.name} {tree.version}", where=where,
                                field=f"tests[{i}]")
            if path == bug.file:
                raise TaskError(f"the bug's own file {path} would be hidden as a test file", where=where,
                                field=f"tests[{i}]")
            hidden[path] = tree.files[path]
        runner_spec = {
            "tests": list(bug.tests),
            "pythonpath": list(spec.pythonpath),
            "protected": {**configs, **{p: tree.files[p] for p in conftests if p not in hidden}, **hidden},
            "conftests": conftests,
        }
        command = evaluator_command(runner_spec)
        if len(command) > MAX_EVALUATOR_CHARS:
            raise TaskError(f"the hidden tests make an evaluator command of {len(command)} characters "
                            f"(at most {MAX_EVALUATOR_CHARS}); hide fewer or smaller test files",
                            where=where, field="tests")
        files = {p: t for p, t in tree.files.items() if p not in hidden}
        files[bug.file] = buggy
        task = Task(
            id=f"repo:{tree.name}-{tree.version}:{bug.id}",
            prompt=_prompt(tree, bug, workdir, spec.pythonpath),
            image=image,
            workdir=workdir,
            setup=Setup(files=files, commands=[_setup_command(tree)]),
            evaluator=Evaluator(command=command, timeout_s=evaluator_timeout_s, reward="json"),
            limits=limits if limits is not None else Limits(),
            metadata={
                "repo.name": tree.name,
                "repo.version": tree.version,
                "repo.bug": bug.id,
                "repo.file": bug.file,
                "repo.tests": json.dumps(list(bug.tests)),
            },
            source=Source(kind="user", ref=f"{tree.name}-{tree.version}:{bug.id}"),
        )
        out.append(RepoTask(task=task, bug=bug, fix={bug.file: original}))
    return out

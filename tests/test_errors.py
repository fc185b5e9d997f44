"""One error root per package: every exception class a package defines derives from a class
in that package's ``errors.py`` (the nearest one up the tree), so a caller catches one name
for anything the package raises. Programs that run on their own inside a sandbox
(``programs/``, ``scripts/``) stand apart: they cannot import fleetrl."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = ("daemon", "harness", "sandboxes", "grpo", "actors")
STANDALONE = {"programs", "scripts"}


def package_dirs() -> list[Path]:
    out = []
    for top in TOP:
        for init in sorted((ROOT / top).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT)
            if not STANDALONE & set(rel.parts):
                out.append(init.parent)
    return out


def errors_module_for(package: Path) -> Path | None:
    """The package's own errors.py, else the nearest ancestor package's."""
    for d in (package, *package.parents):
        if not d.is_relative_to(ROOT) or d == ROOT:
            return None
        if (d / "errors.py").exists():
            return d / "errors.py"
    return None


def dotted(path: Path) -> str:
    """The module name of a file (a package's ``__init__.py`` is the package)."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(("fleetrl", *parts))


def defined_exceptions(package: Path) -> list[tuple[str, type]]:
    """(module:line, class) for each exception class defined at top level of a module of
    the package (not of its subpackages)."""
    found = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = [node for node in tree.body if isinstance(node, ast.ClassDef)]
        if not names:
            continue
        module = importlib.import_module(dotted(path))
        for node in names:
            obj = getattr(module, node.name, None)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", obj))
    return found


def roots_of(errors_py: Path) -> tuple[type, ...]:
    module = importlib.import_module(dotted(errors_py))
    return tuple(
        obj for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__
    )


def problems_of(package: Path) -> list[str]:
    exceptions = defined_exceptions(package)
    if not exceptions:
        return []
    errors_py = errors_module_for(package)
    where = package.relative_to(ROOT)
    if errors_py is None:
        return [f"{where}: defines {[c.__name__ for _, c in exceptions]} but has no errors.py"]
    roots = roots_of(errors_py)
    return [
        f"{at}: {cls.__name__} derives from nothing in {errors_py.relative_to(ROOT)}"
        for at, cls in exceptions
        if not issubclass(cls, roots)
    ]


@pytest.mark.parametrize("package", package_dirs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_exception_derives_from_its_packages_root(package: Path):
    problems = problems_of(package)
    assert not problems, "\n".join(problems)


def test_the_check_catches_a_stray_exception(tmp_path: Path, monkeypatch):
    """A package whose module defines an exception outside its errors.py root is flagged."""
    pkg = ROOT / "actors" / "pool"
    errors = roots_of(pkg / "errors.py")
    assert errors, "the pool has an errors.py with classes"

    class Stray(ValueError):
        pass

    import fleetrl.actors.pool.routing as routing

    monkeypatch.setattr(routing, "Stray", Stray, raising=False)
    source = (pkg / "routing.py").read_text(encoding="utf-8") + "\n\nclass Stray(ValueError):\n    pass\n"
    real_read = Path.read_text

    def read_text(self, *a, **k):
        return source if self == pkg / "routing.py" else real_read(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert any("Stray derives from nothing" in p for p in problems_of(pkg))


EMBEDDABLE = ("sandboxes", "grpo")
"""Packages that import nothing else of fleetrl (they can be embedded alone), so their
roots (`SandboxError`, `BadLossInput`) cannot derive from the daemon's `FleetrlError`."""


def root_problems() -> list[str]:
    """Each errors.py outside the embeddable packages: a root (a class whose bases hold no
    class of the same module) that does not derive from `FleetrlError`."""
    from fleetrl.daemon.errors import FleetrlError

    problems = []
    for top in ("daemon", "harness", "actors"):
        for errors_py in sorted((ROOT / top).rglob("errors.py")):
            if STANDALONE & set(errors_py.relative_to(ROOT).parts):
                continue
            for cls in roots_of(errors_py):
                own_bases = [b for b in cls.__bases__ if b.__module__ == cls.__module__]
                if not own_bases and not issubclass(cls, FleetrlError):
                    problems.append(f"{errors_py.relative_to(ROOT)}: {cls.__name__} does not derive from FleetrlError")
    return problems


def test_every_root_outside_the_embeddable_packages_derives_from_fleetrl_error():
    """What daemon/errors.py promises: a caller catches `FleetrlError` for anything fleetrl
    refused on purpose (sandboxes/ and grpo/ keep roots of their own: `EMBEDDABLE`)."""
    problems = root_problems()
    assert not problems, "\n".join(problems)
    from fleetrl.actors.pool.errors import UnknownSampler
    from fleetrl.daemon.errors import FleetrlError
    from fleetrl.harness.errors import TaskError

    assert issubclass(UnknownSampler, (FleetrlError, KeyError)) and issubclass(TaskError, ValueError)
    assert issubclass(TaskError, FleetrlError) and issubclass(UnknownSampler, FleetrlError)

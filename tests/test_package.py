"""The package layout: each top-level folder is a subpackage of `fleetrl`."""
import importlib

import pytest
import trio


@pytest.mark.parametrize("name", ["daemon", "actors", "harness", "sandboxes", "grpo"])
def test_subpackages_import(name):
    mod = importlib.import_module(f"fleetrl.{name}")
    assert mod.__name__ == f"fleetrl.{name}"


async def test_trio_mode_runs_async_tests():
    with trio.fail_after(1):
        await trio.sleep(0)


def _pyproject() -> dict:
    import tomllib
    from pathlib import Path

    return tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())


def test_every_subpackage_is_listed_so_a_wheel_holds_it():
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {"fleetrl." + ".".join(p.parent.relative_to(repo).parts)
             for top in ("daemon", "actors", "harness", "sandboxes", "grpo") for p in (repo / top).rglob("__init__.py")}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_every_program_file_read_at_run_time_is_package_data():
    """Files in a package folder without __init__.py (programs a sandbox runs, scripts)
    only reach a wheel through package-data."""
    import fnmatch
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    data = _pyproject()["tool"]["setuptools"]["package-data"]
    missing = []
    for top in ("daemon", "actors", "harness", "sandboxes", "grpo"):
        for path in (repo / top).rglob("*"):
            if not path.is_file() or path.suffix not in (".py", ".sh") or (path.parent / "__init__.py").exists():
                continue
            if "__pycache__" in path.parts:
                continue
            owner = next(p for p in path.parents if (p / "__init__.py").exists())
            package = "fleetrl." + ".".join(owner.relative_to(repo).parts)
            rel = path.relative_to(owner).as_posix()
            if not any(fnmatch.fnmatch(rel, pat) for pat in data.get(package, []) + data.get("*", [])):
                missing.append(f"{package}: {rel}")
    assert missing == []

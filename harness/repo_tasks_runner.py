"""The evaluator of a repository task, run in the sandbox after the agent stops.

Standalone: standard library and the sandbox's pytest only, nothing of fleetrl. The
task's evaluator command carries this file, with its ``SPEC`` filled in for the task
(`program_files.fill_constants`), compressed inside the command line itself, so no
part of it (the hidden tests above all) is in the sandbox while the agent works.

What it does, in the task's work dir (the repository):

1. writes back the protected files (the hidden tests, every ``conftest.py`` of the
   original tree, the root's pytest configuration) with their original text, over
   whatever the agent left there, and deletes every ``conftest.py`` the agent added;
2. puts the repository's import roots (``SPEC["pythonpath"]``) first on ``sys.path``
   and runs pytest in this process on the declared test ids, recording the outcome of
   every test it runs;
3. prints one JSON line, ``{"reward": passed / declared, "passed": [...], "failed": [...]}``.

A declared id passes when pytest ran at least one test under it (the id itself, its
parametrized cases ``id[...]``, or the tests of a file or class ``id::...``) and every
one of them passed (setup, call and teardown); a collection error, a skip or a missing
test is a failure. The agent's code runs in the same process as the tests: this guards
against tests the agent edited, deleted or shadowed, not against code written to forge
pytest's reports.
"""

from __future__ import annotations

import json
import os
import sys

# --- fleetrl: task constants (replaced for each task) ---
SPEC = {"tests": ["test_sample.py::test_one"], "pythonpath": ["."], "conftests": [], "protected": {"test_sample.py": "def test_one():\n    assert True\n"}}  # noqa: E501
# --- fleetrl: end of task constants ---


def restore(protected: dict, conftests: list) -> None:
    """Write the protected files back; delete ``conftest.py`` files not in ``conftests``."""
    for rel, text in protected.items():
        parent = os.path.dirname(rel)
        if parent:
            os.makedirs(parent, exist_ok=True)
        if os.path.isdir(rel) and not os.path.islink(rel):
            raise SystemExit(f"repo task evaluator: {rel} is a directory, expected the file")
        if os.path.lexists(rel):
            os.remove(rel)
        with open(rel, "w", encoding="utf-8") as f:
            f.write(text)
    allowed = {os.path.normpath(c) for c in conftests}
    for root, dirs, files in os.walk("."):
        dirs[:] = [d for d in dirs if d != ".git"]
        if "conftest.py" in files:
            rel = os.path.normpath(os.path.join(root, "conftest.py"))
            if rel not in allowed:
                os.remove(rel)


class Recorder:
    """A pytest plugin: node id -> whether that test ran and every phase of it passed."""

    def __init__(self) -> None:
        self.ran: set[str] = set()
        self.broken: set[str] = set()

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" and report.passed:
            self.ran.add(report.nodeid)
        elif report.failed or report.when == "call":
            self.broken.add(report.nodeid)  # a failed phase, or a call skipped or xfailed

    @property
    def outcomes(self) -> dict[str, bool]:
        return {n: n in self.ran and n not in self.broken for n in self.ran | self.broken}


def verdict(test_id: str, outcomes: dict) -> bool:
    """Whether the declared ``test_id`` passed (module docstring)."""
    mine = [ok for nodeid, ok in outcomes.items()
            if nodeid == test_id or nodeid.startswith(test_id + "::") or nodeid.startswith(test_id + "[")]
    return bool(mine) and all(mine)


def main(spec: dict) -> int:
    sys.dont_write_bytecode = True
    for var in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        os.environ.pop(var, None)
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # the repository's own conftest files only
    restore(spec["protected"], spec["conftests"])
    for entry in reversed(spec["pythonpath"]):
        sys.path.insert(0, os.path.abspath(entry))
    import pytest

    recorder = Recorder()
    pytest.main(["-q", "--tb=short", "-p", "no:cacheprovider", "--rootdir", ".", *spec["tests"]],
                plugins=[recorder])
    passed = [t for t in spec["tests"] if verdict(t, recorder.outcomes)]
    failed = [t for t in spec["tests"] if t not in passed]
    sys.stdout.flush()
    print(json.dumps({"reward": len(passed) / len(spec["tests"]), "passed": passed, "failed": failed}))
    return 0


if __name__ == "__main__":
    sys.exit(main(SPEC))

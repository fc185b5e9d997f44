"""Repository tasks from real sdists (iniconfig 1.1.1, toolz 0.12.1, downloaded once from
PyPI and cached under ~/.cache/fleetrl/sdists), checked in real Docker sandboxes.

Checked: every bundled bug is kept by the validation; in the sandbox the repository has
exactly one commit, a clean tree and none of the hidden test files; doing nothing
scores 0 even when the agent plants its own version of a hidden test and a conftest.py
that would make tests pass; the reference fix scores 1; a bug whose declared tests do
not all fail is rejected with the score as the reason.
"""

from __future__ import annotations

import posixpath
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import trio

from fleetrl.harness.protocol import evaluate_in_sandbox, prepare_sandbox
from fleetrl.harness.repo_tasks import BugSpec, build_repo_tasks, hidden_file_of
from fleetrl.harness.repo_tasks_check import validate_repo_tasks
from fleetrl.harness.repo_tasks_sdist import load_bug_file, read_sdist
from fleetrl.sandboxes import Engine, open_sandbox

pytestmark = pytest.mark.docker

SDISTS = {"iniconfig": "1.1.1", "toolz": "0.12.1"}
CACHE = Path.home() / ".cache" / "fleetrl" / "sdists"


@pytest.fixture(scope="session")
def sdists() -> dict[str, Path]:
    """Package name -> its sdist, downloaded with pip on the first run (a failed
    download fails the test)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, version in SDISTS.items():
        found = sorted(CACHE.glob(f"{name}-{version}.tar.gz"))
        if not found:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                f"{name}=={version}", "-d", str(CACHE)], capture_output=True, text=True, timeout=300)
            found = sorted(CACHE.glob(f"{name}-{version}.tar.gz"))
            if r.returncode != 0 or not found:
                pytest.fail(f"pip download {name}=={version} failed ({r.returncode}): {r.stderr[-2000:]}")
        out[name] = found[0]
    return out


@pytest.fixture
def engine(docker_client) -> Engine:
    return Engine(docker_client)


async def test_every_bundled_bug_is_kept(sdists, engine, ownership):
    specs = load_bug_file()
    built = []
    for name, path in sdists.items():
        built += build_repo_tasks(read_sdist(path), specs[name])
    assert len(built) == sum(len(specs[n].bugs) for n in sdists) >= 6
    with trio.fail_after(150):
        result = await validate_repo_tasks(built, engine, ownership=ownership, concurrency=2)
    assert result.rejected == []
    assert [rt.task.id for rt in result.kept] == [rt.task.id for rt in built]


async def sh(sb, cmd: str) -> str:
    r = await sb.exec(cmd, timeout=30)
    assert r.exit_code == 0, (cmd, r.stderr)
    return r.stdout.decode()


async def test_sandbox_repo_has_one_commit_no_hidden_tests_and_cannot_be_gamed(sdists, engine, ownership, image):
    (rt, *_) = build_repo_tasks(read_sdist(sdists["iniconfig"]), load_bug_file()["iniconfig"])
    task = rt.task
    hidden = {hidden_file_of(t) for t in rt.bug.tests}
    assert hidden == {"testing/test_iniconfig.py"}
    with trio.fail_after(60):
        async with open_sandbox(engine, image=image, ownership=ownership) as sb:
            await prepare_sandbox(task, sb)
            assert (await sh(sb, "git rev-list --count --all")).strip() == "1"
            assert (await sh(sb, "git status --porcelain --ignored")).strip() == ""
            listed = set((await sh(sb, "git ls-files")).split())
            assert listed == set(task.setup.files)
            assert "testing/conftest.py" in listed and not listed & hidden
            assert (await sb.exec(["test", "-e", "testing/test_iniconfig.py"])).exit_code == 1
            assert rt.bug.new in await sh(sb, f"cat {rt.bug.file}")

            # the agent games it: its own passing version of the hidden test, a conftest that passes everything
            await sb.write_files({
                "testing/test_iniconfig.py": "def test_iniconfig_lineof():\n    pass\n",
                "conftest.py": "import pytest\n\n@pytest.hookimpl(tryfirst=True)\n"
                               "def pytest_runtest_call(item):\n    return True\n",
                "testing/conftest.py": "collect_ignore = ['test_iniconfig.py']\n",
            })
            reward, _, out = await evaluate_in_sandbox(task, sb)
            assert reward == 0.0, out
            assert "test_iniconfig_lineof" in out.splitlines()[-1]

            await sb.write_files({posixpath.join(task.workdir, p): t for p, t in rt.fix.items()})
            reward, _, out = await evaluate_in_sandbox(task, sb)
            assert reward == 1.0, out


async def test_a_bug_whose_tests_do_not_all_fail_is_rejected(sdists, engine, ownership):
    spec = load_bug_file()["iniconfig"]
    lineof = spec.bugs[0]
    half = msgspec.structs.replace(lineof, id="half", tests=[*lineof.tests, "testing/test_iniconfig.py::test_section_get"])
    (rt,) = build_repo_tasks(read_sdist(sdists["iniconfig"]), msgspec.structs.replace(spec, bugs=[half]))
    with trio.fail_after(60):
        result = await validate_repo_tasks([rt], engine, ownership=ownership)
    assert result.kept == []
    ((rejected),) = result.rejected
    assert rejected.task_id == rt.task.id
    assert "doing nothing scores 0.5, must be 0" in rejected.reason
    assert isinstance(half, BugSpec)

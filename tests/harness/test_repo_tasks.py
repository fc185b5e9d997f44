"""Repository tasks without Docker: a small sdist made here, the bug file, the errors
naming the bug at fault, and the evaluator itself run in a directory (as the sandbox
runs it, with this interpreter standing in for the sandbox's python3).

The real sdists in real sandboxes: test_repo_tasks_docker.py.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetrl.harness.cli import main as cli_main
from fleetrl.harness.errors import HarnessError, TaskError
from fleetrl.harness.repo_tasks import (
    BugSpec,
    RepoSpec,
    SourceTree,
    apply_bug,
    build_repo_tasks,
    parse_bug_file,
    spec_for,
)
from fleetrl.harness.repo_tasks_sdist import load_bug_file, read_sdist
from fleetrl.harness.tasks import decode_task_json, encode_task_json, load_tasks_jsonl, reward_from_evaluator

MOD = '''def double(x):
    return x * 2


def half(x):
    return x / 2
'''
TESTS = '''import pytest
from mini.mod import double, half


def test_double():
    assert double(3) == 6


@pytest.mark.parametrize("x", [0, 1, 2])
def test_double_many(x):
    assert double(x) == x + x


def test_half():
    assert half(4) == 2


class TestBoth:
    def test_roundtrip(self):
        assert half(double(5)) == 5
'''
FILES = {
    "PKG-INFO": "Metadata-Version: 2.1\nName: mini\nVersion: 1.0\n",
    "setup.cfg": "[tool:pytest]\ntestpaths = tests\n",
    "mini/__init__.py": "",
    "mini/mod.py": MOD,
    "tests/conftest.py": "",
    "tests/test_mod.py": TESTS,
    "tests/test_other.py": "def test_ok():\n    assert True\n",
}
BUG = BugSpec(id="double-adds", file="mini/mod.py", old="return x * 2", new="return x + 2",
              tests=["tests/test_mod.py::test_double", "tests/test_mod.py::test_double_many",
                     "tests/test_mod.py::TestBoth"],
              instruction="double(3) returns 5.")


def make_sdist(path: Path, files: dict[str, str | bytes], top: str = "mini-1.0") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for rel, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = tarfile.TarInfo(f"{top}/{rel}" if top else rel)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def tree(**changes: str) -> SourceTree:
    return SourceTree(name="mini", version="1.0", files={**FILES, **changes})


def spec(*bugs: BugSpec) -> RepoSpec:
    return RepoSpec(name="mini", version="1.0", bugs=list(bugs or [BUG]))


def run_task(task, workdir: Path, extra: dict[str, str] | None = None) -> float:
    """Setup files and commands, then ``extra`` (the agent's or the fix's files), then the
    evaluator: all with ``sh -c`` in ``workdir``, python3 being this interpreter."""
    for rel, text in task.setup.files.items():
        (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
        (workdir / rel).write_text(text)
    for cmd in task.setup.commands:
        subprocess.run(["sh", "-c", cmd], cwd=workdir, check=True, capture_output=True, timeout=60)
    for rel, text in (extra or {}).items():
        (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
        (workdir / rel).write_text(text)
    cmd = task.evaluator.command.replace("python3 ", f"{sys.executable} ", 1)
    r = subprocess.run(["sh", "-c", cmd], cwd=workdir, capture_output=True, text=True, timeout=120)
    return reward_from_evaluator(task, r.returncode, r.stdout)


def test_read_sdist_takes_text_files_and_leaves_out_binaries(tmp_path):
    path = make_sdist(tmp_path / "mini-1.0.tar.gz", {**FILES, "logo.png": b"\x89PNG\xff\xfe"})
    t = read_sdist(path)
    assert (t.name, t.version) == ("mini", "1.0")
    assert t.files == FILES
    assert t.skipped == ("logo.png",)


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d / "absent.tar.gz", "no such file"),
    (lambda d: (d / "x.tar.gz").write_bytes(b"not a tarball") and d / "x.tar.gz", "not a readable tar archive"),
    (lambda d: make_sdist(d / "x.tar.gz", {"a/PKG-INFO": FILES["PKG-INFO"], "b/y.py": ""}, top=""),
     "one top directory, this archive has 2"),
    (lambda d: make_sdist(d / "x.tar.gz", {"mod.py": "x = 1\n"}), "no PKG-INFO"),
    (lambda d: make_sdist(d / "x.tar.gz", {"PKG-INFO": "Metadata-Version: 2.1\nName: mini\n"}), "lacks Name or Version"),
    (lambda d: make_sdist(d / "x.tar.gz", {"../evil.py": "x"}, top=""), "outside the archive"),
])
def test_bad_sdists_are_named_errors(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(TaskError, match=message) as info:
        read_sdist(path)
    assert info.value.where == str(path)


def test_tasks_hide_the_tests_apply_the_bug_and_round_trip():
    (rt,) = build_repo_tasks(tree(), spec())
    task = rt.task
    assert task.id == "repo:mini-1.0:double-adds"
    assert "tests/test_mod.py" not in task.setup.files
    assert task.setup.files["tests/test_other.py"] == FILES["tests/test_other.py"]
    assert "return x + 2" in task.setup.files["mini/mod.py"]
    assert rt.fix == {"mini/mod.py": MOD}
    assert TESTS not in task.evaluator.command and "def test_double" not in task.evaluator.command
    assert task.evaluator.reward == "json"
    assert task.prompt.startswith("double(3) returns 5.") and "/work" in task.prompt
    assert json.loads(task.metadata["repo.tests"]) == BUG.tests
    assert decode_task_json(encode_task_json(task), where="rt") == task


def test_evaluator_scores_the_declared_tests_and_restores_what_the_agent_touched(tmp_path):
    (rt,) = build_repo_tasks(tree(), spec())
    (tmp_path / "nothing").mkdir()
    assert run_task(rt.task, tmp_path / "nothing") == 0.0
    # the agent rewrites the hidden tests and adds a conftest that ignores them: no effect
    (tmp_path / "gamed").mkdir()
    gamed = {"tests/test_mod.py": "def test_double():\n    pass\n", "conftest.py": "collect_ignore = ['tests']\n"}
    assert run_task(rt.task, tmp_path / "gamed", gamed) == 0.0
    (tmp_path / "fixed").mkdir()
    assert run_task(rt.task, tmp_path / "fixed", rt.fix) == 1.0
    # a partial fix: right below 3 only -> test_double_many passes, test_double and TestBoth fail
    (tmp_path / "partial").mkdir()
    partial = {"mini/mod.py": MOD.replace("return x * 2", "return x * 2 if x < 3 else x + 2")}
    assert run_task(rt.task, tmp_path / "partial", partial) == pytest.approx(1 / 3)
    # a broken package (import error): every declared test fails, the reward is still read
    (tmp_path / "broken").mkdir()
    assert run_task(rt.task, tmp_path / "broken", {"mini/mod.py": "def double(:\n"}) == 0.0


def _bug(**changes) -> BugSpec:
    return msgspec.structs.replace(BUG, **changes)


@pytest.mark.parametrize(("bug", "field", "message"), [
    (_bug(file="mini/absent.py"), "file", "mini/absent.py is not a text file of mini 1.0"),
    (_bug(file="/etc/passwd"), "file", "relative to workdir"),
    (_bug(old="return y * 3"), "old", "snippet found 0 times in mini/mod.py"),
    (_bug(old="return x", new="return -x"), "old", "snippet found 2 times in mini/mod.py"),
    (_bug(new="return x * 2"), "new", "`new` is the same as `old`"),
    (_bug(new="return x / 2"), "new", "`new` occurs 2 times"),
    (_bug(tests=["tests/test_absent.py::test_x"]), "tests[0]", "test file tests/test_absent.py is not in mini 1.0"),
    (_bug(tests=["tests/test_mod.py", "tests/README"]), "tests[1]", "not a pytest node id or test file"),
    (_bug(tests=["mini/mod.py"]), "tests[0]", "the bug's own file mini/mod.py would be hidden"),
])
def test_bad_bugs_are_errors_naming_the_bug_and_field(bug, field, message):
    with pytest.raises(TaskError) as info:
        build_repo_tasks(tree(), spec(bug))
    err = info.value
    assert isinstance(err, HarnessError)
    assert (err.where, err.field) == ("bug 'double-adds'", field)
    assert message in err.message


def test_a_tree_of_another_package_or_version_is_refused():
    with pytest.raises(TaskError, match="the sdist is mini 2.0, the bugs are declared for mini 1.0"):
        build_repo_tasks(SourceTree(name="mini", version="2.0", files=FILES), spec())
    assert build_repo_tasks(SourceTree(name="Mini", version="1.0", files=FILES), spec())


@settings(max_examples=60, deadline=None)
@given(
    snippet=st.text(st.characters(codec="ascii", categories=("L", "N", "P", "Zs")), min_size=1, max_size=8),
    filler=st.lists(st.text(st.sampled_from("ab\n "), max_size=6), min_size=1, max_size=5),
)
def test_a_snippet_is_accepted_exactly_when_it_occurs_once(snippet, filler):
    text = "\x00".join(filler)  # the snippet never contains NUL: the parts between are where it goes
    body = text.replace("\x00", snippet)
    bug = BugSpec(id="b", file="m.py", old=snippet, new="\x01", tests=["t.py"], instruction="i")
    t = SourceTree(name="m", version="1", files={"m.py": body, "t.py": ""})
    n = body.count(snippet)
    if n == 1:
        original, buggy = apply_bug(t, bug)
        assert original == body and buggy.replace("\x01", snippet) == body
    else:
        with pytest.raises(TaskError, match=f"snippet found {n} times"):
            apply_bug(t, bug)


@pytest.mark.parametrize(("toml_obj", "field", "message"), [
    ({}, "", "one table per package"),
    ({"mini": {"version": "1.0", "bugs": []}}, "mini.bugs", "length >= 1"),
    ({"mini": {"version": "1.0", "bugs": [{"id": "a"}]}}, "mini.bugs[0].file", "missing required field `file`"),
    ({"mini": {"version": "1.0", "bugs": [{**msgspec.structs.asdict(BUG), "extra": 1}]}}, "mini.bugs[0].extra",
     "unknown field"),
    ({"mini": {"version": "1.0", "bugs": [msgspec.structs.asdict(BUG)] * 2}}, "mini.bugs[1].id", "duplicate bug id"),
    ({"mini pkg": {"version": "1.0", "bugs": [msgspec.structs.asdict(BUG)]}}, "mini pkg", "not a package name"),
])
def test_bad_bug_files_are_errors_naming_the_field(toml_obj, field, message):
    with pytest.raises(TaskError) as info:
        parse_bug_file(toml_obj, where="bugs.toml")
    assert (info.value.where, info.value.field) == ("bugs.toml", field)
    assert message in info.value.message


def test_bundled_bug_file_declares_iniconfig_and_toolz(tmp_path):
    specs = load_bug_file()
    assert {n: (s.version, len(s.bugs)) for n, s in specs.items()} == {"iniconfig": ("1.1.1", 4), "toolz": ("0.12.1", 4)}
    assert spec_for(specs, "IniConfig") is specs["iniconfig"] and spec_for(specs, "nope") is None
    (tmp_path / "bad.toml").write_text("[mini\n")
    with pytest.raises(TaskError, match="invalid TOML"):
        load_bug_file(tmp_path / "bad.toml")
    with pytest.raises(TaskError, match="cannot read"):
        load_bug_file(tmp_path / "absent.toml")


def test_cli_from_sdist_writes_tasks_and_names_bad_input(tmp_path, capsys):
    sdist = make_sdist(tmp_path / "mini-1.0.tar.gz", FILES)
    bugs = tmp_path / "bugs.toml"
    bugs.write_text('[mini]\nversion = "1.0"\n\n[[mini.bugs]]\nid = "double-adds"\nfile = "mini/mod.py"\n'
                    'old = "return x * 2"\nnew = "return x + 2"\ntests = ["tests/test_mod.py::test_double"]\n'
                    'instruction = "double(3) returns 5."\n')
    out = tmp_path / "tasks.jsonl"
    assert cli_main(["tasks", "from-sdist", str(sdist), "--bugs", str(bugs), "--out", str(out), "--no-validate"]) == 0
    assert "wrote 1 repository tasks of mini 1.0" in capsys.readouterr().out
    report = load_tasks_jsonl(out)
    assert [t.id for t in report.tasks] == ["repo:mini-1.0:double-adds"] and report.n_invalid == 0

    bugs.write_text(bugs.read_text().replace("return x * 2", "return y"))
    assert cli_main(["tasks", "from-sdist", str(sdist), "--bugs", str(bugs), "--out", str(out), "--no-validate"]) == 2
    assert "bug 'double-adds': old: snippet found 0 times in mini/mod.py" in capsys.readouterr().err
    assert cli_main(["tasks", "from-sdist", str(sdist), "--out", str(out), "--no-validate"]) == 2
    assert "declares no bugs for mini" in capsys.readouterr().err


def test_fetch_sdist_uses_the_cache_and_names_a_failed_download(tmp_path):
    from fleetrl.harness.repo_tasks_sdist import fetch_sdist

    cached = tmp_path / "some_pkg-1.0.tar.gz"  # PEP 625 file name of "Some-Pkg"
    cached.write_bytes(b"x")
    assert fetch_sdist("Some-Pkg", "1.0", tmp_path) == cached
    with pytest.raises(TaskError, match=r"pip download fleetrl-no-such-package-x9==0\.0\.1"):
        fetch_sdist("fleetrl-no-such-package-x9", "0.0.1", tmp_path / "empty", timeout_s=120)


def test_repo_tasks_actor_refuses_packages_its_bug_file_lacks(tmp_path):
    from fleetrl.actors.repo_tasks import RepoTasksConfig
    from fleetrl.actors.repo_tasks.actor import _build

    with pytest.raises(ValueError, match=r"repo_tasks\.packages: nope not in the bug file"):
        _build(RepoTasksConfig(out=str(tmp_path / "t.jsonl"), packages=("nope",)))
    with pytest.raises(ValueError, match="at least one package"):
        RepoTasksConfig(out="x", packages=())

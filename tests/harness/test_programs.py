"""The programs run in sandboxes (harness/programs/), run directly as the sandbox runs
them, and the way fleetrl fills in their task constants."""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
import sys
import tomllib
from importlib import resources
from pathlib import Path

import pytest

from fleetrl.harness.errors import HarnessError, ProgramError
from fleetrl.harness.evaluator_output import GROUP_END, split_group_output
from fleetrl.harness.program_files import BEGIN, END, fill_constants, fill_program, program_text

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = sorted(p.name for p in (ROOT / "harness" / "programs").iterdir() if p.suffix == ".py")
VERDICT_LINE = re.compile(r"^synthetic check: (?:-?\d+:(?:pass|wrong|raised|timeout|died|garbled|skipped) ?)+"
                          r"(?: \(.+\))?$")
SAMPLE_TESTS = 8  # the sample task of synthetic_check.py: f(x) = x + 3, eight hidden tests


def program_path(name: str) -> Path:
    path = resources.files("fleetrl.harness").joinpath("programs").joinpath(name)
    assert isinstance(path, Path)  # installed as files (editable or wheel), not zipped
    return path


def run_program(name: str, cwd: Path, *args: str, flags: tuple[str, ...] = ("-I", "-S")):
    """The program as the sandbox runs it: `python3 <flags> program`, in the work dir."""
    return subprocess.run([sys.executable, *flags, str(program_path(name)), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def sample_prompt() -> str:
    constants: dict[str, object] = {}
    exec(program_text("synthetic_check.py").partition(BEGIN)[2].partition(END)[0], constants)
    return str(constants["PROMPT"])


def test_programs_are_package_data_and_import_only_the_standard_library():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["fleetrl.harness"]
    assert PROGRAMS == ["forkserver.py", "humaneval_check.py", "synthetic_check.py"]
    for name in PROGRAMS:
        assert any(fnmatch.fnmatch(f"programs/{name}", p) for p in patterns), name
        assert program_text(name) == (ROOT / "harness" / "programs" / name).read_text()
        for node in ast.walk(ast.parse(program_text(name))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for module in modules:
                    assert module is not None and module.split(".")[0] in sys.stdlib_module_names, (name, module)


@pytest.mark.parametrize(("body", "verdict", "passed"), [
    ("    return x + 3\n<eos>", "pass", SAMPLE_TESTS),
    ("    return x\n", "wrong", 0),
    ("    raise KeyError(x)\n", "raised", 0),
])
def test_synthetic_checker_run_directly(tmp_path, body, verdict, passed):
    (tmp_path / "solution.py").write_text(sample_prompt() + body)
    done = run_program("synthetic_check.py", tmp_path)
    assert done.returncode == 0, done.stderr
    first, last = done.stdout.splitlines()
    assert VERDICT_LINE.match(first), first
    words = first.removeprefix("synthetic check: ").split()
    assert len(words) == SAMPLE_TESTS and all(w.endswith(f":{verdict}") for w in words)
    assert last == f"{passed}/{SAMPLE_TESTS}"


def test_synthetic_checker_without_a_solution_skips_every_test(tmp_path):
    done = run_program("synthetic_check.py", tmp_path)
    first, last = done.stdout.splitlines()
    assert VERDICT_LINE.match(first) and first.endswith("(cannot read solution.py: FileNotFoundError)")
    assert first.count(":skipped") == SAMPLE_TESTS and last == f"0/{SAMPLE_TESTS}"


def test_synthetic_checker_group_mode_run_directly(tmp_path):
    group = tmp_path / "group"
    for k, body in enumerate(["    return x + 3\n", "    return x\n"]):
        (group / str(k)).mkdir(parents=True)
        (group / str(k) / "solution.py").write_text(sample_prompt() + body)
    done = run_program("synthetic_check.py", tmp_path, "--group", str(group))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("@@fleetrl-attempt 0 exit=0\n") and done.stdout.endswith(GROUP_END + "\n")
    sections = split_group_output(done.stdout, 2)
    assert sorted(sections) == [0, 1]
    for k, want in ((0, f"{SAMPLE_TESTS}/{SAMPLE_TESTS}"), (1, f"0/{SAMPLE_TESTS}")):
        code, text = sections[k]
        first, last = text.splitlines()
        assert code == 0 and VERDICT_LINE.match(first) and last == want


def test_humaneval_runner_run_directly(tmp_path):
    # the sample problem asks for square(x); the runner runs with plain python3
    solution = tmp_path / "solution.py"
    solution.write_text("def square(x):\n    return x * x\n")
    done = run_program("humaneval_check.py", tmp_path, flags=())
    assert (done.returncode, done.stdout) == (0, "passed\n")
    solution.write_text("def square(x):\n    return 2 * x\n")
    done = run_program("humaneval_check.py", tmp_path, flags=())
    assert done.returncode != 0 and "AssertionError" in done.stderr and done.stdout == ""
    solution.write_text("def cube(x):\n    return x ** 3\n")
    done = run_program("humaneval_check.py", tmp_path, flags=())
    assert done.returncode == 1 and "solution.py does not define square" in done.stderr


def test_fill_constants_replaces_the_block_and_keeps_the_rest():
    text = f"import os\n\n{BEGIN}A = 1\nB = 'x'\n{END}\nprint(A, B)\n"
    out = fill_constants(text, {"A": [1, 2], "B": "it's"}, comment=["made for a test"])
    assert out == "import os\n\n# made for a test\nA = [1, 2]\nB = \"it's\"\n\nprint(A, B)\n"
    filled = fill_program("humaneval_check.py", {"SOLUTION": "s.py", "TEST": "T", "ENTRY_POINT": "g"})
    assert "\nSOLUTION = 's.py'\nTEST = 'T'\nENTRY_POINT = 'g'\n" in filled and BEGIN not in filled
    assert filled.endswith(program_text("humaneval_check.py").partition(END)[2])


@pytest.mark.parametrize(("text", "constants", "match"), [
    ("A = 1\n", {"A": 2}, "no block of task constants"),
    (f"{BEGIN}A = 1\n", {"A": 2}, "no block of task constants"),
    (f"{BEGIN}A = 1\nB = 2\n{END}", {"A": 2}, "its task constants are A, B; fleetrl fills in A"),
    (f"{BEGIN}B = 1\nA = 2\n{END}", {"A": 1, "B": 2}, "are B, A; fleetrl fills in A, B"),
])
def test_fill_constants_refuses_a_block_that_does_not_match(text, constants, match):
    with pytest.raises(ProgramError, match=match) as info:
        fill_constants(text, constants, where="p.py")
    assert isinstance(info.value, HarnessError) and str(info.value).startswith("p.py: ")

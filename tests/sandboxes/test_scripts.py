"""The programs a sandbox runs for us are files of the package (sandboxes/scripts/),
found through importlib.resources, installed as package data, and what the sandbox
runs; the parsers of what they print."""

from __future__ import annotations

import fnmatch
import subprocess
import tomllib
from importlib.resources import files
from pathlib import Path

import msgspec
import pytest
import trio

from fleetrl.sandboxes import ExecResult, open_sandbox, sandbox
from fleetrl.sandboxes.programs import (
    FINAL_MARK,
    FINAL_SCRIPT,
    OOM_PROBE,
    RESET_SCRIPT,
    RUNNER_SOURCE,
    final_status,
    finish_final,
    script_text,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = files("fleetrl.sandboxes") / "scripts"
SHELL = ("fleetrl_reset.sh", "reset.sh", "final.sh", "oom_probe.sh")


def test_the_programs_are_the_files_content():
    text = {name: (SCRIPTS / name).read_text() for name in (*SHELL, "batch_runner.py")}
    assert RESET_SCRIPT == text["fleetrl_reset.sh"] + text["reset.sh"]
    assert FINAL_SCRIPT == text["fleetrl_reset.sh"] + text["final.sh"]
    assert OOM_PROBE == text["oom_probe.sh"] == script_text("oom_probe.sh")
    assert RUNNER_SOURCE == text["batch_runner.py"]
    assert "fleetrl_reset() {" in RESET_SCRIPT and RESET_SCRIPT.rstrip().endswith('fleetrl_reset "$1"')
    assert FINAL_MARK.decode().strip() in text["final.sh"]
    # the sandbox runs these very strings
    assert sandbox.RESET_SCRIPT is RESET_SCRIPT and sandbox.FINAL_SCRIPT is FINAL_SCRIPT
    assert sandbox.OOM_PROBE is OOM_PROBE and sandbox.RUNNER_SOURCE is RUNNER_SOURCE


@pytest.mark.parametrize("name", SHELL)
def test_shell_scripts_parse(name):
    src = FINAL_SCRIPT if name == "final.sh" else RESET_SCRIPT if name == "reset.sh" else script_text(name)
    r = subprocess.run(["/bin/sh", "-n", "-c", src], capture_output=True, timeout=10)  # -n: parse only
    assert r.returncode == 0, r.stderr


def test_every_script_is_package_data():
    """A wheel (and an editable install) carries every file of sandboxes/scripts/."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = cfg["package-data"].get("fleetrl.sandboxes", []) + cfg["package-data"].get("*", [])
    pkg_dir = ROOT / cfg["package-dir"]["fleetrl.sandboxes"]
    on_disk = sorted(p.relative_to(pkg_dir).as_posix() for p in (pkg_dir / "scripts").iterdir() if p.is_file())
    assert set(on_disk) >= {*(f"scripts/{n}" for n in SHELL), "scripts/batch_runner.py"}
    missing = [f for f in on_disk if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not missing, f"not package data (pyproject [tool.setuptools.package-data]): {missing}"


def _raw(stderr: bytes, *, exit_code: int = 0, timed_out: bool = False) -> ExecResult:
    return ExecResult(exit_code=exit_code, stdout=b"", stderr=stderr, stdout_truncated=False, stderr_truncated=False,
                      stdout_bytes=0, stderr_bytes=len(stderr), duration_s=0.1, timed_out=timed_out, oom_killed=False)


def test_final_status_line_is_read_and_stripped():
    raw = _raw(b"oops\n" + FINAL_MARK + b"3 0\n")
    r, clean = finish_final(raw, raw.stderr[-256:])
    assert (r.exit_code, r.stderr, r.stderr_bytes, clean) == (3, b"oops\n", 5, True)
    assert finish_final(_raw(FINAL_MARK + b"0 5\n"), FINAL_MARK + b"0 5\n")[1] is False  # the reset failed
    for tail in (b"", b"no line\n", FINAL_MARK + b"1\n", FINAL_MARK + b"x 0\n", FINAL_MARK + b"0 0"):
        assert final_status(tail) is None, tail
    # only the wrapper's own exit 0 makes the line genuine
    for raw in (_raw(FINAL_MARK + b"0 0\n", exit_code=137), _raw(FINAL_MARK + b"0 0\n", timed_out=True)):
        assert finish_final(raw, raw.stderr) == (raw, False)
    over = msgspec.structs.replace(_raw(FINAL_MARK + b"0 0\n"), output_limit_exceeded=True)
    assert finish_final(over, over.stderr) == (over, False)


@pytest.mark.docker
async def test_the_reset_script_file_wipes_the_sandbox(engine, image, ownership):
    with trio.fail_after(60):
        async with open_sandbox(engine, image=image, ownership=ownership) as sb:
            await sb.write_files({"left.txt": "x", "/tmp/.hidden": "y"})
            r = await sb.exec(["/bin/sh", "-c", RESET_SCRIPT, "reset", sb.limits.workdir], timeout=20)
            assert r.exit_code == 0, r.stderr
            r = await sb.exec("ls -A /work /tmp")
            assert r.stdout == b"/tmp:\n\n/work:\n", r.stdout
            assert await sb.reset()

"""The synthetic checker's group mode run on this machine: each reported section is
exactly what the per-attempt checker prints for that solution."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fleetrl.harness.synthetic import (
    CHECK_FILE,
    SOLUTION_FILE,
    make_task,
    reference_solution,
    run_check_locally,
    solution_text,
)
from fleetrl.harness.tasks import GROUP_DIR, split_group_output


def test_group_mode_reports_what_each_solution_gets_alone(tmp_path):
    task = make_task(5, "train", 2)
    good = solution_text(task, reference_solution(task))
    sols = [good, "def f(x):\n    return 0\n", "def f(x):\n    raise ValueError\n", "def f(:\n",
            "    return x\n", "", good]
    for rel, content in task.setup.files.items():
        (tmp_path / rel).write_text(content)
    for k, sol in enumerate(sols):
        d = tmp_path / GROUP_DIR / str(k)
        d.mkdir(parents=True)
        if sol:  # attempt 5 wrote no solution file at all
            (d / SOLUTION_FILE).write_text(sol)
    cmd = task.evaluator.group_command
    assert cmd == f"python3 -I -S {CHECK_FILE} --group {GROUP_DIR}"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(os.path.realpath(sys.executable))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["sh", "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    sections = split_group_output(done.stdout, len(sols))
    # on a shared host another process of this user may appear and end the run early
    # (the checker stops at processes it did not see before); in a sandbox it never does
    assert 0 in sections and sorted(sections) == list(range(len(sections)))
    for k, (code, text) in sections.items():
        alone = run_check_locally(task, sols[k]) if sols[k] else None
        if alone is None:
            assert text.splitlines()[-1].startswith("0/") and "cannot read" in text
        else:
            assert (code, text.splitlines()[-1]) == (alone.exit_code, alone.stdout.splitlines()[-1])
    assert Path(tmp_path / CHECK_FILE).exists()

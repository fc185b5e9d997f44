"""Held-out scoring inside a real Docker sandbox gives exactly the rewards of the
recipe's local scorer, task by task, for right, partial, wrong, crashing and looping
completions; and the bundle runs unchanged on a plain interpreter (the wrapper's
contract, without Docker)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import trio

from fleetrl.actors.evaluator import bundle_files, rewards_from_report, score_in_sandbox
from fleetrl.actors.evaluator.scoring import wrapper_argv
from fleetrl.actors.recipe import score_completions
from fleetrl.harness.synthetic import generate_tasks, reference_solution
from fleetrl.sandboxes import Limits, Ownership, WarmPolicy, open_sandbox_pool


def _cases() -> tuple[list, list[str]]:
    tasks = generate_tasks(10, split="fresh", seed=3)
    completions = [reference_solution(t) for t in tasks]
    completions[1] = "    return x"                              # wrong (some tests may pass)
    completions[2] = "    return 1/0"                            # crashes
    completions[3] = "    while True:\n        pass"             # loops: the checker's own timeout
    completions[4] = "    print('junk' * 50)\n    return x + 1"  # prints junk
    completions[5] = "    return"                                # None
    return tasks, completions


def test_bundle_runs_on_a_plain_interpreter(tmp_path):
    tasks, completions = _cases()
    for rel, content in bundle_files(tasks, completions).items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    argv = wrapper_argv(len(tasks), parallel=2, timeout_s=max(t.evaluator.timeout_s for t in tasks))
    done = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    scores = rewards_from_report(tasks, done.stdout)
    assert list(scores.rewards) == score_completions(tasks, completions)
    assert scores.rewards[0] == 1.0 and scores.rewards[2] == 0.0 and scores.rewards[3] == 0.0


def test_bundle_refuses_tasks_that_are_not_synthetic():
    tasks, completions = _cases()
    other = tasks[0].__class__(**{**{f: getattr(tasks[0], f) for f in tasks[0].__struct_fields__},
                                  "evaluator": tasks[0].evaluator.__class__(command="pytest -q")})
    with pytest.raises(ValueError, match="not a synthetic task"):
        bundle_files([other], ["    return x"])
    with pytest.raises(ValueError, match="1 tasks but 2 completions"):
        bundle_files(tasks[:1], completions[:2])


@pytest.mark.docker
async def test_scores_in_a_sandbox_equal_the_local_scorer(tmp_path):
    tasks, completions = _cases()
    expected = score_completions(tasks, completions)
    with trio.fail_after(300):
        async with open_sandbox_pool(Ownership.for_state_dir(tmp_path, owner="test-eval"),
                                     policy=WarmPolicy(min_warm=0, max_warm=1, max_containers=1)) as pool:
            async with pool.lease(limits=Limits(memory_bytes=512 << 20, timeout_s=120)) as sb:
                scores = await score_in_sandbox(sb, tasks, completions, parallel=2, timeout_s=120)
    assert list(scores.rewards) == expected
    assert scores.errors == 0 and scores.seconds > 0
    out = subprocess.run(["docker", "ps", "-aq", "--filter", "label=fleetrl.owner=test-eval"],
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == []

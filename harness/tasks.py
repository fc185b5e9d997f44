"""Tasks: the public API of what one attempt is asked to do and how it is scored.

A task names the sandbox image, the files and commands that build the starting
state, what the model is asked (a prompt, or a conversation prefix), the limits of
one attempt and the evaluator: a shell command run in the sandbox after the attempt
whose exit code or output gives a reward in [0, 1]. docs/guides/tasks.md documents the
JSONL form.

This module gathers the names from where they are defined:

* `task_schema`: the frozen structs (`Task`, `Setup`, `Evaluator`, `Limits`, ...),
  which validate themselves;
* `task_codec`: one record to and from JSON, and JSONL task files (`load_tasks_jsonl`
  reports every invalid record with its file, line and field path);
* `evaluator_output`: an evaluator's output read as a reward, a group evaluation's
  output split by attempt;
* `errors`: `TaskError`, `EvaluatorOutputError`.

Each name is re-exported explicitly (``from .x import name as name``, as Trio's
``__init__`` does), so the defining modules' ``__all__`` lists are not repeated here.
"""

from __future__ import annotations

from fleetrl.daemon.files import (
    write_atomic as write_atomic,
)

from .errors import (
    EvaluatorOutputError as EvaluatorOutputError,
    TaskError as TaskError,
)
from .evaluator_output import (
    GROUP_DIR as GROUP_DIR,
    GROUP_END as GROUP_END,
    GROUP_HEADER as GROUP_HEADER,
    reward_from_evaluator as reward_from_evaluator,
    split_group_output as split_group_output,
)
from .task_codec import (
    LoadReport as LoadReport,
    RecordError as RecordError,
    decode_task_json as decode_task_json,
    dump_tasks_jsonl as dump_tasks_jsonl,
    encode_task_json as encode_task_json,
    field_path_of as field_path_of,
    load_tasks_jsonl as load_tasks_jsonl,
    parse_task as parse_task,
    validate_task as validate_task,
)
from .task_schema import (
    DEFAULT_IMAGE as DEFAULT_IMAGE,
    DEFAULT_WORKDIR as DEFAULT_WORKDIR,
    Evaluator as Evaluator,
    FunctionCall as FunctionCall,
    Limits as Limits,
    Message as Message,
    MetadataValue as MetadataValue,
    RewardKind as RewardKind,
    Role as Role,
    Setup as Setup,
    Source as Source,
    SourceKind as SourceKind,
    Task as Task,
    ToolCall as ToolCall,
)

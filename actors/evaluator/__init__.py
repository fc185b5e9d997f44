"""fleetrl.actors.evaluator: held-out pass@1 of the trainer's versions, scored in Docker.

`records` (the ``eval.jsonl`` record, when to evaluate; pure), `scoring` (the recipe's
batched checker driver run inside one sandbox), `actor` (``fleetrl.actors.evaluator:run``).
docs/guides/tiny-run.md describes how the embedded default uses it.
"""

from .actor import run
from .config import EvalSandboxSettings, EvaluatorConfig
from .records import EvalRecord, EvalState, is_due, make_record, step_of, tool_use
from .scoring import SandboxScores, ScoringError, bundle_files, rewards_from_report, score_in_sandbox

__all__ = ["EvalRecord", "EvalSandboxSettings", "EvalState", "EvaluatorConfig", "SandboxScores", "ScoringError",
           "bundle_files", "is_due", "make_record", "rewards_from_report", "run", "score_in_sandbox", "step_of",
           "tool_use"]

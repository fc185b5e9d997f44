"""The harness's errors: one root, `HarnessError`, and a class for each party at fault.

Who broke what:

* `TaskError`: a task record (a user's JSONL line, a trace turned into a task) is
  invalid; ``where`` and ``field`` name the record and the field.
* `FieldProblem`: how a task struct's own checks name the field at fault (the
  decoder turns it into a `TaskError`).
* `EvaluatorOutputError`: a task's evaluator printed something that is no reward; the
  evaluator's (or the task author's) fault, never the model's.
* `SyntheticTaskError`: a synthetic-task function got a task that is not one of ours,
  or its checker overran the evaluator's timeout.
* `SetupFailed`: a setup command of the task failed in the sandbox.
* `ModelUnavailable`: the model (the sampler pool) could not answer.
* `ApiError`: the OpenAI-compatible endpoint refuses or fails a request; it carries
  the HTTP status and OpenAI's error fields.
* `ForkServerFailed`: the preloading fork server of a Python harness
  (`forkserver.ForkServer`) could not start, refused a run or died during one.
* `ProgramError`: a program shipped in ``harness/programs/`` lacks what fleetrl fills
  in (a packaging or editing mistake of ours).

The first three and `ForkServerFailed` keep ``ValueError`` as a second base: callers catch them as that.
"""

from __future__ import annotations

from fleetrl.daemon.errors import FleetrlError

__all__ = [
    "ApiError",
    "EvaluatorOutputError",
    "FieldProblem",
    "ForkServerFailed",
    "HarnessError",
    "ModelUnavailable",
    "ProgramError",
    "SetupFailed",
    "SyntheticTaskError",
    "TaskError",
]


class HarnessError(FleetrlError):
    """The root of every error raised by ``fleetrl.harness``."""


class TaskError(HarnessError, ValueError):
    """A task record is invalid.

    ``where`` says which record (``file:line``, a problem id, ...), ``field`` is the
    dotted path of the offending field inside the record (``""`` for the record as a
    whole, e.g. invalid JSON) and ``message`` says what is wrong with it.
    """

    def __init__(self, message: str, *, where: str = "", field: str = "") -> None:
        self.where = where
        self.field = field
        self.message = message
        parts = [p for p in (where, field) if p]
        super().__init__(": ".join([*parts, message]))


class FieldProblem(HarnessError, ValueError):
    """Raised by a task struct's ``__post_init__`` to name the sub-field at fault.

    msgspec turns it into a ValidationError located at the struct (it is a
    ValueError); the task decoder reads ``subfield`` from the chained cause to build
    the full field path of the `TaskError` it raises.
    """

    def __init__(self, subfield: str, message: str) -> None:
        self.subfield = subfield
        self.problem = message
        super().__init__(f"{subfield}: {message}")


class EvaluatorOutputError(HarnessError, ValueError):
    """The evaluator's output cannot be read as a reward (malformed JSON line, a
    reward outside [0, 1], no ``passed/total`` line, ...).

    It is the evaluator's fault (or the task author's), not the model's: an
    environment worker turns it into a typed failed attempt with ``reason``, never a
    reward of 0 that would teach the model something false.
    """

    def __init__(self, reason: str, *, task_id: str, kind: str) -> None:
        self.reason = reason
        self.task_id = task_id
        self.kind = kind
        super().__init__(f"task {task_id!r}: evaluator ({kind}): {reason}")


class SyntheticTaskError(HarnessError, ValueError):
    """A Task given to a synthetic-task function is not a valid synthetic task."""


class SetupFailed(HarnessError):
    """A setup command of the task failed: the attempt cannot start (a sandbox or
    task error, never the model's fault)."""


class ModelUnavailable(HarnessError):
    """The model could not answer (no sampler, sampler failure); not the caller's fault.

    ``retryable``: whether another try may succeed."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class ApiError(HarnessError):
    """An error answered in OpenAI's shape: HTTP ``status`` and the body `body`;
    ``retry_after_s``: sent as the ``Retry-After`` header (a refused flood's 429)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    @property
    def body(self) -> dict[str, dict[str, str | None]]:
        """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ForkServerFailed(HarnessError, ValueError):
    """The fork server of a Python harness could not start, refused a run or died during
    one (the attempt fails; it is never a reward)."""


class ProgramError(HarnessError):
    """A program of ``harness/programs/`` cannot be filled in for a task."""

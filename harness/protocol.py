"""The Harness protocol: how an agent harness runs one attempt at a task.

A harness is any object with ``async run(task, sandbox, model) -> Episode``. The
environment worker leases a sandbox, prepares it (`prepare_sandbox`: the task's setup
files and commands), calls ``run``, then scores the sandbox (`evaluate_in_sandbox`:
the task's evaluator and ``tasks.reward_from_evaluator``). The harness only acts: it
asks the model (a `model.ModelClient`, a client of the sampler pool) and works in the
sandbox.

An `Episode` holds the turns (the messages each model call saw, the call's token
record, the action taken and what it returned), the final state (``submitted``,
``turn_limit``, ``timeout``, ``error``), an optional harness-side reward signal, and
the `recording.AttemptRecord` of every model call, token-exactly.

How a harness uses its sandbox (optional class attribute ``sandbox_use``; read with
`sandbox_use_of`) lets the worker make attempts cheaper without weakening isolation:

* ``"eager"`` (the default when the attribute is absent): the harness may use anything
  of the sandbox object (its ``id``, ``limits``, ...); it gets a leased and prepared
  sandbox before ``run`` starts.
* ``"lazy"``: the harness only calls the `SandboxLike` methods (``exec``,
  ``write_files``, ``read_file``); it may get a proxy that leases and prepares a
  sandbox on its first call, so no container is held while the model generates.
* ``"files"``: the harness's whole use of the sandbox is ``write_files`` (no ``exec``,
  no ``read_file``): the files it writes may be recorded and scored later, e.g. the G
  attempts of one group in one batch (``Sandbox.exec_many``: each attempt's evaluator
  runs in a freshly reset sandbox holding the task's setup files and that attempt's
  files only). Calling ``exec`` or ``read_file`` on the recorder it gets is an error.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Literal, Protocol, runtime_checkable

import msgspec

from .chat import ChatMessage
from .errors import SetupFailed
from .model import ModelClient
from .recording import AttemptRecord, CallRecord
from .tasks import Task, reward_from_evaluator

__all__ = [
    "Episode",
    "FinalState",
    "Harness",
    "SandboxLike",
    "SANDBOX_USES",
    "SandboxUse",
    "SetupFailed",
    "Turn",
    "evaluate_in_sandbox",
    "prepare_sandbox",
    "sandbox_use_of",
]

FinalState = Literal["submitted", "turn_limit", "timeout", "error"]

SandboxUse = Literal["eager", "lazy", "files"]
SANDBOX_USES: tuple[str, ...] = ("eager", "lazy", "files")


@runtime_checkable
class SandboxLike(Protocol):
    """What a harness uses of a ``fleetrl.sandboxes.Sandbox`` (fakes implement it too).

    ``exec`` returns an object with ``exit_code`` (None if killed), ``stdout`` and
    ``stderr`` (bytes) and ``timed_out``, like ``sandboxes.ExecResult``.
    """

    async def exec(self, cmd, *, timeout=None, stdin=None, env=None, workdir=None): ...

    async def write_files(self, files: Mapping[str, bytes | str]) -> None: ...

    async def read_file(self, path: str, *, max_bytes: int = 1 << 20) -> bytes: ...


class Turn(msgspec.Struct, frozen=True, kw_only=True):
    """One step of an episode: the model call (its messages and token record), the
    action the harness took from the answer, and what the action returned."""

    messages: tuple[ChatMessage, ...]
    call: CallRecord
    action: str | None = None
    observation: str | None = None


class Episode(msgspec.Struct, frozen=True, kw_only=True):
    """What one harness run produced.

    ``harness_reward``: a reward signal the harness itself computed (None when it has
    none; the task's evaluator gives the reward that trains). ``error``: what went
    wrong when ``final_state`` is ``error``.
    """

    task_id: str
    turns: tuple[Turn, ...]
    final_state: FinalState
    record: AttemptRecord
    harness_reward: float | None = None
    error: str | None = None

    @property
    def n_calls(self) -> int:
        return len(self.record.calls)


@runtime_checkable
class Harness(Protocol):
    """An agent harness: runs one attempt at ``task`` in ``sandbox`` with ``model``."""

    async def run(self, task: Task, sandbox: SandboxLike, model: ModelClient) -> Episode: ...


def sandbox_use_of(harness: object) -> SandboxUse:
    """The harness's declared ``sandbox_use`` (module docstring); ``"eager"`` when it
    declares none. A value outside `SANDBOX_USES` is an error naming the harness."""
    use = getattr(harness, "sandbox_use", "eager")
    if use not in SANDBOX_USES:
        raise ValueError(f"{type(harness).__name__}.sandbox_use = {use!r}: must be one of "
                         f"{', '.join(SANDBOX_USES)}")
    return use  # type: ignore[return-value]


def _in_workdir(task: Task, path: str) -> str:
    return posixpath.join(task.workdir, path)


async def prepare_sandbox(task: Task, sandbox: SandboxLike, *, timeout_s: float = 120.0) -> None:
    """Build the task's starting state: write ``setup.files`` into the workdir, then
    run ``setup.commands`` in order there; a failing command raises `SetupFailed`."""
    if task.setup.files:
        await sandbox.write_files({_in_workdir(task, k): v for k, v in task.setup.files.items()})
    for i, cmd in enumerate(task.setup.commands):
        r = await sandbox.exec(cmd, timeout=timeout_s, workdir=task.workdir)
        if r.exit_code != 0:
            err = (r.stderr or b"").decode(errors="replace")[-500:]
            raise SetupFailed(f"task {task.id!r}: setup.commands[{i}] {cmd!r} exited {r.exit_code}: {err}")


async def evaluate_in_sandbox(task: Task, sandbox: SandboxLike) -> tuple[float, int, str]:
    """Run the task's evaluator in the sandbox; returns (reward, exit code, stdout).

    The evaluator's hidden ``files`` are written first (relative paths in the workdir),
    so the agent never saw them. The reward follows ``tasks.reward_from_evaluator``
    (which raises ``EvaluatorOutputError`` for output it cannot read); an evaluator
    killed by its timeout has exit code -1 and is scored as such."""
    if task.evaluator.files:
        await sandbox.write_files({k if k.startswith("/") else _in_workdir(task, k): v
                                   for k, v in task.evaluator.files.items()})
    r = await sandbox.exec(task.evaluator.command, timeout=task.evaluator.timeout_s, workdir=task.workdir)
    code = -1 if r.exit_code is None else int(r.exit_code)
    stdout = (r.stdout or b"").decode(errors="replace")
    return reward_from_evaluator(task, code, stdout), code, stdout

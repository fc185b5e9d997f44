"""Run a company's own agent harness, unchanged, as an external command.

`ExternalHarness` implements `protocol.Harness` for any program that speaks the OpenAI
API (an agent CLI, mini-swe-agent, a script with the official client). For one attempt
it:

1. opens the attempt in the endpoint's `openai_api.AttemptRegistry` and gets the
   per-attempt key;
2. starts the command in its own session (process group) with ``OPENAI_BASE_URL`` (the
   endpoint's ``.../v1``) and ``OPENAI_API_KEY`` (the key) in its environment, plus
   ``FLEETRL_*`` variables naming the sandbox container, its user and work dir, and the
   task (see `ENV_VARS`); its argv may hold the placeholders of `PLACEHOLDERS`;
3. waits at most the wall-clock limit (``timeout_s``, else ``task.limits.timeout_s``);
   on timeout, or when the caller is cancelled, the whole process tree is stopped
   (SIGTERM to every process of the tree, then after ``kill_grace_s`` the tree is
   frozen with SIGSTOP until no new process appears and killed with SIGKILL:
   `processes.run_command`), and, on timeout, every process of the sandbox user in the
   sandbox is killed so nothing the harness started keeps changing the state the
   evaluator sees;
4. closes the attempt and returns an `ExternalEpisode` (an `Episode`): one `Turn` per
   recorded call, the `AttemptRecord`, the exit code and the tails of the output.

The evaluator is the task's (`protocol.evaluate_in_sandbox`); `run_attempt` does
prepare, run and evaluate in one call.

The harness runs *beside* the sandbox: it never gets the sandbox's network (there is
none) nor general access to ours beyond what the host gives the command; it acts in the
sandbox through its own extension point (for mini-swe-agent, the environment class
`fleetrl.harness.mswea_env.FleetrlSandboxEnvironment`, which runs each action with
``docker exec`` as the sandbox user in the work dir). docs/guides/external-harness.md is the
user's guide.
"""

from __future__ import annotations

import math
import os
import secrets
import string
import tempfile
from collections.abc import Mapping, Sequence

import msgspec

from .attempts import AttemptRegistry
from .forkserver import ForkServer, check_preload_argv
from .model import ModelClient
from .processes import run_command
from .protocol import Episode, FinalState, SandboxLike, Turn, evaluate_in_sandbox, prepare_sandbox
from .recording import AttemptRecord
from .tasks import Task

__all__ = [
    "ENV_VARS",
    "PLACEHOLDERS",
    "AttemptResult",
    "ExternalCommand",
    "ExternalEpisode",
    "ExternalHarness",
    "expand_argv",
    "run_attempt",
]

PLACEHOLDERS = ("prompt", "task_file", "prompt_file", "container", "user", "workdir", "base_url",
                "model", "max_turns", "attempt_id", "task_id")
"""Names an argv element may hold as ``{name}`` (``{{`` and ``}}`` are literal braces)."""

ENV_VARS = {
    "OPENAI_BASE_URL": "the endpoint, ending in /v1",
    "OPENAI_API_KEY": "the attempt's key (attribution: every call with it is recorded for this attempt)",
    "OPENAI_API_BASE": "the same as OPENAI_BASE_URL (the name older clients and litellm read)",
    "FLEETRL_MODEL": "the model name the endpoint serves",
    "FLEETRL_ATTEMPT_ID": "the attempt's id",
    "FLEETRL_TASK_ID": "the task's id",
    "FLEETRL_TASK_FILE": "the task as JSON (the task format of docs/guides/tasks.md)",
    "FLEETRL_PROMPT_FILE": "the task's request as text (the prompt, or the messages' last user content)",
    "FLEETRL_MAX_TURNS": "task.limits.max_turns",
    "FLEETRL_SANDBOX_CONTAINER": "the sandbox's Docker container id (when the sandbox has one)",
    "FLEETRL_SANDBOX_USER": "uid:gid to run commands as in the sandbox",
    "FLEETRL_SANDBOX_WORKDIR": "the task's work dir in the sandbox",
}
"""The environment an external command gets (beside ``ExternalCommand.env`` and the
variables it inherits, ``inherit_env``)."""


class ExternalCommand(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to run an external harness.

    ``argv``: the command (placeholders: `PLACEHOLDERS`). ``env``: extra environment
    variables (they override the inherited ones, never the ``OPENAI_*``/``FLEETRL_*``
    ones). ``inherit_env``: names of our own environment variables passed through
    (nothing else of ours is: no credentials leak into the harness). ``cwd``: its
    working directory (None: a fresh temporary directory, removed afterwards).
    ``timeout_s``: wall-clock limit (None: ``task.limits.timeout_s``).
    ``kill_grace_s``: time between SIGTERM and SIGKILL. ``output_cap_bytes``: bytes of
    stdout and of stderr kept (the tail). ``preload``: Python modules to import once in
    a fork server (`forkserver.ForkServer`) from which every attempt's program is forked
    instead of started afresh; ``argv`` is then ``[python, script, ...]`` or ``[python,
    -m, module, ...]`` (empty: every attempt starts a new process).
    """

    argv: tuple[str, ...]
    env: dict[str, str] = msgspec.field(default_factory=dict)
    inherit_env: tuple[str, ...] = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "DOCKER_HOST",
                                    "VIRTUAL_ENV", "PYTHONPATH")
    cwd: str | None = None
    timeout_s: float | None = None
    kill_grace_s: float = 2.0
    output_cap_bytes: int = 64 << 10
    preload: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.argv or not all(isinstance(a, str) for a in self.argv) or not self.argv[0]:
            raise ValueError(f"ExternalCommand.argv must be a non-empty list of strings, got {self.argv!r}")
        for i, a in enumerate(self.argv):
            if "\0" in a:
                raise ValueError(f"ExternalCommand.argv[{i}] holds a NUL byte")
            _check_placeholders(a, f"ExternalCommand.argv[{i}]")
        for k, v in self.env.items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise ValueError(f"ExternalCommand.env[{k!r}]: names must be non-empty without '=' or NUL, "
                                 "values without NUL")
            if k in ENV_VARS:
                raise ValueError(f"ExternalCommand.env[{k!r}]: set by the harness for each attempt")
        if self.timeout_s is not None and not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"ExternalCommand.timeout_s must be a positive number of seconds, got {self.timeout_s}")
        if not (math.isfinite(self.kill_grace_s) and self.kill_grace_s >= 0):
            raise ValueError(f"ExternalCommand.kill_grace_s must be >= 0 seconds, got {self.kill_grace_s}")
        if self.output_cap_bytes < 0:
            raise ValueError(f"ExternalCommand.output_cap_bytes must be >= 0, got {self.output_cap_bytes}")
        for i, name in enumerate(self.preload):
            if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
                raise ValueError(f"ExternalCommand.preload[{i}] must be a module name like 'openai' or "
                                 f"'litellm.utils', got {name!r}")
        if self.preload:
            try:
                check_preload_argv(self.argv)
            except ValueError as err:
                raise ValueError(f"ExternalCommand.argv: {err}") from None
            if "{" in self.argv[0]:
                raise ValueError("ExternalCommand.argv[0] (the interpreter of the preload fork server) cannot "
                                 "hold a placeholder")


    def relative_to(self, base: str) -> ExternalCommand:
        """This command with its relative paths made absolute against ``base`` (the
        directory the daemon started in, which config paths are relative to): ``argv[0]``
        when it names a path (holds a ``/``), every other element that starts with
        ``./`` or ``../``, and ``cwd``. A bare program name is still looked up in PATH;
        the command itself runs in a fresh temporary directory (``cwd`` unset), where
        relative paths would otherwise miss."""
        def fix(a: str, first: bool) -> str:
            if os.path.isabs(a) or "{" in a.split("/", 1)[0]:
                return a
            if (first and "/" in a) or a.startswith(("./", "../")):
                return os.path.normpath(os.path.join(base, a))
            return a

        argv = tuple(fix(a, i == 0) for i, a in enumerate(self.argv))
        cwd = self.cwd if self.cwd is None or os.path.isabs(self.cwd) else os.path.join(base, self.cwd)
        return msgspec.structs.replace(self, argv=argv, cwd=cwd)


class ExternalEpisode(Episode, frozen=True, kw_only=True):
    """An `Episode` of an external command: ``exit_code`` (None when it was killed),
    ``timed_out``, ``killed_pids`` (every process of its tree that was signalled), and
    the tails of its stdout and stderr."""

    exit_code: int | None = None
    timed_out: bool = False
    killed_pids: tuple[int, ...] = ()
    stdout_tail: bytes = b""
    stderr_tail: bytes = b""
    duration_s: float = 0.0


class AttemptResult(msgspec.Struct, frozen=True, kw_only=True):
    """An attempt run by `run_attempt`: the episode and the evaluator's verdict."""

    episode: Episode
    reward: float
    eval_exit_code: int
    eval_stdout: str


# --------------------------------------------------------------------------- pure helpers


def _check_placeholders(text: str, where: str) -> None:
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as err:
        raise ValueError(f"{where}: bad placeholder syntax in {text!r}: {err} (write {{{{ and }}}} for braces)") from None
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if name not in PLACEHOLDERS or spec or conv:
            raise ValueError(f"{where}: unknown placeholder {{{name}}} in {text!r}; known: "
                             + ", ".join("{" + p + "}" for p in PLACEHOLDERS))


def expand_argv(argv: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """``argv`` with each ``{name}`` replaced by ``values[name]`` (one argv element stays
    one element, whatever the value holds: no shell is involved)."""
    out = []
    for i, a in enumerate(argv):
        _check_placeholders(a, f"argv[{i}]")
        out.append(a.format_map(values))
    return out


def _prompt_text(task: Task) -> str:
    if task.prompt is not None:
        return task.prompt
    assert task.messages is not None
    users = [m.content for m in task.messages if m.role == "user"]
    return users[-1] if users else task.messages[-1].content


# the sandbox side of a timeout: kill every process of the sandbox user except this shell
_QUIESCE = ('for d in /proc/[0-9]*; do p=${d#/proc/}; [ "$p" = 1 ] || [ "$p" = $$ ] || '
            'kill -9 "$p" 2>/dev/null; done; exit 0')


# --------------------------------------------------------------------------- the harness


class ExternalHarness:
    """An external command as a `protocol.Harness` (see the module docstring).

    ``registry`` and ``base_url`` are the endpoint's (``base_url`` like
    ``http://127.0.0.1:8000``; ``/v1`` is added). The ``model`` handed to ``run`` is not
    called here: the command's calls reach the model through the endpoint, which must
    be serving the same sampler pool.
    """

    def __init__(self, command: ExternalCommand, *, registry: AttemptRegistry, base_url: str,
                 model_name: str = "fleetrl") -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"ExternalHarness: base_url {base_url!r} must be an http(s) URL")
        self.command = command
        self.registry = registry
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.model_name = model_name
        self.forkserver = (ForkServer(command.argv[0], command.preload, self._base_environment())
                           if command.preload else None)

    def _base_environment(self) -> dict[str, str]:
        """The command's environment without the attempt's variables (the fork server's)."""
        env = {k: os.environ[k] for k in self.command.inherit_env if k in os.environ}
        env.update(self.command.env)
        return env

    async def aclose(self) -> None:
        """Stop the fork server, if any (the environment worker calls it as it ends)."""
        if self.forkserver is not None:
            await self.forkserver.aclose()

    def _environment(self, task: Task, sandbox: SandboxLike, key: str, attempt_id: str, task_file: str,
                     prompt_file: str) -> dict[str, str]:
        env = self._base_environment()
        container = getattr(sandbox, "id", None)
        limits = getattr(sandbox, "limits", None)
        env.update({
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_BASE": self.base_url,
            "OPENAI_API_KEY": key,
            "FLEETRL_MODEL": self.model_name,
            "FLEETRL_ATTEMPT_ID": attempt_id,
            "FLEETRL_TASK_ID": task.id,
            "FLEETRL_TASK_FILE": task_file,
            "FLEETRL_PROMPT_FILE": prompt_file,
            "FLEETRL_MAX_TURNS": str(task.limits.max_turns),
            "FLEETRL_SANDBOX_USER": str(getattr(limits, "user", "1000:1000")),
            "FLEETRL_SANDBOX_WORKDIR": task.workdir,
        })
        if isinstance(container, str) and container:
            env["FLEETRL_SANDBOX_CONTAINER"] = container
        return env

    async def run(self, task: Task, sandbox: SandboxLike, model: ModelClient | None = None) -> ExternalEpisode:
        """One attempt: the command against the endpoint, acting in ``sandbox``."""
        attempt_id = f"{task.id}-{secrets.token_hex(6)}"
        timeout = self.command.timeout_s if self.command.timeout_s is not None else task.limits.timeout_s
        key = self.registry.open_attempt(attempt_id, task.id)
        record: AttemptRecord | None = None
        try:
            with tempfile.TemporaryDirectory(prefix="fleetrl-external-") as tmp:
                task_file = os.path.join(tmp, "task.json")
                prompt_file = os.path.join(tmp, "prompt.txt")
                with open(task_file, "wb") as f:
                    f.write(msgspec.json.encode(task))
                prompt = _prompt_text(task)
                with open(prompt_file, "w", encoding="utf-8") as f:
                    f.write(prompt)
                env = self._environment(task, sandbox, key, attempt_id, task_file, prompt_file)
                values = {
                    "prompt": prompt, "task_file": task_file, "prompt_file": prompt_file,
                    "container": env.get("FLEETRL_SANDBOX_CONTAINER", ""), "user": env["FLEETRL_SANDBOX_USER"],
                    "workdir": task.workdir, "base_url": self.base_url, "model": self.model_name,
                    "max_turns": str(task.limits.max_turns), "attempt_id": attempt_id, "task_id": task.id,
                }
                argv = expand_argv(self.command.argv, values)
                cwd = self.command.cwd or tmp
                outcome = await run_command(argv, env=env, cwd=cwd, timeout_s=timeout,
                                             grace_s=self.command.kill_grace_s, cap=self.command.output_cap_bytes,
                                             forkserver=self.forkserver)
            if outcome.timed_out and getattr(sandbox, "id", None):
                # what the harness started in the sandbox must not change the state the evaluator sees
                await sandbox.exec(["/bin/sh", "-c", _QUIESCE], timeout=30)
        finally:
            record = self.registry.close_attempt(key)
        turns = tuple(Turn(messages=tuple(c.messages or ()), call=c) for c in record.calls)
        final: FinalState
        error = None
        if outcome.timed_out:
            final, error = "timeout", f"the command ran past its limit of {timeout:g} s and was killed"
        elif outcome.exit_code == 0:
            final = "submitted"
        else:
            final = "error"
            err = outcome.stderr.decode(errors="replace")[-500:]
            error = f"the command {argv[0]!r} exited {outcome.exit_code}: {err}"
        return ExternalEpisode(task_id=task.id, turns=turns, final_state=final, record=record, error=error,
                               exit_code=outcome.exit_code, timed_out=outcome.timed_out,
                               killed_pids=tuple(outcome.killed), stdout_tail=bytes(outcome.stdout),
                               stderr_tail=bytes(outcome.stderr), duration_s=outcome.duration_s)


async def run_attempt(harness: object, task: Task, sandbox: SandboxLike, model: ModelClient | None = None, *,
                      setup_timeout_s: float = 120.0) -> AttemptResult:
    """Prepare ``sandbox`` for ``task``, run ``harness`` in it, and score it with the
    task's evaluator (the environment worker's sequence, for one attempt)."""
    await prepare_sandbox(task, sandbox, timeout_s=setup_timeout_s)
    episode = await harness.run(task, sandbox, model)  # type: ignore[attr-defined]
    reward, code, stdout = await evaluate_in_sandbox(task, sandbox)
    return AttemptResult(episode=episode, reward=reward, eval_exit_code=code, eval_stdout=stdout)

"""mini-swe-agent's actions run in a fleetrl sandbox: an environment class for its config.

mini-swe-agent (PyPI ``mini-swe-agent``, unchanged) picks its environment from its own
config: ``environment.environment_class`` may be any import path. This module's
`FleetrlSandboxEnvironment` is such a class: each action the agent takes runs with
``docker exec`` in the *existing* fleetrl sandbox container of the attempt, as the
sandbox's unprivileged user, in the task's work dir, under a wall-clock limit enforced
inside the container (``timeout -s KILL``, so a command outlives neither its limit nor
a killed agent) and again on the ``docker`` client. The agent itself runs beside the
sandbox; the sandbox keeps ``--network none``, and this class never starts, configures
or removes containers (the sandbox pool owns them).

`ExternalHarness` hands the container, user and work dir to the agent process in
``FLEETRL_SANDBOX_CONTAINER`` / ``FLEETRL_SANDBOX_USER`` / ``FLEETRL_SANDBOX_WORKDIR``;
they are this class's defaults, so the config needs only the class name. Run with::

    mini -c mini_textbased.yaml \
         -c environment.environment_class=fleetrl.harness.mswea_env.FleetrlSandboxEnvironment \
         -c agent.step_limit=20 -m openai/<model> --model-class litellm_textbased \
         -t "<task>" -y --exit-immediately

`mini_swe_agent_command` builds that command line for `external.ExternalCommand`.
mini-swe-agent itself is an optional dependency: this module imports it only when an
action signals the end of the task (its ``Submitted`` exception).
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

__all__ = [
    "SUBMIT_MARKER",
    "FleetrlSandboxEnvironment",
    "SandboxEnvConfig",
    "build_exec_argv",
    "mini_swe_agent_command",
    "mini_swe_agent_env",
]

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent's convention: an action whose output starts with this line ends the task."""

ENV_CLASS_PATH = f"{__name__}.FleetrlSandboxEnvironment"


def _env_default(name: str, fallback: str = "") -> Any:
    return msgspec.field(default_factory=lambda: os.environ.get(name, fallback))


class SandboxEnvConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where and how actions run (the keys of mini-swe-agent's ``environment`` config).

    ``container``: the sandbox's container id (default ``$FLEETRL_SANDBOX_CONTAINER``).
    ``user``: ``uid:gid`` to run as (default ``$FLEETRL_SANDBOX_USER``, else 1000:1000).
    ``cwd``: work dir (default ``$FLEETRL_SANDBOX_WORKDIR``, else ``/work``).
    ``timeout``: seconds per action. ``env``: variables set for each action.
    ``interpreter``: argv the action is appended to. ``executable``: the docker CLI.
    ``output_cap_bytes``: output kept per action (the head; the rest is dropped and said so).
    """

    container: str = _env_default("FLEETRL_SANDBOX_CONTAINER")
    user: str = _env_default("FLEETRL_SANDBOX_USER", "1000:1000")
    cwd: str = _env_default("FLEETRL_SANDBOX_WORKDIR", "/work")
    timeout: float = 30.0
    env: dict[str, str] = msgspec.field(default_factory=dict)
    interpreter: tuple[str, ...] = ("bash", "-c")
    executable: str = _env_default("MSWEA_DOCKER_EXECUTABLE", "docker")
    output_cap_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not self.container:
            raise ValueError("FleetrlSandboxEnvironment: no sandbox container: set environment.container or "
                             "FLEETRL_SANDBOX_CONTAINER (ExternalHarness sets it for each attempt)")
        if not self.user or self.user.split(":")[0] in ("0", "root"):
            raise ValueError(f"FleetrlSandboxEnvironment: user {self.user!r} must be the sandbox's unprivileged user")
        if not self.cwd.startswith("/"):
            raise ValueError(f"FleetrlSandboxEnvironment: cwd {self.cwd!r} must be an absolute path")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"FleetrlSandboxEnvironment: timeout {self.timeout!r} must be a positive number of seconds")
        if not self.interpreter:
            raise ValueError("FleetrlSandboxEnvironment: interpreter must not be empty")
        for k in self.env:
            if not k or "=" in k:
                raise ValueError(f"FleetrlSandboxEnvironment: env name {k!r} must be non-empty without '='")
        if self.output_cap_bytes < 1:
            raise ValueError(f"FleetrlSandboxEnvironment: output_cap_bytes must be >= 1, got {self.output_cap_bytes}")


def build_exec_argv(config: SandboxEnvConfig, command: str, *, cwd: str | None = None,
                    timeout: float | None = None) -> list[str]:
    """The ``docker exec`` argv of one action: as ``config.user`` in ``cwd``, killed
    inside the container after ``timeout`` seconds (``timeout -s KILL``)."""
    limit = config.timeout if timeout is None else timeout
    argv = [config.executable, "exec", "-u", config.user, "-w", cwd or config.cwd]
    for k, v in config.env.items():
        argv += ["-e", f"{k}={v}"]
    return argv + [config.container, "timeout", "-s", "KILL", f"{limit:g}", *config.interpreter, command]


class FleetrlSandboxEnvironment:
    """mini-swe-agent's ``Environment`` over a fleetrl sandbox (see the module docstring).

    Keyword arguments are `SandboxEnvConfig`'s; an unknown one is an error naming it
    (settings of other environment classes, such as ``image``, do not apply here).
    """

    def __init__(self, *, logger: Any = None, **kwargs: Any) -> None:
        try:
            self.config = msgspec.convert(kwargs, SandboxEnvConfig)
        except msgspec.ValidationError as err:
            raise ValueError(f"FleetrlSandboxEnvironment config: {err}") from None
        if shutil.which(self.config.executable) is None:
            raise ValueError(f"FleetrlSandboxEnvironment: the docker CLI {self.config.executable!r} is not on PATH")
        self.logger = logger

    def execute(self, action: dict, cwd: str = "", *, timeout: float | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` in the sandbox; returns mini-swe-agent's output dict
        (``output``: stdout and stderr merged, ``returncode``, ``exception_info``). An
        output whose first line is `SUBMIT_MARKER` (exit code 0) ends the task."""
        command = action.get("command", "") if isinstance(action, Mapping) else str(action)
        limit = self.config.timeout if timeout is None else float(timeout)
        argv = build_exec_argv(self.config, command, cwd=cwd or None, timeout=limit)
        start = time.monotonic()
        try:
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=limit + 10)
            raw, code, info = r.stdout, r.returncode, ""
            if code == 137 and time.monotonic() - start >= limit:
                info = f"the command timed out after {limit:g} s and was killed"
        except subprocess.TimeoutExpired as err:
            raw, code = err.output or b"", -1
            info = f"the command timed out after {limit:g} s (the docker client did not return)"
        except OSError as err:
            raw, code, info = b"", -1, f"running the command failed: {err}"
        cap = self.config.output_cap_bytes
        text = raw[:cap].decode("utf-8", errors="replace")
        if len(raw) > cap:
            text += f"\n[output truncated: {len(raw) - cap} more bytes]"
        output = {"output": text, "returncode": code, "exception_info": info}
        self._check_finished(output)
        return output

    @staticmethod
    def _check_finished(output: dict[str, Any]) -> None:
        lines = output["output"].lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted  # the agent's own protocol

            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config and the (shared) kernel's uname, as mini-swe-agent's templates expect."""
        return {**msgspec.to_builtins(self.config), **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {"environment": msgspec.to_builtins(self.config),
                                    "environment_type": ENV_CLASS_PATH}}}

    def cleanup(self) -> None:
        """Nothing to do: the sandbox belongs to fleetrl's pool, not to the agent."""


def mini_swe_agent_command(*, step_limit: int, max_tokens: int, temperature: float = 1.0,
                           action_timeout_s: float = 30.0, config: str = "mini_textbased.yaml",
                           extra: Sequence[str] = (), mini: str | None = None,
                           trajectory: str = "{task_file}.traj.json") -> tuple[str, ...]:
    """argv running ``mini`` (mini-swe-agent's CLI) on one task, configured only by its
    own settings: the text-based agent against the endpoint (``{base_url}``, the
    ``OPENAI_API_KEY`` in the environment), actions in the sandbox through
    `FleetrlSandboxEnvironment`, no confirmations, at most ``step_limit`` model calls.
    ``trajectory``: where mini-swe-agent saves its own trajectory (default: beside the
    task file, in the attempt's temporary directory, removed afterwards; fleetrl's
    record is the endpoint's). ``extra``: more ``-c`` specs. ``mini``: the CLI (default:
    the one installed beside this Python, else ``mini`` on PATH)."""
    if step_limit < 1 or max_tokens < 1:
        raise ValueError("mini_swe_agent_command: step_limit and max_tokens must be >= 1")
    beside = os.path.join(os.path.dirname(sys.executable), "mini")
    exe = mini or (beside if os.path.exists(beside) else "mini")
    argv = [exe, "-c", config,
            "-c", f"environment.environment_class={ENV_CLASS_PATH}",
            "-c", f"environment.timeout={action_timeout_s:g}",
            "-c", f"agent.step_limit={step_limit}",
            "-c", "agent.cost_limit=0",
            "-c", "model.model_kwargs.api_base={base_url}",
            "-c", f"model.model_kwargs.max_tokens={max_tokens}",
            "-c", f"model.model_kwargs.temperature={temperature:g}"]
    for spec in extra:
        argv += ["-c", spec]
    return (*argv, "--model-class", "litellm_textbased", "-m", "openai/{model}", "-t", "{prompt}",
            "-y", "--exit-immediately", "-o", trajectory)


def mini_swe_agent_env(state_dir: str) -> dict[str, str]:
    """The environment variables an unattended ``mini`` run needs: no first-run setup
    prompt, no startup banner, no fetch of litellm's price list (the sandbox host may be
    offline), no cost errors for a model litellm does not know, no retries (a failed
    call is the attempt's failure, not something to wait out), and its global config in
    ``state_dir``."""
    return {"MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": state_dir,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1"}

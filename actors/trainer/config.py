"""TrainerConfig: everything the trainer actor reads from the daemon's TOML config.

Frozen msgspec Structs. Decoded from TOML, bounds are enforced by msgspec (errors name
the field); constructed directly, `__post_init__` checks the same bounds and raises
ValueError naming the field.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from fleetrl.actors.buffer import BufferConfig
from fleetrl.daemon.config import RestartPolicy
from fleetrl.grpo import CorrectionConfig

from .schedule import SCHEDULES, Schedule

__all__ = ["AdvantageConfig", "CorrectionAlarms", "RanksConfig", "TrainerConfig"]

PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]


def _num(owner: str, name: str, value: object, *, low: float, high: float = math.inf,
         low_open: bool = False, integer: bool = False) -> None:
    """Raise ValueError naming ``owner.name`` unless ``value`` is in the bounds."""
    ok_type = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an int" if integer else "a number"
        raise ValueError(f"{owner}.{name} must be {kind}, got {value!r}")
    if math.isnan(value) or value > high or value < low or (low_open and value == low):
        lo = "(" if low_open else "["
        raise ValueError(f"{owner}.{name} must be in {lo}{low}, {high}], got {value!r}")


class AdvantageConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How group rewards become advantages (`fleetrl.grpo.group_advantages`)."""

    std_normalize: bool = False
    """Divide by the group's reward std (GRPO as published); False = mean-only (Dr. GRPO)."""
    leave_one_out: bool = False
    """Baseline each attempt with the mean of the *other* attempts (RLOO)."""


class CorrectionAlarms(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[actors.trainer.config.alarms]``: when a step's corrections say the samplers' tokens
    are not what the trainer can learn from (docs/reference/corrections.md, "Alarms").

    A step that masks more than ``masked_tokens`` of its tokens, or more than
    ``masked_sequences`` of its sequences, raises an alarm (a warning event in the log, the
    terminal and the dashboard, the step's ``alarms`` in metrics.jsonl, /status). A step
    that masks every token stops training with an error (always: no setting turns it off)."""

    masked_tokens: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.25
    """Alarm when a step masks more than this fraction of its tokens (1.0: never)."""
    masked_sequences: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.5
    """Alarm when a step masks more than this fraction of its sequences (1.0: never)."""
    excluded_rows: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.25
    """Alarm when more than this fraction of a step's rows (model calls) are excluded from
    the loss by how they were sampled (greedy calls; 1.0: never)."""
    tail_mass: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.05
    """Alarm when the tokens a step drew from the whole vocabulary left, on average, more
    than this much of the sampler's mass outside their listing: centering is then
    approximate by up to ``2 * mask_high * tail`` per token (docs/reference/corrections.md,
    "Supports at real vocabularies"; 1.0: never)."""

    def __post_init__(self) -> None:
        for name in ("masked_tokens", "masked_sequences", "excluded_rows", "tail_mass"):
            _num("CorrectionAlarms", name, getattr(self, name), low=0.0, high=1.0)


class RanksConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[actors.trainer.config.ranks]``: run the trainer as torch.distributed rank
    processes (FSDP2), supervised by the trainer actor (docs/reference/trainer.md,
    "Rank processes")."""

    world_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    """Rank processes on this host (data parallel, parameters sharded with FSDP2)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto: nccl when ``device`` is CUDA, else gloo."""
    master_addr: str = "127.0.0.1"
    """Rendezvous address of rank 0."""
    master_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    """Rendezvous port; 0: a free port chosen at each start."""
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype FSDP2 gathers parameters in for forward/backward (`MixedPrecisionPolicy`);
    the master weights and AdamW stay fp32, gradients are reduced in fp32."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward (memory for compute)."""
    threads: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    """torch intra-op threads per rank (None: the machine's cores / world_size)."""
    start_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] = 600.0
    """Seconds for the ranks to load the model and answer (a rank that takes longer fails the start)."""
    step_timeout_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    """A request (step, checkpoint) unanswered this long fails the group (a hung rank);
    None: no limit (a dead rank is still detected within about a second)."""
    watch_interval_s: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    """How often the actor checks, between steps, that every rank is alive (during a
    request the check runs several times a second)."""
    keep_checkpoints: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3
    """Committed sharded checkpoints kept under ``sharded/``."""
    restart: RestartPolicy = RestartPolicy()
    """Restarts of the rank group after a rank dies: backoff, and the intensity past which
    the trainer actor fails (and the daemon's own policy takes over)."""

    def __post_init__(self) -> None:
        o = "RanksConfig"
        _num(o, "world_size", self.world_size, low=1, high=1024, integer=True)
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"{o}.backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"{o}.master_addr must be a host name or address, got {self.master_addr!r}")
        _num(o, "master_port", self.master_port, low=0, high=65535, integer=True)
        if self.param_dtype not in ("fp32", "bf16"):
            raise ValueError(f"{o}.param_dtype must be 'fp32' or 'bf16', got {self.param_dtype!r}")
        _num(o, "start_timeout_s", self.start_timeout_s, low=0.0, low_open=True)
        if self.step_timeout_s is not None:
            _num(o, "step_timeout_s", self.step_timeout_s, low=0.0, low_open=True)
        if self.threads is not None:
            _num(o, "threads", self.threads, low=1, high=1024, integer=True)
        _num(o, "keep_checkpoints", self.keep_checkpoints, low=1, high=1000, integer=True)
        _num(o, "watch_interval_s", self.watch_interval_s, low=0.0, low_open=True)


class TrainerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The trainer actor (`fleetrl.actors.trainer:run`)."""

    model_dir: str
    """Saved Llama directory (config.json + safetensors) holding the starting weights."""
    lr: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 2e-4
    """AdamW learning rate (the peak of ``lr_schedule``)."""
    lr_schedule: Schedule = "constant"
    """``constant``, or ``cosine`` / ``linear`` decay from ``lr`` to ``lr * lr_min_ratio``
    at the last of ``max_steps`` (which they need); `fleetrl.actors.trainer.schedule`."""
    lr_min_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.1
    """The decaying schedules' final rate as a fraction of ``lr``."""
    lr_warmup_steps: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    """Steps over which the rate ramps linearly up to ``lr`` first (0: none)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    eps: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1e-8
    """AdamW epsilon."""
    weight_decay: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    """Clip the global gradient L2 norm to this (inf: no clipping)."""
    groups_per_step: Annotated[int, msgspec.Meta(ge=1, le=100_000)] = 8
    """Rollout groups (tasks) per optimizer step, B."""
    max_staleness: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 2
    """Largest trainer version minus the oldest token version of an admitted group."""
    buffer_capacity: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 256
    """Most groups the rollout buffer holds; must be >= groups_per_step."""
    skip_zero_variance: bool = True
    """Skip and count groups whose rewards are all equal."""
    checkpoint_every: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 10
    """Write the trainer's own checkpoint file every this many steps (and on drain)."""
    corrections: CorrectionConfig = CorrectionConfig()
    """Off-policy corrections of the policy loss (docs/reference/corrections.md)."""
    advantage: AdvantageConfig = AdvantageConfig()
    """How rewards become advantages."""
    temperature: Annotated[float, msgspec.Meta(gt=0.0, le=100.0)] = 1.0
    """The temperature of rows whose record carries no sampling settings (samplers and
    traces of earlier releases; counted per step as ``unrecorded_rows``): every other row
    is scored with the temperature it was sampled with."""
    alarms: CorrectionAlarms = CorrectionAlarms()
    """When a step's masked or excluded share raises an alarm (`CorrectionAlarms`)."""
    pass_threshold: float = 1.0
    """A trajectory with reward >= this counts as passed (the pass-rate metric)."""
    publish_window: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 8
    """Versions a follower may lag and still get one combined delta."""
    anchor_every: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 32
    """A full anchor every this many versions."""
    max_steps: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Stop training after this many steps (None: until drained); groups keep queueing."""
    time_budget_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    """Stop training once the trainer has run this many wall-clock seconds (counted from
    its start, summed over restarts: the elapsed time is checkpointed; operator pauses
    count), or at
    ``max_steps``, whichever comes first (None: no time limit). A decaying
    ``lr_schedule`` then follows the larger of the step and time fractions, so it ends at
    its floor either way; the number of steps taken depends on the machine's speed."""
    device: str = "cpu"
    """torch device of the fp32 master model and the step ("cpu", "cuda", "cuda:1")."""
    seed: int = 0
    """Seed of torch's RNG at the first start (restored from the checkpoint afterwards)."""
    stale_reports_to: str | None = None
    """Actor that receives `StaleGroup` rejections (the sampler pool), or None to only count them."""
    daemon_checkpoint_every: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] | None = None
    """Ask the daemon for a checkpoint (every actor's state, one atomic file) every this
    many steps, so the producers' task cursors and the trainer's buffer are captured
    together at step boundaries; None: only the daemon's periodic and final ones."""
    announce_to: tuple[str, ...] = ()
    """Actors sent a `WeightVersionAvailable` for every published version (the sampler
    pool: it moves its staleness bound and makes local samplers sync; an evaluator)."""
    shutdown_when_done: bool = False
    """At ``max_steps`` (or when ``time_budget_s`` is spent): write the checkpoint and ask the daemon to shut down (the run's
    budget is spent; an evaluator then runs its final evaluation while draining)."""
    progress: bool = False
    """Draw a tqdm bar on stderr (steps of ``max_steps``, reward, pass rate)."""
    share_prompts: bool = True
    """Compute each distinct prompt of a batch once per step and attend every row that
    starts with it to its KV cache (exact to float rounding, ~2x faster for GRPO groups);
    False: forward every full row (the reference path)."""
    record_batches: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    """Write the trained batch of each of the first N steps to ``batches/step-<k>.json``
    in the trainer's state dir (each row's prompt ids, the tokens in the loss and their
    versions; `core.batch_record`): what exactly was trained, for tests and debugging."""

    rollout_log: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 200
    """Keep the newest N trained groups, token by token with the trainer's log-probs and
    the masked tokens, in ``rollouts/`` of the trainer's state dir, and index the failed
    attempts received (`rollout_log`; the dashboard's rollout browser reads it). 0: none."""

    micro_batch_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Accumulate each step's gradient over micro-batches of at most this many tokens per
    rank (prompt + generated, padding included; a longer row goes alone); the step equals
    the whole batch's to float rounding. None: the whole batch at once."""
    logits_chunk_mb: Annotated[int, msgspec.Meta(ge=1)] = 256
    """The most memory (MiB) one chunk of fp32 ``[positions, vocabulary]`` logits takes
    in the train step: the head is applied in chunks of positions and only what the loss
    reads is kept (`head`), so a step never holds ``[B, T, V]`` logits (441 positions a
    chunk at V = 151,936 by default)."""
    ranks: RanksConfig | None = None
    """Run the model in supervised torch.distributed rank processes (FSDP2, sharded
    checkpoints, restart after a rank dies); None: in the daemon's own process."""

    def __post_init__(self) -> None:
        o = "TrainerConfig"
        if self.micro_batch_tokens is not None:
            _num(o, "micro_batch_tokens", self.micro_batch_tokens, low=1, integer=True)
        if not isinstance(self.model_dir, str) or not self.model_dir:
            raise ValueError(f"{o}.model_dir must be a non-empty path, got {self.model_dir!r}")
        _num(o, "lr", self.lr, low=0.0, high=1.0, low_open=True)
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"{o}.lr_schedule must be one of {', '.join(map(repr, SCHEDULES))}, "
                             f"got {self.lr_schedule!r}")
        _num(o, "lr_min_ratio", self.lr_min_ratio, low=0.0, high=1.0)
        _num(o, "lr_warmup_steps", self.lr_warmup_steps, low=0, high=1_000_000, integer=True)
        if self.time_budget_s is not None:
            _num(o, "time_budget_s", self.time_budget_s, low=0.0, low_open=True)
            if not math.isfinite(self.time_budget_s):
                raise ValueError(f"{o}.time_budget_s must be finite, got {self.time_budget_s!r}")
        if self.lr_schedule != "constant" and self.max_steps is None and self.time_budget_s is None:
            raise ValueError(f"{o}.lr_schedule = {self.lr_schedule!r} needs max_steps or time_budget_s "
                             "(the budget it decays over)")
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"{o}.betas must be a (beta1, beta2) pair, got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _num(o, f"betas[{i}]", b, low=0.0, high=0.999999999)
        _num(o, "eps", self.eps, low=0.0, high=1.0, low_open=True)
        _num(o, "weight_decay", self.weight_decay, low=0.0, high=1.0)
        _num(o, "grad_clip", self.grad_clip, low=0.0, low_open=True)
        _num(o, "groups_per_step", self.groups_per_step, low=1, high=100_000, integer=True)
        _num(o, "max_staleness", self.max_staleness, low=0, high=1_000_000, integer=True)
        _num(o, "buffer_capacity", self.buffer_capacity, low=1, high=1_000_000, integer=True)
        _num(o, "checkpoint_every", self.checkpoint_every, low=1, high=1_000_000, integer=True)
        _num(o, "temperature", self.temperature, low=0.0, high=100.0, low_open=True)
        _num(o, "pass_threshold", self.pass_threshold, low=-math.inf)
        _num(o, "publish_window", self.publish_window, low=1, high=10_000, integer=True)
        _num(o, "anchor_every", self.anchor_every, low=1, high=1_000_000, integer=True)
        if self.max_steps is not None:
            _num(o, "max_steps", self.max_steps, low=0, integer=True)
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"{o}.device must be a torch device string, got {self.device!r}")
        if self.buffer_capacity < self.groups_per_step:
            raise ValueError(f"{o}.buffer_capacity ({self.buffer_capacity}) must be >= "
                             f"groups_per_step ({self.groups_per_step})")
        if self.daemon_checkpoint_every is not None:
            _num(o, "daemon_checkpoint_every", self.daemon_checkpoint_every, low=1, high=1_000_000, integer=True)
        if self.shutdown_when_done and self.max_steps is None and self.time_budget_s is None:
            raise ValueError(f"{o}.shutdown_when_done needs max_steps or time_budget_s (a budget)")
        for i, name in enumerate(self.announce_to):
            if not isinstance(name, str) or not name:
                raise ValueError(f"{o}.announce_to[{i}] must be an actor name, got {name!r}")
        if not isinstance(self.share_prompts, bool):
            raise ValueError(f"{o}.share_prompts must be true or false, got {self.share_prompts!r}")
        if not isinstance(self.corrections, CorrectionConfig):
            raise ValueError(f"{o}.corrections must be a CorrectionConfig")

    @property
    def buffer(self) -> BufferConfig:
        """The rollout buffer's part of this config."""
        return BufferConfig(max_staleness=self.max_staleness, capacity=self.buffer_capacity,
                            skip_zero_variance=self.skip_zero_variance)

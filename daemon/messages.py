"""The message catalogue: every conversation fleetrl's processes hold today.

Each conversation is a closed tagged union wrapped in a `Codec` (see `protocol`):

- `SAMPLER`: sampler pool <-> one sampler. `GenerateRequest` out; `Generation` or
  `GenerateFailed` back, preceded by `TokenChunk`s when the request asked to stream.
- `WEIGHTS`: trainer -> samplers, `WeightVersionAvailable`; samplers -> pool,
  `SamplerStatus`.
- `FLEET`: the one authenticated connection of a remote sampler. `Join` first, answered
  by `Welcome` or `Refused`; then `Heartbeat`s, the sampler and weights messages,
  and `Leave`.
- `ROLLOUTS`: environment workers -> rollout buffer -> trainer: `Trajectory` per
  attempt, `RolloutGroup` per task group, `RolloutFailed` for an attempt that could
  not be scored (a failure is a message, not an exception).
- `CONTROL`: `Pause`, `Resume`, `Shutdown`, `StatusRequest` / `StatusReply`.
- `FEEDBACK`: trainer -> sampler pool, `SamplerMismatch` after each train step (what
  the trainer measured of each sampler's tokens). Inside the daemon only: no remote
  peer speaks it.

Per-token arrays travel as `Tensor` (raw bytes), not as lists of numbers: for a
typical trajectory (2,000 generated tokens, support K=20) encode+decode is 25-65x
faster and the frame a third smaller (docs/reference/protocol.md has the figures). The
arrays, their support CSR and their checks are in `tokens`: cross-field invariants
(equal lengths, well-formed CSR) are checked on construction and on decode, so a
receiver never sees a message whose arrays disagree. `examples` builds typical messages.

Evolution: append fields with defaults only; see `protocol`.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

from .protocol import PROTOCOL_VERSION, Codec, Message, Record, Tensor
from .tokens import INT_DTYPES, SupportCSR, check_token_arrays, vector_length

__all__ = [
    "ALL_MESSAGES", "CONTROL", "FEEDBACK", "FLEET", "ROLLOUTS", "SAMPLER", "WEIGHTS", "ActorStatus",
    "BlobRef", "FinishReason", "GenerateFailed", "GenerateRequest", "Generation",
    "Heartbeat", "Join", "Leave", "MismatchFigures", "Pause", "Refused", "Resume", "RolloutFailed",
    "RolloutFailureKind", "RolloutGroup", "SamplerIdentity", "SamplerMismatch", "SamplerStatus",
    "SamplingParams", "SamplingRecord", "Shutdown", "StatusReply", "StatusRequest", "SupportCSR",
    "TokenChunk", "TokenSegment", "Trajectory", "Welcome", "WeightVersionAvailable",
]

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]

FinishReason = Literal["stop", "length", "abort"]
"""Why generation ended: a stop token, ``max_tokens``, or the request was aborted."""

RolloutFailureKind = Literal[
    "sandbox_error", "harness_crash", "timeout", "evaluator_error", "sampler_error"
]


def _check_dollars(value: float, field: str) -> None:
    """An amount of money is a finite number >= 0. Construction does not run msgspec's
    range checks and no range check refuses infinity, so this does (on decode too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number of dollars, got {type(value).__name__}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{field} must be a finite number of dollars >= 0, got {value!r}")


# --------------------------------------------------------------------------- records


class SamplingParams(Record):
    """How to sample one generation. Built or decoded, invalid values raise ValueError
    naming the field (on decode: `BadMessage`, or msgspec's ValidationError)."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    """Most tokens to generate per prompt (the context length may end it sooner)."""
    temperature: NonNegFloat = 1.0
    """Softmax temperature; 0 is greedy (support = the argmax, lowest id on ties)."""
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    """Nucleus mass in (0, 1]: the support is the shortest most-likely-first prefix reaching it."""
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None
    """Cap on the support size (None: the sampler's own cap, ``max_support``, 512 by
    default: every sampler draws from at most that many tokens, so the record it reports
    stays bounded at any vocabulary; docs/reference/corrections.md)."""
    stop_ids: tuple[NonNegInt, ...] = ()
    """Token ids that end a sequence; the stop token is generated and reported."""
    seed: int | None = None
    """Seed of the sampling RNG in [0, 2**63): same seed, weights, prompts and params
    give the same tokens. None: the sampler draws one (and reports it in `Generation`)."""
    whole_vocabulary: bool = False
    """Draw from the whole vocabulary, past the sampler's cap (only with ``top_p = 1``, no
    ``top_k`` and ``temperature > 0``): the record then lists the sampler's ``max_support``
    most likely tokens with the mass outside them (support rule ``"vocabulary"``), and the
    trainer's centering over it is approximate, within a bound it reports. The sampler
    pool sets it only where its ``whole_vocabulary`` setting allows."""

    def __post_init__(self) -> None:
        # construction from Python skips the Meta constraints above, so they are repeated
        if isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise ValueError(f"SamplingParams.top_k must be >= 1 or None, got {self.top_k!r}")
        for i, stop in enumerate(self.stop_ids):
            if isinstance(stop, bool) or stop < 0:
                raise ValueError(f"SamplingParams.stop_ids[{i}] must be a token id >= 0, got {stop!r}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"SamplingParams.seed must be in [0, 2**63), got {self.seed!r}")
        if self.whole_vocabulary and (self.top_p != 1.0 or self.top_k is not None or self.temperature == 0):
            raise ValueError("SamplingParams.whole_vocabulary draws from every token: it needs top_p = 1, no top_k "
                             f"and temperature > 0, got top_p={self.top_p!r}, top_k={self.top_k!r}, "
                             f"temperature={self.temperature!r}")


class SamplingRecord(Record):
    """What one model call was actually sampled with: it travels with the call's tokens
    (`Generation.sampling`, `TokenSegment.sampling`) so the trainer scores each row with
    the settings it was drawn with, never with an assumption of its own.

    ``temperature`` (0: greedy), ``top_p``, ``top_k`` (the cap the sampler applied: the
    call's own, or the sampler's ``max_support``; None for a whole-vocabulary draw),
    ``seed`` (of the sampler's batch), and ``whole_vocabulary``. Built from the
    `SamplingParams` the sampler drew with (`of`)."""

    temperature: NonNegFloat
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None
    seed: int | None = None
    whole_vocabulary: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
                and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"SamplingRecord.temperature must be finite and >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingRecord.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise ValueError(f"SamplingRecord.top_k must be >= 1 or None, got {self.top_k!r}")

    @classmethod
    def of(cls, params: SamplingParams, seed: int | None = None) -> SamplingRecord:
        """The record of a call drawn with ``params`` (as the sampler applied them) and the
        batch ``seed`` (``params.seed`` when not given)."""
        return cls(temperature=float(params.temperature), top_p=float(params.top_p), top_k=params.top_k,
                   seed=params.seed if seed is None else seed, whole_vocabulary=params.whole_vocabulary)

    @property
    def greedy(self) -> bool:
        """Temperature 0: the support is the argmax alone, so the call carries no gradient."""
        return self.temperature == 0


class SamplerIdentity(Record):
    """Which sampler produced tokens: its id, backend (e.g. "torch", "vllm"), device
    kind (e.g. "cpu", "H100"), and the dtype it computes in (e.g. "bfloat16",
    "float8_e4m3fn")."""

    sampler_id: str
    backend: str
    device_kind: str
    dtype: str


class TokenSegment(Record):
    """One model call inside an attempt: the full prompt it saw and what it generated.

    Per generated token: ``token_ids``, the sampler's log q^S (``logprobs``), the
    ``support`` it could choose from, and the weight ``versions`` that produced it.
    ``cost_usd`` is what the call cost on the sampler that answered it (copied from
    `Generation.cost_usd`; 0.0 when the sampler has no price). ``sampling``: what the call
    was sampled with (`SamplingRecord`; None in records of earlier releases, which the
    trainer scores at its configured temperature and counts).
    """

    prompt_ids: Tensor
    token_ids: Tensor
    logprobs: Tensor
    support: SupportCSR
    versions: Tensor
    sampler: SamplerIdentity
    finish_reason: FinishReason
    cost_usd: NonNegFloat = 0.0
    sampling: SamplingRecord | None = None

    def __post_init__(self) -> None:
        vector_length(self.prompt_ids, "prompt_ids", INT_DTYPES)
        check_token_arrays(self.token_ids, self.logprobs, self.support, self.versions)
        _check_dollars(self.cost_usd, "TokenSegment.cost_usd")

    @classmethod
    def from_generation(cls, prompt_ids: Tensor, gen: Generation) -> TokenSegment:
        """The record of a model call answered by ``gen``."""
        return cls(
            prompt_ids=prompt_ids,
            token_ids=gen.token_ids,
            logprobs=gen.logprobs,
            support=gen.support,
            versions=gen.versions,
            sampler=gen.sampler,
            finish_reason=gen.finish_reason,
            cost_usd=gen.cost_usd,
            sampling=gen.sampling,
        )


class BlobRef(Record):
    """A content-addressed blob: its hash (e.g. "xxh128:..."), size, and where to get it."""

    hash: str
    size: NonNegInt
    url: str


class ActorStatus(Record):
    """One supervised actor, as reported by `StatusReply`."""

    name: str
    state: str
    restarts: NonNegInt = 0
    last_error: str | None = None


# --------------------------------------------------------------------------- sampler conversation


class GenerateRequest(Message):
    """Ask a sampler to continue ``prompt_ids`` with weights of version >= ``min_version``."""

    request_id: str
    attempt_id: str
    prompt_ids: Tensor
    params: SamplingParams
    min_version: NonNegInt = 0
    stream: bool = False
    """Send the generated tokens as the sampler produces them (`TokenChunk`s before the
    answer). Only a sender that understands `TokenChunk` sets it; a sampler of an
    earlier release ignores it and answers with the `Generation` alone."""

    def __post_init__(self) -> None:
        if vector_length(self.prompt_ids, "prompt_ids", INT_DTYPES) == 0:
            raise ValueError("prompt_ids must not be empty")


class Generation(Message):
    """A sampler's answer to a `GenerateRequest` (see `TokenSegment` for the arrays).

    Sampler backends build it directly, with an empty ``request_id`` and their own
    identity; whoever serves the backend under a sampler id stamps both on it.

    ``cost_usd``: dollars this generation cost on the sampler that answered it, filled
    in by the sampler pool: the sampler's ``price_per_hour / 3600`` times the busy
    seconds attributed to this request (each second the sampler was busy is shared
    equally by the requests running in it then). 0.0 for a sampler without a price,
    and as sent by samplers themselves.

    ``seed``: the RNG seed the sampler's batch was drawn with (drawn at random when the
    request had none): the batch is reproducible from it. None from samplers of
    earlier releases.

    ``sampling``: the settings the call was drawn with (`SamplingRecord`), set by the
    backend that sampled it; the sampler pool fills it from the params it sent when a
    sampler of an earlier release leaves it None.
    """

    request_id: str
    token_ids: Tensor
    logprobs: Tensor
    support: SupportCSR
    versions: Tensor
    sampler: SamplerIdentity
    finish_reason: FinishReason
    cost_usd: NonNegFloat = 0.0
    seed: int | None = None
    sampling: SamplingRecord | None = None

    def __post_init__(self) -> None:
        check_token_arrays(self.token_ids, self.logprobs, self.support, self.versions)
        _check_dollars(self.cost_usd, "Generation.cost_usd")

    @property
    def num_tokens(self) -> int:
        """Generated tokens."""
        return self.token_ids.shape[0]


class TokenChunk(Message):
    """Tokens a sampler has just generated for a streamed request (``stream=True``).

    The chunks of a request, in order, concatenate to a prefix of its `Generation`'s
    ``token_ids`` (the whole of it when the sampler streams every token; see
    docs/reference/protocol.md, "Streaming"). Only the ids travel: log-probs, support
    and versions come with the `Generation` that ends the request. A request answered
    by `GenerateFailed` may have had chunks before it; they are void.
    """

    request_id: str
    token_ids: list[NonNegInt]


class GenerateFailed(Message):
    """A sampler could not answer a request; ``retryable`` if another try may succeed.

    ``cause``: a machine-readable cause where the sampler knows one (``"weight_version"``:
    it holds older weights than the request's ``min_version``, e.g. after falling back to
    an anchor; the pool counts such restarts per sampler); empty otherwise and from
    samplers of earlier releases."""

    request_id: str
    reason: str
    retryable: bool = False
    cause: str = ""


# --------------------------------------------------------------------------- weights


class WeightVersionAvailable(Message):
    """Weights of ``version`` can be fetched.

    ``base`` is the version the delta applies to, or None for a full anchor; ``digest``
    identifies the resulting weights (checked after applying); ``blobs`` are the
    content-addressed pieces to fetch, in order.
    """

    version: NonNegInt
    digest: str
    base: NonNegInt | None
    blobs: tuple[BlobRef, ...]

    def __post_init__(self) -> None:
        if self.base is not None and self.base >= self.version:
            raise ValueError(f"delta base {self.base} must be older than version {self.version}")


class SamplerStatus(Message):
    """A sampler's report: the weights it serves, its backlog, its recent throughput."""

    sampler_id: str
    version: NonNegInt
    digest: str
    queue_depth: NonNegInt
    tokens_per_s: NonNegFloat


# --------------------------------------------------------------------------- fleet membership


class Join(Message):
    """A remote sampler asks to join; the first message on its connection."""

    token: str
    identity: SamplerIdentity
    protocol: NonNegInt = PROTOCOL_VERSION
    capacity: Annotated[int, msgspec.Meta(ge=1)] = 1
    """Requests the sampler serves concurrently."""
    price_per_hour: NonNegFloat = 0.0
    """What the sampler's device costs per hour, in dollars (cost-aware routing and the
    cost of each `Generation`). Samplers of earlier releases send 0.0 and put the price
    in the join URL's ``price_per_hour`` query parameter instead."""

    def __post_init__(self) -> None:
        _check_dollars(self.price_per_hour, "Join.price_per_hour")

    def __repr__(self) -> str:  # never print the credential
        return (
            f"Join(token='***', identity={self.identity!r}, protocol={self.protocol!r}, "
            f"capacity={self.capacity!r}, price_per_hour={self.price_per_hour!r})"
        )


class Welcome(Message):
    """The daemon accepts a `Join`: heartbeat at least every ``heartbeat_s`` seconds."""

    sampler_id: str
    run_id: str
    protocol: NonNegInt
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0.0)]
    version: NonNegInt
    """The newest weight version; catch up to it before serving."""


class Refused(Message):
    """The daemon refuses a `Join` (bad token, protocol too old, fleet full)."""

    reason: str
    retry_after_s: NonNegFloat | None = None


class Heartbeat(Message):
    """A member is alive (``sent_at``: sender's unix time)."""

    sampler_id: str
    sent_at: float


class Leave(Message):
    """A member leaves the fleet in order (its in-flight requests are failed over)."""

    sampler_id: str
    reason: str = ""


# --------------------------------------------------------------------------- rollouts


class Trajectory(Message):
    """One scored attempt at a task: every model call it made, and its reward."""

    attempt_id: str
    task_id: str
    group_id: str
    segments: tuple[TokenSegment, ...]
    reward: float
    metrics: dict[str, float] = {}

    @property
    def n_generated(self) -> int:
        """Generated tokens over all segments."""
        return sum(s.token_ids.shape[0] for s in self.segments)

    @property
    def oldest_version(self) -> int | None:
        """Oldest weight version of any generated token (None: no tokens)."""
        mins = [int(s.versions.to_numpy().min()) for s in self.segments if s.versions.shape[0]]
        return min(mins) if mins else None


class RolloutGroup(Message):
    """The G scored attempts of one task; the trainer's unit of GRPO."""

    group_id: str
    task_id: str
    trajectories: tuple[Trajectory, ...]

    def __post_init__(self) -> None:
        for i, t in enumerate(self.trajectories):
            if t.group_id != self.group_id or t.task_id != self.task_id:
                raise ValueError(
                    f"trajectories[{i}] belongs to group {t.group_id!r} of task "
                    f"{t.task_id!r}, not group {self.group_id!r} of task {self.task_id!r}"
                )

    @property
    def rewards(self) -> tuple[float, ...]:
        """Each trajectory's reward, in order (derived, so it cannot disagree)."""
        return tuple(t.reward for t in self.trajectories)

    @property
    def oldest_version(self) -> int | None:
        """Oldest weight version of any token in the group (staleness admission)."""
        vs = [v for t in self.trajectories if (v := t.oldest_version) is not None]
        return min(vs) if vs else None


class RolloutFailed(Message):
    """An attempt that produced no trajectory, and why."""

    attempt_id: str
    task_id: str
    reason: RolloutFailureKind
    detail: str
    group_id: str = ""


# --------------------------------------------------------------------------- feedback


class MismatchFigures(Record):
    """The measured sampler-trainer mismatch of some generated tokens of one train step.

    Per token ``t`` (a position in the loss): the log-ratio ``r_t = log p^S(a_t) -
    log q^S(a_t)`` of the trainer's replayed probability of the sampled token to the
    probability the sampler reported, both over the support the sampler reported
    (docs/reference/corrections.md). ``kl_k3`` is the mean of ``exp(r) - 1 - r``
    (the k3 estimate of KL(q^S || p^S) per token); ``frac_out_of_band`` the fraction of
    the tokens whose ratio ``exp(r)`` lies outside the correction band ``[mask_low,
    mask_high]``; ``log_ratio_mean`` / ``log_ratio_std`` the mean and population
    standard deviation of ``r``; ``log_ratio_max_abs`` the largest ``|r|``. Over a
    union of token sets the figures combine exactly (token-weighted means; the standard
    deviation through the means, Chan et al.; the maximum of the maxima).

    Plain values, not checked here: a diverged trainer may measure NaN, and its metrics
    file must still hold it. `SamplerMismatch` checks what it carries.
    """

    tokens: NonNegInt
    kl_k3: float
    frac_out_of_band: float
    log_ratio_mean: float
    log_ratio_std: float
    log_ratio_max_abs: float


def _check_figures(f: MismatchFigures, where: str) -> None:
    if isinstance(f.tokens, bool) or not isinstance(f.tokens, int) or f.tokens < 1:
        raise ValueError(f"{where}.tokens must be an int >= 1, got {f.tokens!r}")
    if not 0.0 <= f.frac_out_of_band <= 1.0:
        raise ValueError(f"{where}.frac_out_of_band must be in [0, 1], got {f.frac_out_of_band!r}")
    for name in ("kl_k3", "log_ratio_std", "log_ratio_max_abs"):
        v = getattr(f, name)
        if not v >= 0:  # NaN too; inf is allowed (an overflowed ratio)
            raise ValueError(f"{where}.{name} must be >= 0 (not NaN), got {v!r}")
    if math.isnan(f.log_ratio_mean):
        raise ValueError(f"{where}.log_ratio_mean must not be NaN")


class SamplerMismatch(Message):
    """What the trainer measured of each sampler's tokens in one train step.

    ``by_kind`` is keyed ``"backend/dtype"`` (the trainer's metric key); ``by_sampler``
    holds one entry per sampler id, with the identity the tokens carried (so the pool
    can label by device kind too). ``mask_low`` / ``mask_high``: the band the
    out-of-band fraction was measured against. Every entry covers at least one token
    and no figure is NaN (the trainer leaves out an entry it could not measure).
    """

    step: NonNegInt
    """The trainer's optimizer steps after this one (as in its metrics)."""
    version: NonNegInt
    """The trainer's weight version after the step."""
    mask_low: NonNegFloat
    mask_high: float
    by_kind: dict[str, MismatchFigures]
    by_sampler: tuple[tuple[SamplerIdentity, MismatchFigures], ...]

    def __post_init__(self) -> None:
        if not (0.0 <= self.mask_low < self.mask_high) or math.isnan(self.mask_high):
            raise ValueError(f"SamplerMismatch band must satisfy 0 <= mask_low < mask_high, "
                             f"got [{self.mask_low!r}, {self.mask_high!r}]")
        for key, f in self.by_kind.items():
            _check_figures(f, f"SamplerMismatch.by_kind[{key!r}]")
        seen: set[str] = set()
        for ident, f in self.by_sampler:
            if ident.sampler_id in seen:
                raise ValueError(f"SamplerMismatch.by_sampler names sampler {ident.sampler_id!r} twice")
            seen.add(ident.sampler_id)
            _check_figures(f, f"SamplerMismatch.by_sampler[{ident.sampler_id!r}]")


# --------------------------------------------------------------------------- control


class Pause(Message):
    """Stop admitting new work; in-flight work finishes."""

    reason: str = ""


class Resume(Message):
    """Admit work again after a `Pause`."""


class Shutdown(Message):
    """Drain and exit; ``grace_s`` overrides the configured grace deadline."""

    grace_s: NonNegFloat | None = None
    reason: str = ""


class StatusRequest(Message):
    """Ask for a `StatusReply`."""


class StatusReply(Message):
    """What the daemon is doing: its state, trainer weight version, and actors."""

    run_id: str
    state: Literal["starting", "running", "paused", "draining"]
    version: NonNegInt
    actors: tuple[ActorStatus, ...] = ()


# --------------------------------------------------------------------------- conversations

SAMPLER = Codec("sampler", [GenerateRequest, Generation, GenerateFailed, TokenChunk], error_reply=True)
WEIGHTS = Codec("weights", [WeightVersionAvailable, SamplerStatus])
FLEET = Codec(
    "fleet",
    [Join, Welcome, Refused, Heartbeat, Leave, *SAMPLER.types, *WEIGHTS.types],
    error_reply=True,
)
ROLLOUTS = Codec("rollouts", [Trajectory, RolloutGroup, RolloutFailed], error_reply=True)
CONTROL = Codec(
    "control", [Pause, Resume, Shutdown, StatusRequest, StatusReply], error_reply=True
)
FEEDBACK = Codec("feedback", [SamplerMismatch])

ALL_MESSAGES: tuple[type[Message], ...] = tuple(
    dict.fromkeys(
        t for c in (SAMPLER, WEIGHTS, FLEET, ROLLOUTS, CONTROL, FEEDBACK) for t in c.types
    )
)
"""Every message type of every conversation (each once)."""

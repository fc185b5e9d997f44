"""The message catalogue: every conversation fleetrl's processes hold today.

Each conversation is a closed tagged union wrapped in a `Codec` (see `protocol`):

- `SAMPLER`: sampler pool <-> one sampler. `GenerateRequest` out; `Generation` or
  `GenerateFailed` back.
- `WEIGHTS`: trainer -> samplers, `WeightVersionAvailable`; samplers -> pool,
  `SamplerStatus`.
- `FLEET`: the one authenticated connection of a remote sampler. `Join` first, answered
  by `Welcome` or `Refused`; then `Heartbeat`s, the sampler and weights messages,
  and `Leave`.
- `ROLLOUTS`: environment workers -> rollout buffer -> trainer: `Trajectory` per
  attempt, `RolloutGroup` per task group, `RolloutFailed` for an attempt that could
  not be scored (a failure is a message, not an exception).
- `CONTROL`: `Pause`, `Resume`, `Shutdown`, `StatusRequest` / `StatusReply`.

Per-token arrays travel as `Tensor` (raw bytes), not as lists of numbers: for a
typical trajectory (2,000 generated tokens, support K=20) encode+decode is 25-65x
faster and the frame a third smaller (docs/reference/protocol.md has the figures). Token ids are int32 or int64; log-probabilities float32 or float64; CSR
offsets int64; weight versions int32 or int64. Cross-field invariants (equal lengths,
well-formed CSR) are checked on construction and on decode, so a receiver never sees
a message whose arrays disagree.

Evolution: append fields with defaults only; see `protocol`.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
import numpy as np

from .protocol import PROTOCOL_VERSION, Codec, Message, Record, Tensor

__all__ = [
    "ALL_MESSAGES",
    "CONTROL",
    "FLEET",
    "ROLLOUTS",
    "SAMPLER",
    "WEIGHTS",
    "ActorStatus",
    "BlobRef",
    "FinishReason",
    "GenerateFailed",
    "GenerateRequest",
    "Generation",
    "Heartbeat",
    "Join",
    "Leave",
    "Pause",
    "Refused",
    "Resume",
    "RolloutFailed",
    "RolloutFailureKind",
    "RolloutGroup",
    "SamplerIdentity",
    "SamplerStatus",
    "SamplingParams",
    "Shutdown",
    "StatusReply",
    "StatusRequest",
    "SupportCSR",
    "TokenSegment",
    "Trajectory",
    "Welcome",
    "WeightVersionAvailable",
    "example_generation",
    "example_trajectory",
]

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]

FinishReason = Literal["stop", "length", "abort"]
"""Why generation ended: a stop token, ``max_tokens``, or the request was aborted."""

RolloutFailureKind = Literal[
    "sandbox_error", "harness_crash", "timeout", "evaluator_error", "sampler_error"
]


# --------------------------------------------------------------------------- array checks

_INT = ("int32", "int64")
_FLOAT = ("float32", "float64")


def _vector(t: Tensor, name: str, dtypes: tuple[str, ...]) -> int:
    """Length of ``t``, which must be 1-d of one of ``dtypes``; else ValueError."""
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(dtypes)}, got {t.dtype}")
    if len(t.shape) != 1:
        raise ValueError(f"{name} must be 1-d, got shape {list(t.shape)}")
    return t.shape[0]


def _check_dollars(value: float, field: str) -> None:
    """An amount of money is a finite number >= 0. Construction does not run msgspec's
    range checks and no range check refuses infinity, so this does (on decode too)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{field} must be a number of dollars, got {type(value).__name__}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{field} must be a finite number of dollars >= 0, got {value!r}")


def _check_tokens(token_ids: Tensor, logprobs: Tensor, support: SupportCSR, versions: Tensor) -> None:
    n = _vector(token_ids, "token_ids", _INT)
    for name, t, dtypes in (("logprobs", logprobs, _FLOAT), ("versions", versions, _INT)):
        got = _vector(t, name, dtypes)
        if got != n:
            raise ValueError(f"{name} has {got} entries but token_ids has {n}")
    if support.positions != n:
        raise ValueError(f"support covers {support.positions} positions but token_ids has {n}")


# --------------------------------------------------------------------------- records


class SamplingParams(Record):
    """How to sample. ``top_k=None`` means no cap; ``seed=None`` means unseeded."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    temperature: NonNegFloat = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=1)] | None = None
    stop_ids: tuple[NonNegInt, ...] = ()
    seed: int | None = None


class SamplerIdentity(Record):
    """Which sampler produced tokens: its id, backend (e.g. "torch", "vllm"), device
    kind (e.g. "cpu", "H100"), and the dtype it computes in (e.g. "bfloat16",
    "float8_e4m3fn")."""

    sampler_id: str
    backend: str
    device_kind: str
    dtype: str


class SupportCSR(Record):
    """Per-position sampling support in CSR form.

    Position ``i`` could have sampled any of ``ids[offsets[i]:offsets[i+1]]``, whose
    log-probabilities under the sampler's truncated, renormalised distribution (log
    q^S) are the same slice of ``logprobs``. ``offsets`` (int64) has one entry per
    position plus one, starts at 0, strictly increases (a support is never empty)
    and ends at ``len(ids)``.
    """

    ids: Tensor
    logprobs: Tensor
    offsets: Tensor

    def __post_init__(self) -> None:
        n_ids = _vector(self.ids, "support.ids", _INT)
        n_lp = _vector(self.logprobs, "support.logprobs", _FLOAT)
        if n_lp != n_ids:
            raise ValueError(f"support.logprobs has {n_lp} entries but support.ids has {n_ids}")
        n_off = _vector(self.offsets, "support.offsets", ("int64",))
        if n_off < 1:
            raise ValueError("support.offsets must have at least one entry (0)")
        off = self.offsets.to_numpy()
        if off[0] != 0:
            raise ValueError(f"support.offsets must start at 0, got {int(off[0])}")
        if off[-1] != n_ids:
            raise ValueError(
                f"support.offsets ends at {int(off[-1])} but support.ids has {n_ids} entries"
            )
        if n_off > 1 and not (off[1:] > off[:-1]).all():
            at = int(np.argmax(off[1:] <= off[:-1]))
            raise ValueError(
                f"support.offsets must strictly increase (empty support at position {at})"
            )

    @property
    def positions(self) -> int:
        """Number of positions covered."""
        return self.offsets.shape[0] - 1

    @classmethod
    def from_padded(cls, ids_NK: np.ndarray, logprobs_NK: np.ndarray) -> SupportCSR:
        """From the padded form of ``fleetrl.grpo.sampler_support`` (ids padded with -1)."""
        ids_NK = np.asarray(ids_NK)
        logprobs_NK = np.asarray(logprobs_NK)
        if ids_NK.shape != logprobs_NK.shape or ids_NK.ndim != 2:
            raise ValueError(
                f"ids and logprobs must be N x K of one shape, got {ids_NK.shape} and "
                f"{logprobs_NK.shape}"
            )
        keep = ids_NK >= 0
        counts = keep.sum(axis=1)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        ids = ids_NK[keep].astype(np.int64 if ids_NK.dtype == np.int64 else np.int32)
        lps = logprobs_NK[keep]
        lps = lps.astype(lps.dtype if lps.dtype.name in _FLOAT else np.float32)
        return cls(
            ids=Tensor.from_numpy(ids),
            logprobs=Tensor.from_numpy(lps),
            offsets=Tensor.from_numpy(offsets),
        )

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and log-probs of position ``i``'s support."""
        off = self.offsets.to_numpy()
        lo, hi = int(off[i]), int(off[i + 1])
        return self.ids.to_numpy()[lo:hi], self.logprobs.to_numpy()[lo:hi]


class TokenSegment(Record):
    """One model call inside an attempt: the full prompt it saw and what it generated.

    Per generated token: ``token_ids``, the sampler's log q^S (``logprobs``), the
    ``support`` it could choose from, and the weight ``versions`` that produced it.
    ``cost_usd`` is what the call cost on the sampler that answered it (copied from
    `Generation.cost_usd`; 0.0 when the sampler has no price).
    """

    prompt_ids: Tensor
    token_ids: Tensor
    logprobs: Tensor
    support: SupportCSR
    versions: Tensor
    sampler: SamplerIdentity
    finish_reason: FinishReason
    cost_usd: NonNegFloat = 0.0

    def __post_init__(self) -> None:
        _vector(self.prompt_ids, "prompt_ids", _INT)
        _check_tokens(self.token_ids, self.logprobs, self.support, self.versions)
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

    def __post_init__(self) -> None:
        if _vector(self.prompt_ids, "prompt_ids", _INT) == 0:
            raise ValueError("prompt_ids must not be empty")


class Generation(Message):
    """A sampler's answer to a `GenerateRequest` (see `TokenSegment` for the arrays).

    ``cost_usd``: dollars this generation cost on the sampler that answered it, filled
    in by the sampler pool: the sampler's ``price_per_hour / 3600`` times the busy
    seconds attributed to this request (each second the sampler was busy is shared
    equally by the requests running in it then). 0.0 for a sampler without a price,
    and as sent by samplers themselves.
    """

    request_id: str
    token_ids: Tensor
    logprobs: Tensor
    support: SupportCSR
    versions: Tensor
    sampler: SamplerIdentity
    finish_reason: FinishReason
    cost_usd: NonNegFloat = 0.0

    def __post_init__(self) -> None:
        _check_tokens(self.token_ids, self.logprobs, self.support, self.versions)
        _check_dollars(self.cost_usd, "Generation.cost_usd")


class GenerateFailed(Message):
    """A sampler could not answer a request; ``retryable`` if another try may succeed."""

    request_id: str
    reason: str
    retryable: bool = False


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

SAMPLER = Codec("sampler", [GenerateRequest, Generation, GenerateFailed], error_reply=True)
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

ALL_MESSAGES: tuple[type[Message], ...] = tuple(
    dict.fromkeys(
        t for c in (SAMPLER, WEIGHTS, FLEET, ROLLOUTS, CONTROL) for t in c.types
    )
)
"""Every message type of every conversation (each once)."""


# --------------------------------------------------------------------------- examples


_EXAMPLE_SAMPLER = SamplerIdentity(
    sampler_id="example-0", backend="torch", device_kind="cpu", dtype="bfloat16"
)


def example_generation(
    n_tokens: int = 500, k: int = 20, *, vocab: int = 151_936, version: int = 7, seed: int = 0
) -> Generation:
    """A realistic `Generation`: ``n_tokens`` tokens, each with a support of ``k``."""
    rng = np.random.default_rng(seed)
    # k distinct ids per position, spread over the vocabulary
    start = rng.integers(0, vocab, size=(n_tokens, 1))
    support_ids = ((start + np.arange(k) * (vocab // k)) % vocab).astype(np.int32)
    z = rng.standard_normal((n_tokens, k)).astype(np.float32) * 3
    z = -np.sort(-z, axis=1)  # most likely first, as samplers report it
    support_lp = (z - np.log(np.exp(z).sum(axis=1, keepdims=True))).astype(np.float32)
    pick = np.minimum(rng.geometric(0.5, size=n_tokens) - 1, k - 1)
    rows = np.arange(n_tokens)
    return Generation(
        request_id=f"req-{seed}",
        token_ids=Tensor.from_numpy(support_ids[rows, pick]),
        logprobs=Tensor.from_numpy(support_lp[rows, pick]),
        support=SupportCSR.from_padded(support_ids, support_lp),
        versions=Tensor.from_numpy(np.full(n_tokens, version, dtype=np.int64)),
        sampler=_EXAMPLE_SAMPLER,
        finish_reason="stop",
    )


def example_trajectory(
    n_tokens: int = 2000,
    k: int = 20,
    *,
    n_segments: int = 4,
    prompt_tokens: int = 512,
    vocab: int = 151_936,
    seed: int = 0,
) -> Trajectory:
    """A typical `Trajectory` message: ``n_tokens`` generated tokens with a support of
    ``k`` each, over ``n_segments`` model calls whose prompts grow with the
    conversation (first prompt ``prompt_tokens`` long). For benchmarks and tests."""
    if n_segments < 1 or n_tokens < n_segments:
        raise ValueError(f"need 1 <= n_segments <= n_tokens, got {n_segments}, {n_tokens}")
    rng = np.random.default_rng(seed)
    context = rng.integers(0, vocab, size=prompt_tokens, dtype=np.int32)
    sizes = [n_tokens // n_segments + (i < n_tokens % n_segments) for i in range(n_segments)]
    segments = []
    for i, size in enumerate(sizes):
        gen = example_generation(size, k, vocab=vocab, version=7 + i, seed=seed * 1000 + i)
        segments.append(TokenSegment.from_generation(Tensor.from_numpy(context), gen))
        tool_output = rng.integers(0, vocab, size=64, dtype=np.int32)
        context = np.concatenate([context, gen.token_ids.to_numpy(), tool_output])
    return Trajectory(
        attempt_id=f"attempt-{seed}",
        task_id="task-example",
        group_id="group-example",
        segments=tuple(segments),
        reward=1.0,
        metrics={"tests_passed": 3.0, "wall_s": 41.5},
    )

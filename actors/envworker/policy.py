"""Retry policy and attempt classification (pure; no I/O).

An attempt ends in one of two ways:

* **scored**: the harness returned an `Episode` and the task's evaluator ran and gave a
  reward. A wrong answer, a harness that hit its own turn limit or its own timeout, an
  evaluator that exits non-zero: all of these are *scored* (reward 0 where the
  evaluator says so). They are the model's fault and the trainer must see them.
* **failed**: no reward can be given, through no fault of the model. The kinds are the
  wire's `RolloutFailureKind`:

  - ``sandbox_error``: leasing or preparing the sandbox failed (engine error, a setup
    command failed, the container went away);
  - ``harness_crash``: the harness raised;
  - ``timeout``: the harness did not return within the attempt's wall clock
    (``task.limits.timeout_s`` plus the configured slack), an external program was
    stopped at its own limit (``ExternalEpisode.timed_out``), or the attempt was
    abandoned at shutdown;
  - ``evaluator_error``: the evaluator's output could not be read
    (``EvaluatorOutputError``);
  - ``sampler_error``: the model could not answer (the harness's episode ended in
    ``error`` because of ``ModelUnavailable``).

`RetryPolicy` bounds how often a failed attempt is tried again, per kind, counting the
first try: ``max_tries["timeout"] == 1`` means a timed-out attempt is never retried.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

from fleetrl.daemon.messages import RolloutFailureKind

__all__ = ["DEFAULT_MAX_TRIES", "FAILURE_KINDS", "Decision", "RetryPolicy", "episode_failure"]

FAILURE_KINDS: tuple[str, ...] = get_args(RolloutFailureKind)

DEFAULT_MAX_TRIES: dict[str, int] = {
    "sandbox_error": 3,   # engine hiccups are usually transient
    "harness_crash": 1,   # a crashing harness will most likely crash again
    "timeout": 1,         # a retry would cost the same wall clock again
    "evaluator_error": 2,
    "sampler_error": 3,   # the pool re-routes; a later try may find a live sampler
}

Decision = Literal["retry", "give_up"]


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How failed attempts are retried and when a group counts as incomplete.

    ``max_tries``: tries per attempt slot for each failure kind, the first included
    (missing kinds take `DEFAULT_MAX_TRIES`). A slot's tries are counted over all
    kinds: a slot is retried while its number of tries is below the bound of the kind
    that just failed it.

    ``max_failed_per_group``: a group whose slots end failed more often than this is
    *incomplete*: its scored trajectories are not emitted as a `RolloutGroup` (GRPO
    would compare a biased subset) and the group is reported (log line, metric, one
    `RolloutFailed` per failed slot). None: ``group_size - 2`` (at least two scored
    attempts are needed for a group advantage).
    """

    max_tries: dict[str, Annotated[int, msgspec.Meta(ge=1, le=100)]] = msgspec.field(
        default_factory=lambda: dict(DEFAULT_MAX_TRIES))
    max_failed_per_group: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.max_tries) - set(FAILURE_KINDS))
        if unknown:
            raise ValueError(f"RetryPolicy.max_tries: unknown failure kind(s) {', '.join(unknown)} "
                             f"(known: {', '.join(FAILURE_KINDS)})")

    def tries_for(self, kind: str) -> int:
        """Most tries of a slot whose latest try failed with `kind`."""
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown failure kind {kind!r} (known: {', '.join(FAILURE_KINDS)})")
        return self.max_tries.get(kind, DEFAULT_MAX_TRIES[kind])

    def decide(self, kind: str, tries: int) -> Decision:
        """After the `tries`-th try of a slot failed with `kind`: retry or give up."""
        if tries < 1:
            raise ValueError(f"tries must be >= 1, got {tries}")
        return "retry" if tries < self.tries_for(kind) else "give_up"

    def failed_allowed(self, group_size: int) -> int:
        """Most failed slots a group of `group_size` may have and still be emitted."""
        if self.max_failed_per_group is not None:
            return min(self.max_failed_per_group, group_size)
        return max(group_size - 2, 0)


def episode_failure(final_state: str, error: str | None) -> tuple[str, str] | None:
    """The failure kind and detail of an episode the harness returned, or None when it
    is to be scored. Only ``error`` episodes fail: one whose model could not answer
    (``harness.model.ModelUnavailable``, reported by the built-in harnesses as
    "model unavailable: ...") is a ``sampler_error``; any other is a ``harness_crash``.
    ``submitted``, ``turn_limit`` and ``timeout`` (the harness's own) are scored."""
    if final_state != "error":
        return None
    detail = error or "episode ended in error"
    return ("sampler_error" if detail.startswith("model unavailable") else "harness_crash"), detail

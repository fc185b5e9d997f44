"""Flood control of the OpenAI-compatible endpoint (pure: counters, no I/O, no clock).

Two limits, both checked when a call reaches them and never by waiting: a call over a
limit is refused at once with an `ApiError` 429 (OpenAI's error body, type
``rate_limit_error``, a ``Retry-After`` header of `RETRY_AFTER_S` seconds), is not
sent to the model and is not recorded; the calls already admitted are untouched.

* Per attempt: at most ``per_attempt`` calls of one attempt key in flight (from the
  moment the key is known until the response is built); the next one gets code
  ``too_many_concurrent_calls``. One harness flooding its own key cannot crowd out
  the others.
* In total: at most ``waiting`` calls waiting for the model, whatever their attempt;
  the next one gets code ``endpoint_busy``. A call takes this slot only once its
  request has been read and checked, just before it is sent to the model.

Everything runs on one Trio thread and a check and its count happen with no
checkpoint between them, so a limit is never overshot. `CallLimits.statistics`
counts what was admitted and refused, by code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import msgspec

from .errors import ApiError

__all__ = ["RETRY_AFTER_S", "CallLimits", "LimitStatistics"]

RETRY_AFTER_S = 1
"""The ``Retry-After`` of a refused call, in seconds (the official clients honour it)."""


class LimitStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """What the limits have done so far. ``in_flight``: calls holding an attempt's
    slot now; ``waiting``: calls waiting for the model now; ``admitted``: calls that
    got an attempt's slot; ``rejected_per_attempt`` / ``rejected_busy``: calls refused
    with ``too_many_concurrent_calls`` / ``endpoint_busy``."""

    in_flight: int
    waiting: int
    admitted: int
    rejected_per_attempt: int
    rejected_busy: int


class CallLimits:
    """The two limits of one endpoint app (see the module docstring)."""

    def __init__(self, *, per_attempt: int, waiting: int) -> None:
        if per_attempt < 1 or waiting < 1:
            raise ValueError(f"CallLimits: limits must be >= 1, got per_attempt={per_attempt}, waiting={waiting}")
        self.per_attempt = per_attempt
        self.waiting = waiting
        self._by_key: dict[str, int] = {}
        self._waiting = 0
        self._admitted = 0
        self._rejected = {"too_many_concurrent_calls": 0, "endpoint_busy": 0}

    @contextmanager
    def attempt_slot(self, key: str) -> Iterator[None]:
        """Hold one of the ``per_attempt`` slots of the attempt ``key`` for the block;
        none free: an `ApiError` 429 ``too_many_concurrent_calls``."""
        n = self._by_key.get(key, 0)
        if n >= self.per_attempt:
            self._rejected["too_many_concurrent_calls"] += 1
            raise ApiError(429, f"this attempt already has {n} calls in flight, the most the endpoint runs at once "
                                f"for one attempt; retry after {RETRY_AFTER_S} s", type="rate_limit_error",
                           code="too_many_concurrent_calls", retry_after_s=RETRY_AFTER_S)
        self._by_key[key] = n + 1
        self._admitted += 1
        try:
            yield
        finally:
            left = self._by_key[key] - 1
            if left:
                self._by_key[key] = left
            else:
                del self._by_key[key]

    @contextmanager
    def model_slot(self) -> Iterator[None]:
        """Hold one of the ``waiting`` slots for calls waiting for the model; none
        free: an `ApiError` 429 ``endpoint_busy``."""
        if self._waiting >= self.waiting:
            self._rejected["endpoint_busy"] += 1
            raise ApiError(429, f"the endpoint already has {self._waiting} calls waiting for the model, its limit; "
                                f"retry after {RETRY_AFTER_S} s", type="rate_limit_error", code="endpoint_busy",
                           retry_after_s=RETRY_AFTER_S)
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    def in_flight(self, key: str | None = None) -> int:
        """Calls holding an attempt's slot now (of ``key``, or of every attempt)."""
        return sum(self._by_key.values()) if key is None else self._by_key.get(key, 0)

    def statistics(self) -> LimitStatistics:
        return LimitStatistics(in_flight=self.in_flight(), waiting=self._waiting, admitted=self._admitted,
                               rejected_per_attempt=self._rejected["too_many_concurrent_calls"],
                               rejected_busy=self._rejected["endpoint_busy"])

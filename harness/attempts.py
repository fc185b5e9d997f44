"""The open attempts of the OpenAI-compatible endpoint, by key, and who a request is for.

The environment worker opens an attempt with `AttemptRegistry.open_attempt` and hands
the harness the key it returns, as the API key (``Authorization: Bearer <key>``) or,
for a harness whose API key is fixed, in the `ATTEMPT_HEADER` header.
`resolve_attempt` finds the attempt of a request's headers; a key the registry does
not know, or whose attempt is closed, is an `ApiError` 401. `close_attempt` returns
the attempt's `AttemptRecord`. Pure (no I/O).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from .chat import ChatTokenizer
from .errors import ApiError
from .recording import AttemptRecord, AttemptRecorder

__all__ = ["ATTEMPT_HEADER", "AttemptRegistry", "resolve_attempt"]

ATTEMPT_HEADER = "X-Fleetrl-Attempt"
"""Fallback attribution header: the attempt key, for harnesses with a fixed API key."""


class AttemptRegistry:
    """The open attempts, by key. The environment worker opens and closes them."""

    max_closed = 100_000
    """Closed keys remembered (oldest forgotten first); a forgotten one is 'unknown'."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self._open: dict[str, AttemptRecorder] = {}
        self._closed: dict[str, str] = {}  # key -> attempt id

    def open_attempt(self, attempt_id: str, task_id: str) -> str:
        """Start recording an attempt; returns its key (a fresh random secret)."""
        if not attempt_id or not task_id:
            raise ValueError("open_attempt: attempt_id and task_id must be non-empty")
        if any(r.attempt_id == attempt_id for r in self._open.values()):
            raise ValueError(f"open_attempt: attempt {attempt_id!r} is already open")
        key = "fleetrl-" + secrets.token_urlsafe(24)
        self._open[key] = AttemptRecorder(attempt_id, task_id, self.tokenizer)
        return key

    def close_attempt(self, key: str) -> AttemptRecord:
        """Stop recording and return the record; later calls with ``key`` get 401."""
        rec = self._open.pop(key, None)
        if rec is None:
            raise KeyError("close_attempt: no open attempt has this key")
        self._closed[key] = rec.attempt_id
        while len(self._closed) > self.max_closed:  # remembered only to say "closed"
            del self._closed[next(iter(self._closed))]
        return rec.finish()

    def recorder(self, key: str) -> AttemptRecorder | None:
        """The recorder of the open attempt with ``key``, else None."""
        return self._open.get(key)

    def is_closed(self, key: str) -> bool:
        return key in self._closed

    def __len__(self) -> int:
        return len(self._open)


def resolve_attempt(registry: AttemptRegistry, headers: Mapping[str, str]) -> tuple[str, AttemptRecorder]:
    """The key and recorder of the open attempt a request's ``headers`` name (looked up
    case-insensitively, as Starlette's are): the bearer token first, then
    `ATTEMPT_HEADER`. No key, an unknown key or a closed attempt is an `ApiError` 401."""
    auth = headers.get("authorization", "")
    bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    header = headers.get(ATTEMPT_HEADER, "").strip()
    for key in (bearer, header):
        if not key:
            continue
        rec = registry.recorder(key)
        if rec is not None:
            return key, rec
        if registry.is_closed(key):
            raise ApiError(401, "the attempt of this key is closed", type="authentication_error",
                           code="attempt_closed")
    if not bearer and not header:
        raise ApiError(401, f"no attempt key: send it as the API key (Authorization: Bearer <key>) "
                            f"or in the {ATTEMPT_HEADER} header", type="authentication_error", code="invalid_api_key")
    raise ApiError(401, "unknown attempt key", type="authentication_error", code="invalid_api_key")

"""Dashboard log-in sessions: a random cookie value per log-in, held in memory with an
expiry (pure but for the clock and the random source). The control token itself is only
ever sent once, in the body of the log-in form; the browser keeps the cookie
(``HttpOnly``, ``SameSite=Strict``), so no URL carries a credential."""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable

__all__ = ["COOKIE", "Sessions"]

COOKIE = "fleetrl_ui"


class Sessions:
    def __init__(self, ttl_s: float, clock: Callable[[], float], *, limit: int = 256) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.limit = limit
        self._expires: dict[str, float] = {}

    def create(self) -> str:
        now = self.clock()
        self._expires = {k: t for k, t in self._expires.items() if t > now}
        while len(self._expires) >= self.limit:  # the oldest log-in goes first
            del self._expires[min(self._expires, key=self._expires.__getitem__)]
        key = secrets.token_urlsafe(32)
        self._expires[key] = now + self.ttl_s
        return key

    def valid(self, key: str | None) -> bool:
        if not key:
            return False
        now = self.clock()
        for k, t in self._expires.items():  # constant-time compare of every live key
            if hmac.compare_digest(k, key):
                return t > now
        return False

    def end(self, key: str | None) -> None:
        if key:
            self._expires.pop(key, None)

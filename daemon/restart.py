"""Pure restart arithmetic: backoff delays and the restart-intensity limit.

No I/O and no clock of its own: the supervisor passes ``now`` (Trio's clock), so
tests drive it with any numbers, and with ``autojump_clock`` end to end.
"""

from __future__ import annotations

import math
import random
from collections import deque

from .config import RestartPolicy

__all__ = ["RestartTracker", "backoff_delay"]


def backoff_delay(policy: RestartPolicy, attempt: int, rng: random.Random | None = None) -> float:
    """Delay before restart number `attempt` (1-based) of a crash streak.

    ``min(max, base * factor**(attempt-1))``, multiplied by a uniform factor in
    ``[1 - jitter, 1 + jitter]`` (never negative, never above ``backoff_max_s``).
    """
    if attempt < 1:
        raise ValueError("attempt is 1-based")
    # compare in log space: base * factor**(attempt-1) overflows a float long
    # before a crash streak ends
    log_delay = math.log(policy.backoff_base_s) + (attempt - 1) * math.log(policy.backoff_factor)
    if log_delay >= math.log(policy.backoff_max_s):
        delay = policy.backoff_max_s
    else:
        delay = policy.backoff_base_s * policy.backoff_factor ** (attempt - 1)
    if policy.jitter and rng is not None:
        delay *= 1 + policy.jitter * rng.uniform(-1.0, 1.0)
    return max(0.0, min(delay, policy.backoff_max_s))


class RestartTracker:
    """Crash history of one actor within its intensity window."""

    def __init__(self, policy: RestartPolicy, rng: random.Random | None = None) -> None:
        self.policy = policy
        self.rng = rng if rng is not None else random.Random()
        self._crashes: deque[float] = deque()
        self.total = 0

    def recent(self, now: float) -> int:
        """Crashes within the last ``period_s`` seconds (older ones are forgotten)."""
        while self._crashes and self._crashes[0] <= now - self.policy.period_s:
            self._crashes.popleft()
        return len(self._crashes)

    def crash(self, now: float) -> float | None:
        """Record a crash at `now`; the delay before restarting, or None to escalate.

        Escalates when more than ``intensity`` crashes fall within ``period_s``. The
        backoff grows with the number of recent crashes, so an actor that has been
        stable for a whole period starts again from ``backoff_base_s``.
        """
        self.total += 1
        self._crashes.append(now)
        n = self.recent(now)
        if n > self.policy.intensity:
            return None
        return backoff_delay(self.policy, n, self.rng)

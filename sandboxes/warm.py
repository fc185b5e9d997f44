"""Pure sizing policy of the warm pool: how many containers to keep warm per key.

Demand is the number of leases held at once. The warm target (containers of the key:
idle + leased + starting + being reset) follows the recent peak of demand over a
sliding window, times ``1 + headroom``: the headroom covers leases that arrive while
released containers are still being reset, so a steady loop of N workers is served
from warm containers without churn, and a repeat of a burst is served warm too. Once
the burst has left the window the pool shrinks back to ``min_warm``. Kept apart from
the pool's I/O so it can be tested exhaustively.
"""

from __future__ import annotations

import math
from collections import deque

import msgspec

__all__ = ["WarmPolicy", "DemandTracker"]


class WarmPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Bounds of the warm pool, per (image, limits) key unless said otherwise."""

    min_warm: int = 1
    """Containers kept ready even when nothing is leased."""
    max_warm: int = 8
    """Most containers kept warm for reuse (idle + leased + starting + resetting);
    leases beyond it still get a container, which is removed when released."""
    headroom: float = 1.0
    """Warm target = peak concurrent leases * (1 + headroom), within the bounds."""
    max_containers: int = 64
    """Most containers (idle + leased + starting) of the whole pool; leases wait beyond it."""
    window_s: float = 60.0
    """How long a demand peak keeps the target up."""
    max_starting: int = 4
    """Most containers being started at once in the background, per key."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_warm <= self.max_warm:
            raise ValueError(f"WarmPolicy: need 0 <= min_warm ({self.min_warm}) <= max_warm ({self.max_warm})")
        if self.max_warm > self.max_containers:
            raise ValueError(
                f"WarmPolicy: max_warm ({self.max_warm}) must not exceed max_containers ({self.max_containers})"
            )
        if not 1 <= self.max_containers <= 10_000:
            raise ValueError(f"WarmPolicy.max_containers: {self.max_containers} is outside [1, 10000]")
        if not 0 < self.window_s <= 86_400:
            raise ValueError(f"WarmPolicy.window_s: {self.window_s} is outside (0, 86400]")
        if not 0 <= self.headroom <= 16:
            raise ValueError(f"WarmPolicy.headroom: {self.headroom} is outside [0, 16]")
        if not 1 <= self.max_starting <= 256:
            raise ValueError(f"WarmPolicy.max_starting: {self.max_starting} is outside [1, 256]")


class DemandTracker:
    """Sliding-window peak of concurrent leases for one key."""

    def __init__(self, policy: WarmPolicy) -> None:
        self.policy = policy
        self._samples: deque[tuple[float, int]] = deque()  # (time, leased), times increasing

    def record(self, now: float, leased: int) -> None:
        self._samples.append((now, leased))
        self._expire(now)

    def _expire(self, now: float) -> None:
        # Keep the sample in effect at the window's start (the last one at or before it).
        horizon = now - self.policy.window_s
        while len(self._samples) > 1 and self._samples[1][0] <= horizon:
            self._samples.popleft()

    def peak(self, now: float) -> int:
        self._expire(now)
        return max((n for _, n in self._samples), default=0)

    def target_warm(self, now: float) -> int:
        """Containers to keep warm for this key: the recent peak of concurrent leases
        times (1 + headroom), within [min_warm, max_warm]."""
        want = math.ceil(self.peak(now) * (1.0 + self.policy.headroom))
        return max(self.policy.min_warm, min(self.policy.max_warm, want))

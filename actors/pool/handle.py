"""What an actor holding the sampler pool's handle may call (`PoolHandle`).

The pool actor starts with its `core.SamplerPool` as its handle; an actor that generates
through it asks for it as a `PoolHandle` (``await ctx.handle(name, PoolHandle)``), so a
config that names another actor where a pool belongs fails at once with
`fleetrl.daemon.faults.WrongHandle` naming both, and the holder is typed by what it
uses: generation (`generate`, `stream`) and staleness pacing (`admit`, `finish`,
`released`, and the `pacer`'s ``attempts_per_step``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from fleetrl.daemon import messages as m

__all__ = ["PoolHandle"]


@runtime_checkable
class PoolHandle(Protocol):
    """The sampler pool as its holders use it."""

    pacer: Any
    """The staleness pacer (`pacing.Pacer`): ``attempts_per_step`` and its state."""

    async def generate(self, request: m.GenerateRequest) -> m.Generation | m.GenerateFailed:
        """One request's answer (routed, retried on another sampler where it may be)."""
        ...

    def stream(self, request: m.GenerateRequest) -> AsyncIterator[m.TokenChunk | m.Generation | m.GenerateFailed]:
        """The request's tokens as they come, then its answer."""
        ...

    async def admit(self, attempt_id: str) -> Any:
        """Wait until the pacer admits an attempt."""
        ...

    def finish(self, attempt_id: str, result: Any = None, *, failed: bool = False) -> None:
        """End an admitted attempt."""
        ...

    async def released(self) -> list[tuple[Any, Any, bool]]:
        """The next finished attempts, in admission order."""
        ...

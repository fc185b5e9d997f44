"""Streams that fall back to one answer (pure Trio; no actor state).

A client or handle may stream its answer (``stream(*args)``: an async iterator of pieces,
then the answer) or only give it whole (``once(*args)``). `stream_or_once` reads either
the same way, so a caller has one loop for both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, TypeVar

__all__ = ["stream_or_once"]

T = TypeVar("T")


async def stream_or_once(stream: Callable[..., AsyncIterator[T]] | None, once: Callable[..., Awaitable[T]],
                         *args: Any) -> AsyncIterator[T]:
    """The items of ``stream(*args)``, or (``stream`` None) the one result of
    ``await once(*args)``. The inner stream is closed when this one is: use it inside
    ``contextlib.aclosing``."""
    if stream is None:
        yield await once(*args)
        return
    async with aclosing(stream(*args)) as items:
        async for item in items:
            yield item

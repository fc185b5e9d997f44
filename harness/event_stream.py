"""A server-sent event response written by a coroutine while it runs (Starlette, Trio).

`EventStream` is a `StreamingResponse` whose body is written by ``produce(emit)`` in the
request's own task: no generator is suspended across a nursery, a client disconnect (or
a failed send) cancels ``produce``, and the request's ``slots`` (its flood limits,
`openai_limits`) are held until the stream ends and released however it ends. Choices
that stream concurrently call ``emit`` from several tasks: one body message goes out at
a time.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import ExitStack

import trio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["Emit", "EventStream"]

Emit = Callable[[bytes], Awaitable[None]]
"""Sends one piece of the body (an encoded event)."""


class EventStream(StreamingResponse):
    """The response of ``produce(emit)`` (module docstring); ``slots`` close when it ends."""

    def __init__(self, produce: Callable[[Emit], Awaitable[None]], headers: dict[str, str], slots: ExitStack) -> None:
        super().__init__((), media_type="text/event-stream", headers=headers)
        self.produce = produce
        self.slots = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with self.slots, trio.CancelScope() as stream_scope:
            lock = trio.Lock()
            gone = False

            async def emit(data: bytes) -> None:
                nonlocal gone
                async with lock:
                    try:
                        await send({"type": "http.response.body", "body": data, "more_body": True})
                    except OSError:  # the client left
                        gone = True
                        stream_scope.cancel()
                        await trio.lowlevel.checkpoint()

            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with trio.open_nursery() as nursery:
                async def disconnect() -> None:
                    nonlocal gone
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    gone = True
                    stream_scope.cancel()

                nursery.start_soon(disconnect)
                await self.produce(emit)
                nursery.cancel_scope.cancel()
            if not gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

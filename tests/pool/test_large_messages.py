"""Long calls cross a WebSocket whole: the control plane (hypercorn) and fleetrl's client
(`remote_client.connect`, used by remote samplers and workers) accept messages up to
`MAX_WEBSOCKET_MESSAGE`, far past the libraries' defaults (16 MiB and 1 MiB), which a
few thousand generated tokens of a real-vocabulary record exceed. A real server on
127.0.0.1 and a real client, 20 MiB each way."""

from __future__ import annotations

from functools import partial

import trio
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from fleetrl.actors.pool.remote_client import connect
from fleetrl.daemon.control import serve_control
from fleetrl.daemon.protocol import MAX_WEBSOCKET_MESSAGE

SIZE = 20 << 20  # over both libraries' defaults


async def test_twenty_mebibytes_cross_each_way():
    assert MAX_WEBSOCKET_MESSAGE > SIZE
    got: list[int] = []

    async def echo(ws: WebSocket) -> None:
        await ws.accept()
        data = await ws.receive_bytes()
        got.append(len(data))
        await ws.send_bytes(data[::-1])
        await ws.close()

    app = Starlette(routes=[WebSocketRoute("/big", echo)])
    payload = bytes(range(256)) * (SIZE // 256)
    stop = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as n:
            host, port = await n.start(partial(serve_control, app, "127.0.0.1", 0, shutdown_trigger=stop.wait))
            async with connect(f"ws://{host}:{port}/big") as ws:
                await ws.send_message(payload)
                back = await ws.get_message()
            stop.set()
    assert got == [SIZE] and back == payload[::-1]

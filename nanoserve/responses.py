"""The server's two response types (days 38-39): both notice a client that leaves.

Starlette (ASGI spec 2.4) only learns that a client went away on its next write, which for a
request still waiting on its first token, or a non-streaming one still being computed, can be
minutes. Both classes therefore run the work next to a listener for `http.disconnect`:

* `EventStream`: server-sent events. The body and the listener run side by side; whichever
  ends first cancels the other, so the generator's `finally` (which aborts the request in the
  engine) runs as soon as the client is gone.
* `WhenDone`: a JSON answer computed while listening; a client that leaves first cancels the
  computation and `on_disconnect()` aborts the request.
"""

from __future__ import annotations

import anyio
from fastapi.responses import Response, StreamingResponse


class EventStream(StreamingResponse):
    """Server-sent events that notice a client leaving: the body runs next to a listener for
    `http.disconnect`, and whichever ends first cancels the other, so the generator's `finally`
    (which aborts the request) runs as soon as the client is gone, whatever the ASGI server."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def body() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(body)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


class WhenDone(Response):
    """A response computed by `compute()` (an awaitable returning a Response) while listening
    for the client to leave: if it leaves first, the computation is cancelled and
    `on_disconnect()` runs (the server aborts the request, freeing its blocks)."""

    def __init__(self, compute, on_disconnect):
        self.compute, self.on_disconnect = compute, on_disconnect
        self.background = None

    async def __call__(self, scope, receive, send) -> None:
        done = False

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listen)
                response = await self.compute()
                done = True
                tg.cancel_scope.cancel()
        finally:
            if not done:
                self.on_disconnect()
        if done:
            await response(scope, receive, send)

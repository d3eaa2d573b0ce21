"""The server's two response types (days 38-39): both notice a client that leaves.

Starlette (ASGI spec 2.4) only learns that a client went away on its next write, which for a
request still waiting on its first token, or a non-streaming one still being computed, can be
minutes. Both classes therefore run the work next to a listener for `http.disconnect`:

* `EventStream`: server-sent events. The body and the listener run side by side; whichever
  ends first cancels the other, so the generator's `finally` (which aborts the request in the
  engine) runs as soon as the client is gone.
* `WhenDone`: a JSON answer computed while listening; a client that leaves first cancels the
  computation and `on_disconnect()` aborts the request.

`Answer` is what both carry: one request's outputs in OpenAI's completion or chat shape, whole
or as server-sent event chunks.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
from fastapi.responses import Response, StreamingResponse

from nanoserve.engine import RequestOutput


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


class Answer:
    """One request's response, whole (`whole`) or as server-sent event chunks (`chunk`), in
    OpenAI's completion or chat shape."""

    def __init__(self, rid: str, model: str, chat: bool, n_prompt: int, with_ids: bool):
        self.rid, self.model, self.chat, self.n_prompt, self.with_ids = rid, model, chat, n_prompt, with_ids
        self.created = int(time.time())
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.finish: str | None = None

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text_delta)
        self.token_ids.extend(out.new_token_ids)
        self.finish = out.finish_reason

    def usage(self) -> dict:
        n = len(self.token_ids)
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n, "total_tokens": self.n_prompt + n}

    def _body(self, obj: str, choices: list, **extra) -> dict:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        } | extra

    def whole(self) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish, "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": "".join(self.text)}
        else:
            choice["text"] = "".join(self.text)
        if self.with_ids:
            choice["token_ids"] = self.token_ids
        return self._body("chat.completion" if self.chat else "text_completion", [choice], usage=self.usage())

    def _event(self, choices: list, **extra) -> str:
        body = self._body("chat.completion.chunk" if self.chat else "text_completion", choices, **extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def chunk(self, delta, finish: str | None, token_ids: list[int], include_usage: bool = False) -> str:
        """A chunk carrying delta: text (or, for chat's first chunk, a whole delta dict)."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["delta"] = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
        else:
            choice["text"] = delta
        if self.with_ids and not isinstance(delta, dict):
            choice["token_ids"] = token_ids
        return self._event([choice], **({"usage": None} if include_usage else {}))

    def usage_chunk(self) -> str:
        return self._event([], usage=self.usage())

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


class Scores:
    """OpenAI's two shapes of log-probabilities, from the engine's `TokenLogprobs`.

    Completions (`logprobs: N`): parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a
    dict of the N most likely, plus the chosen token when it is not among them) and
    `text_offset` (where each token's text starts in the choice's text; a prompt's first token
    has no score, so its entries are null). Chat (`logprobs: true, top_logprobs: N`): a
    `content` list of {token, logprob, bytes, top_logprobs: exactly N}. A token is named by
    `Tokenizer.token_text` (the `bytes:` form for part of a character)."""

    def __init__(self, tokenizer, top: int):
        self.tok, self.top = tokenizer, top

    def name(self, token_id: int) -> str:
        return self.tok.token_text(token_id) if self.tok is not None else str(token_id)

    def _bytes(self, token_id: int) -> list[int]:
        return list(self.tok.token_bytes(token_id)) if self.tok is not None else []

    def completion(self, entries: list, token_ids: list[int], offsets: list[int]) -> dict:
        tops = []
        for e in entries:
            if e is None:
                tops.append(None)
                continue
            top = {self.name(t): lp for t, lp in e.top[: self.top]}
            top.setdefault(self.name(e.token_id), e.logprob)
            tops.append(top)
        return {
            "tokens": [self.name(t) for t in token_ids],
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": tops,
            "text_offset": list(offsets),
        }

    def chat(self, entries: list) -> dict:
        content = [
            {
                "token": self.name(e.token_id),
                "logprob": e.logprob,
                "bytes": self._bytes(e.token_id),
                "top_logprobs": [
                    {"token": self.name(t), "logprob": lp, "bytes": self._bytes(t)}
                    for t, lp in e.top[: self.top]
                ],
            }
            for e in entries
        ]
        return {"content": content, "refusal": None}


class Choice:
    """One answer of a request: its text, tokens and scores as they arrive."""

    def __init__(self, index: int, n_prompt: int, echo: tuple[str, list[int], list[int]] | None = None):
        self.index, self.n_prompt = index, n_prompt
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.entries: list = []  # TokenLogprobs of the generated tokens
        self.offsets: list[int] = []  # where each generated token's text starts
        self.finish: str | None = None
        self.chars = 0
        # echo: (the prompt's text, its token ids, each token's offset in that text)
        self.echo = echo
        self.prompt_entries: list | None = None
        if echo is not None:
            self.chars = len(echo[0])
        self.sent = 0  # tokens already streamed
        self.echo_sent = False

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_entries = out.prompt_logprobs
        for _ in out.new_token_ids:
            self.offsets.append(self.chars)
        self.text.append(out.text_delta)
        self.chars += len(out.text_delta)
        self.token_ids.extend(out.new_token_ids)
        self.entries.extend(out.logprobs or [])
        self.finish = out.finish_reason

    def echo_scored(self) -> tuple[list, list[int], list[int]]:
        """The echoed prompt's (scores, token ids, offsets); scores all None until they arrive."""
        _, ids, offsets = self.echo
        return self.prompt_entries or [None] * len(ids), ids, offsets

    @property
    def mean_logprob(self) -> float:
        """Per generated token: how best_of ranks its samples (OpenAI's 'log probability per token')."""
        return sum(e.logprob for e in self.entries) / max(len(self.entries), 1)


class Answer:
    """One request's response, whole (`whole`) or as server-sent event chunks (`chunk`), in
    OpenAI's completion or chat shape, with one `Choice` per answer. `scores` (a `Scores`) is set
    when the request asked for log-probabilities."""

    def __init__(
        self,
        rid: str,
        model: str,
        chat: bool,
        n_prompt: int,
        with_ids: bool,
        choices: list[Choice] | None = None,
        scores: Scores | None = None,
    ):
        self.rid, self.model, self.chat, self.n_prompt, self.with_ids = rid, model, chat, n_prompt, with_ids
        self.created = int(time.time())
        self.choices = choices if choices is not None else [Choice(0, n_prompt)]
        self.scores = scores
        self.generated = 0  # tokens every sample made, returned or not (best_of): what was computed

    def add(self, out: RequestOutput, k: int = 0) -> None:
        self.generated += len(out.new_token_ids)
        self.choices[k].add(out)

    def usage(self) -> dict:
        n = self.generated
        return {"prompt_tokens": self.n_prompt, "completion_tokens": n, "total_tokens": self.n_prompt + n}

    def _body(self, obj: str, choices: list, **extra) -> dict:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        } | extra

    def _logprobs(self, c: Choice, start: int, with_echo: bool):
        """Scores of c's tokens from `start` on, with the echoed prompt's first when with_echo."""
        if self.scores is None:
            return None
        entries, ids, offsets = c.entries[start:], c.token_ids[start:], c.offsets[start:]
        if self.chat:
            return self.scores.chat(entries)
        if with_echo and c.echo is not None:
            p_entries, p_ids, p_offsets = c.echo_scored()
            entries, ids, offsets = [*p_entries, *entries], [*p_ids, *ids], [*p_offsets, *offsets]
        return self.scores.completion(entries, ids, offsets)

    def whole(self, picked: list[Choice] | None = None) -> dict:
        """The whole answer; `picked`: the choices to return, in order (best_of chose them)."""
        out = []
        for index, c in enumerate(picked if picked is not None else self.choices):
            choice: dict[str, Any] = {"index": index, "finish_reason": c.finish}
            text = "".join(c.text)
            if self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = (c.echo[0] if c.echo is not None else "") + text
            choice["logprobs"] = self._logprobs(c, 0, with_echo=True)
            if self.with_ids:
                choice["token_ids"] = c.token_ids
            out.append(choice)
        return self._body("chat.completion" if self.chat else "text_completion", out, usage=self.usage())

    def _event(self, choices: list, **extra) -> str:
        body = self._body("chat.completion.chunk" if self.chat else "text_completion", choices, **extra)
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def role_chunk(self, k: int, include_usage: bool = False) -> str:
        """Chat's first chunk of choice k: the role."""
        choice = {
            "index": k,
            "delta": {"role": "assistant", "content": ""},
            "finish_reason": None,
            "logprobs": None,
        }
        return self._event([choice], **({"usage": None} if include_usage else {}))

    def echo_chunk(self, k: int, include_usage: bool = False) -> str:
        """A completion's echoed prompt, with its scores, before choice k's first token."""
        c = self.choices[k]
        c.echo_sent = True
        logprobs = None
        if self.scores is not None:
            logprobs = self.scores.completion(*c.echo_scored())
        choice = {"index": k, "text": c.echo[0], "finish_reason": None, "logprobs": logprobs}
        return self._event([choice], **({"usage": None} if include_usage else {}))

    def chunk(self, k: int, delta: str, finish: str | None, include_usage: bool = False) -> str:
        """Choice k's text since its last chunk, with the scores and ids of every token since."""
        c = self.choices[k]
        choice: dict[str, Any] = {"index": k, "finish_reason": finish}
        if self.chat:
            choice["delta"] = {"content": delta} if delta else {}
        else:
            choice["text"] = delta
        choice["logprobs"] = self._logprobs(c, c.sent, with_echo=False)
        if self.with_ids:
            choice["token_ids"] = c.token_ids[c.sent :]
        c.sent = len(c.token_ids)
        return self._event([choice], **({"usage": None} if include_usage else {}))

    def usage_chunk(self) -> str:
        return self._event([], usage=self.usage())

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
or as server-sent event chunks, one `Choice` per answer. A choice keeps its scores packed
(`ScoreColumns`: ids and float32 values, 8 bytes a score) rather than as the engine's Python
objects, and a streamed choice keeps nothing it has sent. How many scores a request may make at
all is the server's budget (api.check_score_budget), checked before it starts.
"""

from __future__ import annotations

import json
import time
from array import array
from typing import Any

import anyio
from fastapi.responses import Response, StreamingResponse

from nanoserve.engine import RequestOutput
from nanoserve.tools import ToolCallStream, parse_tool_calls


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


class ScoreColumns:
    """Scores of a run of tokens, packed in four flat arrays: for each token the id scored and its
    log-probability, and `top` alternatives (id, log-probability), most likely first.

    A token's scores take 8 * (top + 1) bytes here (a 4-byte id and a float32 each), where the
    engine's `TokenLogprobs` holds a list of Python tuples (about 2.5 KB with 20 alternatives).
    float32 loses nothing: the engine computes log-probabilities in float32
    (`sampling.logprobs_of`). A position without a score (a prompt's first token) has id -1;
    a shorter list of alternatives is padded with id -1."""

    def __init__(self, top: int):
        self.top = top
        self.ids = array("i")  # (tokens,)
        self.values = array("f")  # (tokens,)
        self.top_ids = array("i")  # (tokens * top,)
        self.top_values = array("f")  # (tokens * top,)
        self._pad_ids, self._pad_values = array("i", [-1]) * top, array("f", [0.0]) * top

    @classmethod
    def of(cls, entries: list, top: int) -> ScoreColumns:
        cols = cls(top)
        cols.extend(entries)
        return cols

    def extend(self, entries: list) -> None:
        """Append the engine's `TokenLogprobs` (or None for a position without a score)."""
        top = self.top
        for e in entries:
            if e is None:
                self.ids.append(-1)
                self.values.append(0.0)
                self.top_ids.extend(self._pad_ids)
                self.top_values.extend(self._pad_values)
                continue
            self.ids.append(e.token_id)
            self.values.append(e.logprob)
            pairs = e.top[:top]
            for t, lp in pairs:
                self.top_ids.append(t)
                self.top_values.append(lp)
            if len(pairs) < top:
                self.top_ids.extend(self._pad_ids[len(pairs) :])
                self.top_values.extend(self._pad_values[len(pairs) :])

    def __len__(self) -> int:
        return len(self.ids)

    def clear(self) -> None:
        for a in (self.ids, self.values, self.top_ids, self.top_values):
            del a[:]

    @property
    def nbytes(self) -> int:
        return sum(a.itemsize * len(a) for a in (self.ids, self.values, self.top_ids, self.top_values))

    def scored(self, i: int) -> bool:
        return self.ids[i] >= 0

    def alternatives(self, i: int, top: int) -> list[tuple[int, float]]:
        """Position i's `top` most likely (id, log-probability), padding left out."""
        start = i * self.top
        ids = self.top_ids[start : start + min(top, self.top)]
        values = self.top_values[start : start + min(top, self.top)]
        return [(t, v) for t, v in zip(ids, values) if t >= 0]


class Scores:
    """OpenAI's two shapes of log-probabilities, from `ScoreColumns`.

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

    def completion(self, parts: list[tuple]) -> dict:
        """`parts`: runs of (columns or None when not yet scored, token ids, text offsets), in
        order (an echoed prompt's, then the generated tokens')."""
        tokens, logprobs, tops, offsets = [], [], [], []
        for cols, ids, offs in parts:
            tokens += [self.name(t) for t in ids]
            offsets += list(offs)
            for i in range(len(ids)):
                if cols is None or not cols.scored(i):
                    logprobs.append(None)
                    tops.append(None)
                    continue
                lp = cols.values[i]
                top = {self.name(t): v for t, v in cols.alternatives(i, self.top)}
                top.setdefault(self.name(cols.ids[i]), lp)
                logprobs.append(lp)
                tops.append(top)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, cols: ScoreColumns) -> dict:
        content = [
            {
                "token": self.name(cols.ids[i]),
                "logprob": cols.values[i],
                "bytes": self._bytes(cols.ids[i]),
                "top_logprobs": [
                    {"token": self.name(t), "logprob": lp, "bytes": self._bytes(t)}
                    for t, lp in cols.alternatives(i, self.top)
                ],
            }
            for i in range(len(cols))
        ]
        return {"content": content, "refusal": None}


class Choice:
    """One answer of a request: its text, tokens and scores as they arrive. Streamed, it holds
    only what has not been sent yet (`Answer.chunk` clears the rest).

    `top`: the alternatives to keep a token (None: no scores are kept, only their running sum,
    which best_of ranks by). `echo`: (the prompt's text, its token ids, each token's offset in
    that text)."""

    def __init__(
        self, index: int, echo: tuple[str, list[int], list[int]] | None = None, top: int | None = None
    ):
        self.index = index
        self.text: list[str] = []
        self.token_ids = array("i")
        self.offsets = array("i")  # where each token's text starts in the choice's text
        self.scores = ScoreColumns(top) if top is not None else None
        self.logprob_sum, self.scored = 0.0, 0
        self.finish: str | None = None
        self.echo = echo
        self.prompt_scores: ScoreColumns | None = None  # the echoed prompt's, shared by its samples
        self.base = len(echo[0]) if echo is not None else 0  # the generated text starts here
        self.chars = self.base  # characters of text so far, echo included
        self.echo_sent = False
        self.calls = None  # a tools.ToolCallStream, when a streamed chat answer may call tools

    def add(self, out: RequestOutput) -> None:
        offsets = getattr(out, "text_offsets", None)
        if offsets is not None:  # the engine's: right even when text was held back
            self.offsets.extend([self.base + o for o in offsets])
        else:  # no tokenizer: no text, every offset is where the text is now
            self.offsets.extend([self.chars] * len(out.new_token_ids))
        if out.text_delta:
            self.text.append(out.text_delta)
            self.chars += len(out.text_delta)
        self.token_ids.extend(out.new_token_ids)
        for e in out.logprobs or ():
            self.logprob_sum += e.logprob
            self.scored += 1
        if self.scores is not None and out.logprobs:
            self.scores.extend(out.logprobs)
        self.finish = out.finish_reason

    def sent(self) -> None:
        """Everything held has been streamed: drop it."""
        self.text.clear()
        del self.token_ids[:], self.offsets[:]
        if self.scores is not None:
            self.scores.clear()

    @property
    def mean_logprob(self) -> float:
        """Per generated token: how best_of ranks its samples (OpenAI's 'log probability per token')."""
        return self.logprob_sum / max(self.scored, 1)


class Answer:
    """One request's response, whole (`whole`) or as server-sent event chunks (`chunk`), in
    OpenAI's completion or chat shape, with one `Choice` per answer, `samples` a prompt (choices
    k of one prompt are consecutive). `scores` (a `Scores`) is set when the request asked for
    log-probabilities."""

    def __init__(
        self,
        rid: str,
        model: str,
        chat: bool,
        n_prompt: int,
        with_ids: bool,
        choices: list[Choice] | None = None,
        scores: Scores | None = None,
        samples: int = 1,
    ):
        self.rid, self.model, self.chat, self.n_prompt, self.with_ids = rid, model, chat, n_prompt, with_ids
        self.created = int(time.time())
        self.choices = choices if choices is not None else [Choice(0)]
        self.scores, self.samples = scores, samples
        self.tools = False  # read each answer's text for tool calls (tools.py); set by handlers.run
        self.generated = 0  # tokens every sample made, returned or not (best_of): what was computed

    def add(self, out: RequestOutput, k: int = 0) -> None:
        self.generated += len(out.new_token_ids)
        self.choices[k].add(out)
        if out.prompt_logprobs is not None and self.scores is not None:
            # the prompt is scored once, by its first sample; every sample of it echoes that
            cols = ScoreColumns.of(out.prompt_logprobs, self.scores.top)
            first = k - k % self.samples
            for c in self.choices[first : first + self.samples]:
                c.prompt_scores = cols

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

    def _echo_part(self, c: Choice) -> tuple:
        _, ids, offsets = c.echo
        return c.prompt_scores, ids, offsets

    def _logprobs(self, c: Choice, with_echo: bool):
        """Scores of the tokens c holds, with the echoed prompt's first when with_echo."""
        if self.scores is None:
            return None
        if self.chat:
            return self.scores.chat(c.scores)
        parts = [self._echo_part(c)] if with_echo and c.echo is not None else []
        return self.scores.completion([*parts, (c.scores, c.token_ids, c.offsets)])

    def whole(self, picked: list[Choice] | None = None) -> dict:
        """The whole answer; `picked`: the choices to return, in order (best_of chose them)."""
        out = []
        for index, c in enumerate(picked if picked is not None else self.choices):
            choice: dict[str, Any] = {"index": index, "finish_reason": c.finish}
            text = "".join(c.text)
            if self.chat and self.tools:
                content, calls = parse_tool_calls(text)
                choice["message"] = {"role": "assistant", "content": content}
                if calls:
                    choice["message"]["tool_calls"] = calls
                    if c.finish == "stop":  # OpenAI's: the model stopped to have its calls run
                        choice["finish_reason"] = "tool_calls"
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = (c.echo[0] if c.echo is not None else "") + text
            choice["logprobs"] = self._logprobs(c, with_echo=True)
            if self.with_ids:
                choice["token_ids"] = c.token_ids.tolist()
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
        """A completion's echoed prompt, with its scores, before choice k's first token; the
        choice keeps neither once it is sent."""
        c = self.choices[k]
        logprobs = None
        if self.scores is not None:
            logprobs = self.scores.completion([self._echo_part(c)])
        choice = {"index": k, "text": c.echo[0], "finish_reason": None, "logprobs": logprobs}
        c.echo_sent, c.echo, c.prompt_scores = True, None, None
        return self._event([choice], **({"usage": None} if include_usage else {}))

    def chunk(self, k: int, include_usage: bool = False) -> str:
        """Choice k's text since its last chunk, with the scores and ids of every token since;
        the choice drops them once they are in the chunk. "" when a chat with tools has nothing
        to say yet (its text is held while a call block may be open)."""
        c = self.choices[k]
        delta = "".join(c.text)
        choice: dict[str, Any] = {"index": k, "finish_reason": c.finish}
        if self.chat and self.tools:
            choice["delta"] = self._tool_delta(c, delta)
            if c.finish == "stop" and c.calls.called:
                choice["finish_reason"] = "tool_calls"
        elif self.chat:
            choice["delta"] = {"content": delta} if delta else {}
        else:
            choice["text"] = delta
        choice["logprobs"] = self._logprobs(c, with_echo=False)
        if self.with_ids:
            choice["token_ids"] = c.token_ids.tolist()
        c.sent()
        if self.chat and self.tools and not choice["delta"] and choice["finish_reason"] is None:
            if choice["logprobs"] is None and not self.with_ids:
                return ""  # text held inside a call block: nothing to send yet (vLLM sends nothing too)
        return self._event([choice], **({"usage": None} if include_usage else {}))

    @staticmethod
    def _tool_delta(c: Choice, text: str) -> dict:
        """A chat chunk's delta when tools were offered: the text and the calls whose blocks
        closed since the last chunk (tools.ToolCallStream), merged into one delta."""
        if c.calls is None:
            c.calls = ToolCallStream()
        pieces = c.calls.feed(text) if text else []
        if c.finish is not None:
            pieces += c.calls.finish()
        delta: dict[str, Any] = {}
        for piece in pieces:
            if "content" in piece:
                delta["content"] = delta.get("content", "") + piece["content"]
            delta.setdefault("tool_calls", []).extend(piece.get("tool_calls", []))
        if not delta.get("tool_calls"):
            delta.pop("tool_calls", None)
        return delta

    def usage_chunk(self) -> str:
        return self._event([], usage=self.usage())

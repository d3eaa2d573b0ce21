"""Running one request (days 36-40, 47): from a parsed, tokenized request to its response.

    return await run(state, engine, req, prompt_ids, chat=False, default_max=16)

`run` is what a route calls once the prompt is tokens: it settles `max_tokens` against the
context, turns OpenAI's parameters (and vLLM's sampling fields) into `SamplingParams`, checks
the score budget, fans the request out into one engine sequence per prompt and sample (`n`,
`best_of`), hands them to the engine loop, and then either collects every output into one JSON
answer or streams them as server-sent events. Every refusal before the engine takes the
request is an `APIError` (a 4xx), and either every sample is taken or none is. The sampling
fields' ranges are `SamplingParams.validate`'s, whose error names the field, so the 400 names
it too; the token ids in logit_bias and stop_token_ids are checked there against the model's
vocabulary as well.

The engine thread hands outputs over through a `Handoff`: one buffer per request, shared by its
samples. The engine thread appends, and wakes the handler's event loop only when the buffer was
empty; the handler takes everything buffered at once, and sets a timer (to ask whether the loop
still lives) only when there is nothing to take. So the cost follows what the handler has to
catch up on, not the outputs: a handler that keeps up may still be woken for most outputs (it
has emptied the buffer before the next one lands), and one that is behind (its event loop busy
with other requests) takes a step's outputs, or several steps', in one wake-up
(tests/test_handlers.py counts 8 for 400 outputs in 51 steps).

What this module leaves out: the routes and the prompt's rendering (serve.py), the response
shapes (responses.py), the engine loop itself (loop.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading
import traceback
import uuid
from collections import deque

from fastapi.responses import JSONResponse, Response

from nanoserve.api import (
    MAX_SAMPLES,
    MAX_SCORE_ENTRIES,
    MAX_STOP,
    MAX_STOP_CHARS,
    APIError,
    check_score_budget,
)
from nanoserve.engine import Engine
from nanoserve.grammar import Guided, guided_from_request
from nanoserve.loop import Accepted, Refused
from nanoserve.responses import Answer, Choice, EventStream, Scores, WhenDone
from nanoserve.sampling import InvalidParam, SamplingParams
from nanoserve.status import ServerState

LIVENESS_POLL = 1.0  # seconds a handler waits on its hand-off before asking whether the loop lives


class Handoff:
    """Outputs from the engine thread to one request's handler (see the module doc).

    `put((k, item))` runs on the engine thread; `take()` on the handler's event loop. The
    buffer is a deque under a lock; `wakeups` counts the times the engine thread scheduled
    the handler (at most one while the buffer holds items)."""

    def __init__(self, aio: asyncio.AbstractEventLoop, state: ServerState):
        self.aio, self.state = aio, state
        self.items: deque = deque()
        self.lock = threading.Lock()
        self.ready = asyncio.Event()
        self.wakeups = 0

    def put(self, item) -> None:
        if self.aio.is_closed():  # the handler is gone: the loop ends this request (loop._send)
            raise RuntimeError("the request's event loop is closed")
        with self.lock:
            self.items.append(item)
            if len(self.items) > 1:  # a wake-up is already on its way
                return
            self.wakeups += 1
        self.aio.call_soon_threadsafe(self.ready.set)

    def sink(self, k: int):
        """The callable the engine loop gives sample k's outputs to."""
        return lambda item: self.put((k, item))

    async def take(self) -> list:
        """Everything buffered, [(k, item), ...]; waits if nothing is. If the engine loop died
        meanwhile: [(None, Refused)]."""
        while True:
            with self.lock:
                if self.items:
                    batch = list(self.items)
                    self.items.clear()
                    return batch
                self.ready.clear()  # under the lock: a put after this schedules a new set()
            try:
                await asyncio.wait_for(self.ready.wait(), LIVENESS_POLL)
            except asyncio.TimeoutError:  # noqa: UP041 -- not yet the builtin on Python 3.10
                loop = self.state.loop
                if loop is None or not loop.alive:
                    reason = (loop.failure if loop else None) or "the engine loop is not running"
                    return [(None, Refused(f"the request was aborted: {reason}", 500))]


def sampling_params(
    req, chat: bool, max_tokens: int, best_of: int, echo: bool, vocab: int | None = None
) -> SamplingParams:
    """OpenAI's fields (and vLLM's) as the engine's `SamplingParams`; a value it refuses is a
    400 naming the field. `vocab`: the model's vocabulary size, which the token ids of
    logit_bias and stop_token_ids must lie below (checked here, so the 400 says so before the
    request reaches the engine)."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(
            400,
            f"stop is at most {MAX_STOP} non-empty strings of at most {MAX_STOP_CHARS} characters",
            param="stop",
        )
    if chat:
        wanted = (req.top_logprobs or 0) if req.logprobs else None
    else:
        wanted = req.logprobs
    if wanted is None and best_of > req.n:
        wanted = 0  # best_of ranks its samples by their log-probabilities
    # echo with logprobs scores the prompt; max_tokens 0 asks for nothing else
    prompt_logprobs = req.logprobs if echo and req.logprobs is not None else None
    if max_tokens == 0 and prompt_logprobs is None:
        prompt_logprobs = 0
    try:
        guided = guided_from_request(
            req.response_format, req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar
        )
    except InvalidParam as e:
        raise APIError(400, str(e), param=e.param) from None
    params = SamplingParams(
        guided=guided,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        logit_bias=logit_bias(req.logit_bias),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        min_tokens=req.min_tokens or 0,
        include_stop_str_in_output=req.include_stop_str_in_output,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),
        max_tokens=max_tokens,
        stop=tuple(stop),
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        priority=req.priority,
        logprobs=wanted,
        prompt_logprobs=prompt_logprobs,
    )
    try:
        params.validate(vocab=vocab)
    except ValueError as e:  # an InvalidParam, which names its field
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None
    return params


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, whose keys are token ids written as strings, with int keys; a key
    that is not an integer is a 400 naming the field (one past the vocabulary is refused by
    `SamplingParams.validate`)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        text = key.strip()
        if not (text.isascii() and text.lstrip("-").isdigit()):
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(text)] = value
    return out


def settle_max_tokens(req, prompts: list[list[int]], limit: int, chat: bool, default_max, echo) -> int:
    """The request's max_tokens: given, or the default (16 on completions, the rest of the
    context on chat); a 400 when the prompt leaves no room or the tokens asked do not fit."""
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens and the prompt is {longest} "
            "tokens, which leaves no room to generate; shorten it",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    explicit = bool({"max_tokens", "max_completion_tokens"} & req.model_fields_set)
    max_tokens = req.max_tokens
    if not explicit or max_tokens is None:
        max_tokens = min(default_max or limit, limit - longest)
    if max_tokens < 1 and not (max_tokens == 0 and echo is not None):
        raise APIError(
            400,
            f"max_tokens must be at least 1 (0 only with echo, to score the prompt), got {max_tokens}",
            param="max_tokens",
        )
    if longest + max_tokens > limit:
        raise APIError(
            400,
            f"this model's maximum context length is {limit} tokens; the prompt is {longest} tokens "
            f"and max_tokens asks for {max_tokens} more; lower max_tokens to {limit - longest} or less",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


async def run(
    state: ServerState,
    eng: Engine,
    req,
    prompts: list[list[int]],
    chat: bool,
    default_max,
    echo=None,
    score_budget: int = MAX_SCORE_ENTRIES,
    request_id: str | None = None,
    tools: bool = False,
    guided: Guided | None = None,
):
    """Start one sequence per prompt and sample, and answer them as one response (module doc).
    `echo`: each prompt's (text, ids, offsets) when a completion echoes its prompt. `request_id`:
    the request's X-Request-Id (http_extras.RequestLog); the answer's id is built on it, as vLLM
    builds it, so a client, the access log and the answer name the request alike. `tools`: the
    template wrote the request's tools, so each answer's text is read for tool calls (tools.py);
    `guided`: the grammar tool_choice "required" or a named function imposes, which takes the
    place of a response_format or guided_* (a request with both is refused)."""
    max_tokens = settle_max_tokens(req, prompts, eng.max_model_len, chat, default_max, echo)
    n = req.n
    best_of = getattr(req, "best_of", None) or n
    if len(prompts) * best_of > MAX_SAMPLES:
        raise APIError(
            400,
            f"{len(prompts)} prompts x {best_of} samples is {len(prompts) * best_of} sequences; "
            f"a request may start at most {MAX_SAMPLES}",
            param="best_of" if best_of > n else "n",
        )
    params = sampling_params(req, chat, max_tokens, best_of, echo is not None, eng.model.cfg.vocab_size)
    if guided is not None:
        if params.guided is not None:
            raise APIError(
                400,
                f"tool_choice {req.tool_choice!r} constrains the answer to tool calls; "
                f"drop {params.guided.param} or ask with tool_choice 'auto'",
                param=params.guided.param,
            )
        params.guided = guided
    if params.guided is not None:  # compiled on the grammar thread (cached): the engine's is spared
        try:
            await asyncio.wrap_future(eng.grammars.compile_async(params.guided))
        except InvalidParam as e:
            raise APIError(400, str(e), param=e.param) from None
    asked = bool(req.logprobs) if chat else req.logprobs is not None
    wanted = params.logprobs if asked else None  # what the response shows
    # max_tokens 0 only scores: every sample would be the same, so one runs and is repeated
    samples = 1 if max_tokens == 0 else best_of
    if wanted is not None:
        scored_prompt = sum(map(len, prompts)) if params.prompt_logprobs is not None else 0
        check_score_budget(score_budget, chat, len(prompts), samples, max_tokens, wanted, scored_prompt)

    rid = ("chatcmpl-" if chat else "cmpl-") + (request_id or uuid.uuid4().hex[:24])
    # the engine's ids stay unique when two clients send the same X-Request-Id
    engine_rid = rid if request_id is None else f"{rid}-{uuid.uuid4().hex[:8]}"
    choices, rids = [], []
    for i in range(len(prompts)):
        for j in range(samples):
            choices.append(Choice(len(choices), echo[i] if echo is not None else None, top=wanted))
            rids.append(f"{engine_rid}-{i}-{j}")
    scores = Scores(eng.tokenizer, wanted) if wanted is not None else None
    answer = Answer(
        rid, eng.model_name, chat, sum(map(len, prompts)), req.return_token_ids, choices, scores, samples
    )
    answer.tools = tools

    handoff = Handoff(asyncio.get_running_loop(), state)
    for k, (ids, sample_id) in enumerate(zip([p for p in prompts for _ in range(samples)], rids)):
        j = k % samples
        p = params
        if j:  # sample j: its own seed, and the prompt's scores come from sample 0
            seed = None if params.seed is None else (params.seed + j) % 2**64
            p = dataclasses.replace(params, seed=seed, prompt_logprobs=None)
        after = rids[k - j] if j else None
        state.loop.submit(sample_id, ids, p, handoff.sink(k), after=after)

    def abort_all() -> None:
        for sample_id in rids:
            state.loop.abort(sample_id)

    # every sample is taken, or the request is refused as a whole
    taken, early, refusal = set(), [], None
    while len(taken) < len(rids) and refusal is None:
        for k, item in await handoff.take():
            if isinstance(item, Refused):
                refusal = item
                break
            if isinstance(item, Accepted):
                taken.add(k)
            else:
                early.append((k, item))
    if refusal is not None:
        abort_all()
        raise refusal.error()

    async def items():
        for pair in early:
            yield pair
        early.clear()
        while True:
            batch = await handoff.take()
            for i, pair in enumerate(batch):
                if i:  # let the loop run between a batch's items, as it did when each came alone:
                    await asyncio.sleep(0)  # a client that hung up is noticed before the next write
                yield pair

    if not req.stream:

        async def collect() -> Response:
            done = 0
            async for k, item in items():
                if isinstance(item, Refused):
                    abort_all()
                    return item.error().response()
                if item.finish_reason == "error":
                    abort_all()
                    return APIError(500, item.error, type="server_error").response()
                answer.add(item, k)
                done += item.finished
                if done == len(rids):
                    break
            if samples < n:  # max_tokens 0: the one scoring run, n times
                picked = [c for c in choices for _ in range(n)]
            else:
                picked = []
                for i in range(len(prompts)):
                    group = choices[i * samples : (i + 1) * samples]
                    picked += sorted(group, key=lambda c: -c.mean_logprob)[:n] if samples > n else group
            return JSONResponse(answer.whole(picked))

        return WhenDone(collect, on_disconnect=abort_all)

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def events():
        finished: set[int] = set()
        try:
            if chat:
                for k in range(len(rids)):
                    yield answer.role_chunk(k, include_usage)
            async for k, item in items():
                if isinstance(item, Refused) or item.finish_reason == "error":
                    error = (
                        item.error()
                        if isinstance(item, Refused)
                        else APIError(500, item.error, type="server_error")
                    )
                    yield f"data: {json.dumps(error.body())}\n\n"
                    break
                answer.add(item, k)
                c = choices[k]
                if c.echo is not None and not c.echo_sent:
                    yield answer.echo_chunk(k, include_usage)
                if item.finished:
                    finished.add(k)
                # else no whole character yet, or held by a stop; an engine without a
                # tokenizer has no text (nor stop strings), so its tokens go out as they come
                if item.text_delta or item.finished or (eng.tokenizer is None and item.new_token_ids):
                    event = answer.chunk(k, include_usage)
                    if event:
                        yield event
                if len(finished) == len(rids):
                    if include_usage:
                        yield answer.usage_chunk()
                    break
            yield "data: [DONE]\n\n"
        except Exception:  # a bug while streaming: the status is sent, so say it in the stream
            traceback.print_exc(file=sys.stderr)
            error = APIError(500, "the server failed while streaming this answer", type="server_error")
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:
            if len(finished) < len(rids):
                abort_all()  # the client went away, or one sample failed: free every block now

    return EventStream(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )

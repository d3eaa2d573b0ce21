"""The server (days 35-47, 56): an OpenAI-compatible HTTP API around one engine.

    app = create_app(engine)                                  # an Engine, built and warmed
    app = create_app(lambda on_phase: build_engine(config, on_phase), address="127.0.0.1:8000")

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both streaming as server-sent
events when `stream` is true), `GET /v1/models`, `GET /health`, `GET /metrics`. This module
holds the routes and the process around them; the pieces they stand on are modules of their own:
the request schema and error object (`api.py`), the engine loop that owns the engine
(`loop.py`), the metrics (`metrics.py`) and the two responses that notice a client leaving
(`responses.py`).

A handler checks the request, renders and tokenizes its prompt on a worker thread (so one huge
prompt never stalls other streams or `/health`), puts it in the loop's inbox and reads its own
queue. Bad input never reaches the engine: it gets an OpenAI error object and a 4xx, and
requests in flight are not touched. A body larger than `max_body_bytes` is refused with 413
before it is read, and a prompt whose characters cannot fit the context is refused before it is
tokenized.

`/health` is the server's state: 503 "loading" / "warming" while a builder runs (day 56: the
door opens after the warm-up), 200 with the pool and the warm plan when ready, 503 "draining"
during a graceful shutdown, 503 "failed" with the reason when the build failed or the engine
loop died. `serve()` runs it under uvicorn and drains on SIGTERM or SIGINT: new requests get
503 with Retry-After, requests in flight run to the end for up to `drain_timeout` seconds,
what is left then ends with an error event, and the process exits 0. A second signal stops at
once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Callable

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.api import (
    MAX_SAMPLES,
    MAX_STOP,
    MAX_STOP_CHARS,
    APIError,
    BodyLimit,
    ChatRequest,
    CompletionRequest,
    check_supported,
    validation_message,
)
from nanoserve.engine import Engine
from nanoserve.errors import NanoserveError
from nanoserve.loop import Accepted, EngineLoop, Refused
from nanoserve.metrics import Metrics
from nanoserve.quant import WEIGHTS, describe_weights
from nanoserve.responses import Answer, Choice, EventStream, Scores, WhenDone
from nanoserve.sampling import SamplingParams

MAX_BODY_BYTES = 4 * 2**20  # the default request-body cap: far above any prompt a context holds
LIVENESS_POLL = 1.0  # seconds a handler waits on its queue before asking whether the loop lives


class ServerState:
    def __init__(self):
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.phase = "loading"  # loading | warming | ready | draining | failed
        self.error: str | None = None
        self.created = int(time.time())

    def fail(self, reason: str) -> None:
        self.phase, self.error = "failed", reason


def pool_dict(engine: Engine) -> dict:
    plan = engine.pool
    return dataclasses.asdict(plan) | {"num_slots": plan.num_slots, "describe": plan.describe()}


def paths_dict(engine: Engine) -> dict:
    """What the weights are and which way each part of a step runs (engine.paths_line)."""
    from nanoserve.model import model_weight_bytes

    model = engine.model
    quantized = model.weights in WEIGHTS
    return {
        "weights": model.weights,
        "activations": model.head.activations if quantized else model.weights,
        "weight_bytes": model_weight_bytes(model),
        "linears": engine.linear,
        "decode_step": engine.decode_step,
        # the fused step is one native call for any batch shape: nothing is compiled or recorded
        # per shape, so it adds nothing to the warm list
        "decode_step_setup_s": 0.0,
        "decode_attention": engine.cache.attention,
    }


def tp_dict(engine: Engine) -> dict:
    """Under tensor parallelism: the rank count and each rank's share (tp.py); else nothing."""
    tp = getattr(engine.model, "tp", None)
    return {} if tp is None else {"tensor_parallel": tp.as_dict()}


def warm_dict(engine: Engine) -> dict | None:
    """The warm plan as /health reports it, with what recorded graphs hold now."""
    runner = engine.runner
    if not runner.capture:
        return None
    report = engine.warm_report.as_dict() if engine.warm_report is not None else {}
    return report | {
        "recording": "lazy" if runner.lazy else "warm list only",
        "graphs_now": len(runner.graphs),
        "graph_bytes": runner.graph_bytes,
        "graph_budget_bytes": runner.graph_budget,
        "eager_steps": runner.eager_steps,
    }


def boot_line(engine: Engine, address: str | None = None) -> str:
    """One line: model, dtype, device, pool, warm list, and where it listens."""
    p, w = engine.pool, engine.warm_report
    warm = f"{w.graphs} graphs in {w.seconds:.2f} s, {w.bytes / 1e6:.1f} MB" if w else "none"
    where = f" · listening on http://{address}" if address else ""
    if engine.model.weights in WEIGHTS or engine.decode_step == "fused":
        # the fused step has no per-shape setup (nothing compiled or recorded): 0 s at boot
        where = f" · weights {describe_weights(engine.model)} · decode step {engine.decode_step}" + where
    tp = getattr(engine.model, "tp", None)
    if tp is not None:
        where = f" · tensor parallel {tp.world} ranks ({tp.backend})" + where
    pool_mb = p.num_blocks * p.bytes_per_block / 1e6
    return (
        f"nanoserve: {engine.model_name} · {p.dtype} on {engine.model.device.type} · KV pool "
        f"{p.num_blocks} blocks x {p.block_size} = {p.num_slots:,} tokens, {pool_mb:.1f} MB"
        f" · warm list {warm}{where}"
    )


def create_app(
    engine: Engine | Callable[[Callable[[str], None]], Engine],
    *,
    api_key: str | None = None,
    address: str | None = None,
    max_waiting: int = 1024,
    max_body_bytes: int = MAX_BODY_BYTES,
    on_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """The FastAPI app. `engine` is a built Engine or a builder `f(on_phase) -> Engine` run in a
    background thread at startup (`/health` is 503 until it returns; if it raises, /health says
    "failed" with the reason and `on_failure(reason)` is called)."""
    state = ServerState()
    metrics = Metrics(state)

    def ready(eng: Engine) -> None:
        state.engine = eng
        state.loop = EngineLoop(eng, metrics, max_waiting, on_death=state.fail)
        state.loop.start()
        print(boot_line(eng, address), file=sys.stderr, flush=True)
        state.phase = "ready"  # after the boot line: whoever sees 200 can also read the line

    def build() -> None:
        try:
            ready(engine(lambda phase: setattr(state, "phase", phase)))
        except Exception as e:  # reported by /health and on stderr; the process keeps answering
            state.fail(f"{type(e).__name__}: {e}")
            print(f"nanoserve: error: the engine failed to start: {e}", file=sys.stderr, flush=True)
            if on_failure is not None:
                on_failure(state.error)

    async def lifespan(app: FastAPI):
        if isinstance(engine, Engine):
            ready(engine)
        else:
            app.state.build_thread = threading.Thread(target=build, name="nanoserve-build", daemon=True)
            app.state.build_thread.start()
        yield
        if state.loop is not None:
            state.loop.stop()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.nanoserve = state
    app.state.metrics = metrics
    app.state.build_thread = None
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"there is no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.url.path} does not accept {request.method}"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message, code=exc.status_code).response()

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise APIError(
                401, "a valid API key is required: send 'Authorization: Bearer <key>'", code="invalid_api_key"
            )

    def serving_engine() -> Engine:
        if state.phase == "draining":
            raise APIError(
                503,
                "the server is shutting down and takes no new requests; retry against another replica",
                type="service_unavailable",
                headers={"Retry-After": "5"},
            )
        if state.phase != "ready":
            why = state.error or f"the model is {state.phase}; try again when /health says ok"
            raise APIError(503, why, type="service_unavailable")
        return state.engine

    @app.get("/health")
    async def health():
        eng = state.engine
        if state.phase != "ready":
            body = {"status": state.phase, "error": state.error}
            if state.phase == "draining" and state.loop is not None:
                body["in_flight"] = state.loop.in_flight
            return JSONResponse(body, status_code=503)
        return {
            "status": "ok",
            "model": eng.model_name,
            "max_model_len": eng.max_model_len,
            "pool": pool_dict(eng),
            "warm": warm_dict(eng),
            "paths": paths_dict(eng),
            "running": len(eng.scheduler.running),
            "waiting": len(eng.scheduler.waiting),
            "kv_blocks_used": eng.allocator.num_used,
        } | tp_dict(eng)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        eng = serving_engine()
        card = {
            "id": eng.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "nanoserve",
            "max_model_len": eng.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(req: CompletionRequest, request: Request):
        eng = serving_engine()
        check_model(eng, req.model)
        check_supported(req)
        prompt = req.prompt
        several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        prompts = list(prompt) if several else [prompt]
        for p in prompts:
            if isinstance(p, str) and not p:
                raise APIError(400, "the prompt is empty", param="prompt")
        check_fits(eng, max((len(p) for p in prompts if isinstance(p, str)), default=0), "prompt")
        prompt_ids = await encode_all(eng, prompts, "prompt")
        echo = None
        if req.echo:
            echo = await anyio.to_thread.run_sync(echo_texts, eng, prompts, prompt_ids)
        return await run(eng, req, prompt_ids, chat=False, default_max=16, echo=echo)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(req: ChatRequest, request: Request):
        eng = serving_engine()
        check_model(eng, req.model)
        check_supported(req)
        messages = []
        for m in req.messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        check_fits(eng, sum(len(m["content"]) for m in messages), "messages")
        prompt_ids = await encode_all(eng, [messages], "messages")
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        return await run(eng, req, prompt_ids, chat=True, default_max=None)

    def check_model(eng: Engine, name: str | None) -> None:
        if name is not None and name != eng.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist here; this server serves '{eng.model_name}'",
                param="model",
                code="model_not_found",
            )

    def check_fits(eng: Engine, chars: int, param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit the context whatever its tokens."""
        tok = eng.tokenizer
        if tok is None or chars <= eng.max_model_len * tok.max_token_chars:
            return
        raise APIError(
            400,
            f"the {param} is {chars:,} characters; no token of this model stands for more than "
            f"{tok.max_token_chars}, so it cannot fit the context of {eng.max_model_len} tokens; shorten it",
            param=param,
            code="context_length_exceeded",
        )

    async def encode_all(eng: Engine, prompts: list, param: str) -> list[list[int]]:
        """Render and tokenize on a worker thread: the event loop keeps serving meanwhile."""

        def work() -> list[list[int]]:
            out = []
            for i, prompt in enumerate(prompts):
                where = f" (prompt {i})" if len(prompts) > 1 else ""
                try:
                    ids = eng.encode_prompt(prompt)
                except (ValueError, NanoserveError) as e:
                    raise APIError(400, f"{e}{where}", param=param) from None
                if not ids:
                    raise APIError(400, f"the prompt is empty{where}", param=param)
                out.append(ids)
            return out

        return await anyio.to_thread.run_sync(work)

    def echo_texts(eng: Engine, prompts: list, prompt_ids: list[list[int]]) -> list[tuple]:
        """Each prompt as echo returns it: its text, its token ids, and where each token's text
        starts (through the streaming detokenizer, so offsets agree with the text)."""
        out = []
        for prompt, ids in zip(prompts, prompt_ids):
            if eng.tokenizer is None:
                out.append(("", ids, [0] * len(ids)))
                continue
            detok, offsets = eng.tokenizer.detokenizer(), []
            for t in ids:
                offsets.append(len(detok.text))
                detok.add(t)
            detok.flush()
            out.append((prompt if isinstance(prompt, str) else detok.text, ids, offsets))
        return out

    async def next_item(q: asyncio.Queue):
        """The next (sample, item) on a handler's queue; a Refused if the loop died meanwhile."""
        while True:
            try:
                return await asyncio.wait_for(q.get(), LIVENESS_POLL)
            except asyncio.TimeoutError:  # noqa: UP041 -- not yet the builtin on Python 3.10
                loop = state.loop
                if loop is None or not loop.alive:
                    reason = (loop.failure if loop else None) or "the engine loop is not running"
                    return None, Refused(f"the request was aborted: {reason}", 500)

    def sampling_params(req, chat: bool, max_tokens: int, best_of: int, echo: bool) -> SamplingParams:
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
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            max_tokens=max_tokens,
            stop=tuple(stop),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            logprobs=wanted,
            prompt_logprobs=prompt_logprobs,
        )
        try:
            params.validate()
        except ValueError as e:
            field = next((f for f in ("seed", "temperature", "top_p", "top_k") if f in str(e)), None)
            raise APIError(400, str(e), param=field) from None
        return params

    async def run(eng: Engine, req, prompts: list[list[int]], chat: bool, default_max, echo=None):
        limit, longest = eng.max_model_len, max(len(p) for p in prompts)
        param = "messages" if chat else "prompt"
        if longest >= limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens and the prompt is {longest} "
                "tokens, which leaves no room to generate; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        explicit = bool({"max_tokens", "max_completion_tokens"} & req.model_fields_set)
        max_tokens = req.max_tokens
        if not explicit or max_tokens is None:  # the default: 16 (completions) or the rest of the context
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
        n = req.n
        best_of = getattr(req, "best_of", None) or n
        if len(prompts) * best_of > MAX_SAMPLES:
            raise APIError(
                400,
                f"{len(prompts)} prompts x {best_of} samples is {len(prompts) * best_of} sequences; "
                f"a request may start at most {MAX_SAMPLES}",
                param="best_of" if best_of > n else "n",
            )
        params = sampling_params(req, chat, max_tokens, best_of, echo is not None)
        asked = bool(req.logprobs) if chat else req.logprobs is not None
        wanted = params.logprobs if asked else None  # what the response shows
        # max_tokens 0 only scores: every sample would be the same, so one runs and is repeated
        samples = 1 if max_tokens == 0 else best_of

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        choices, rids = [], []
        for i, ids in enumerate(prompts):
            for j in range(samples):
                choices.append(Choice(len(choices), len(ids), echo[i] if echo is not None else None))
                rids.append(f"{rid}-{i}-{j}")
        scores = Scores(eng.tokenizer, wanted) if wanted is not None else None
        answer = Answer(
            rid, eng.model_name, chat, sum(map(len, prompts)), req.return_token_ids, choices, scores
        )

        aio = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        for k, (ids, sample_id) in enumerate(zip([p for p in prompts for _ in range(samples)], rids)):
            j = k % samples
            p = params
            if j:  # sample j: its own seed, and the prompt's scores come from sample 0
                seed = None if params.seed is None else (params.seed + j) % 2**64
                p = dataclasses.replace(params, seed=seed, prompt_logprobs=None)
            after = rids[k - j] if j else None
            sink = lambda item, k=k: aio.call_soon_threadsafe(q.put_nowait, (k, item))  # noqa: E731
            state.loop.submit(sample_id, ids, p, sink, after=after)

        def abort_all() -> None:
            for sample_id in rids:
                state.loop.abort(sample_id)

        # every sample is taken, or the request is refused as a whole
        taken, early, refusal = set(), [], None
        while len(taken) < len(rids) and refusal is None:
            k, item = await next_item(q)
            if isinstance(item, Refused):
                refusal = item
            elif isinstance(item, Accepted):
                taken.add(k)
            else:
                early.append((k, item))
        if refusal is not None:
            abort_all()
            raise refusal.error()

        def prompt_scores(k: int, item) -> None:
            """A sample other than the first of its prompt gets the first one's prompt scores."""
            if item.prompt_logprobs is not None:
                for c in choices[k - k % samples : k - k % samples + samples]:
                    c.prompt_entries = item.prompt_logprobs

        async def items():
            for pair in early:
                yield pair
            while True:
                yield await next_item(q)

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
                    prompt_scores(k, item)
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
                    prompt_scores(k, item)
                    c = choices[k]
                    if c.echo is not None and not c.echo_sent:
                        yield answer.echo_chunk(k, include_usage)
                    if item.finished:
                        finished.add(k)
                    # else no whole character yet, or held by a stop; an engine without a
                    # tokenizer has no text (nor stop strings), so its tokens go out as they come
                    if item.text_delta or item.finished or (eng.tokenizer is None and item.new_token_ids):
                        yield answer.chunk(k, item.text_delta, item.finish_reason, include_usage)
                    if len(finished) == len(rids):
                        if include_usage:
                            yield answer.usage_chunk()
                        break
                yield "data: [DONE]\n\n"
            finally:
                if len(finished) < len(rids):
                    abort_all()  # the client went away, or one sample failed: free every block now

        return EventStream(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app


# --- running it ---------------------------------------------------------------------------------


def drain(state: ServerState, timeout: float) -> int:
    """A graceful stop's first half: refuse new work, let what is in flight finish for up to
    `timeout` seconds, then end the rest with an error. Returns how many were cut."""
    loop = state.loop
    if loop is None or state.phase != "ready":
        return 0  # still loading or warming, or failed: nothing was admitted
    state.phase = "draining"
    loop.accepting = False
    deadline = time.monotonic() + timeout
    while loop.in_flight and loop.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    left = loop.in_flight
    if left and loop.alive:
        loop.cut(f"the server shut down before this request finished (the drain timeout is {timeout:g} s)")
        deadline = time.monotonic() + 5
        while loop.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
    return left


def _draining_server(config, state: ServerState, drain_timeout: float):
    """A uvicorn server whose first SIGTERM/SIGINT drains (`drain`) and then exits; a second
    stops at once. The signal is not re-raised afterwards, so a drained process exits 0."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        drainer: threading.Thread | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.drainer is not None:  # a second signal: stop now
                if state.loop is not None:
                    state.loop.cut("the server was stopped before this request finished")
                self.should_exit = True
                return
            if state.phase != "ready":
                print(f"nanoserve: stopping (the engine was {state.phase})", file=sys.stderr, flush=True)
                self.should_exit = True
                return
            print(
                f"nanoserve: draining {state.loop.in_flight} request(s), up to {drain_timeout:g} s; "
                "signal again to stop now",
                file=sys.stderr,
                flush=True,
            )
            self.drainer = threading.Thread(target=self._drain, name="nanoserve-drain", daemon=True)
            self.drainer.start()

        def _drain(self) -> None:
            cut = drain(state, drain_timeout)
            if cut:
                print(f"nanoserve: {cut} request(s) cut at the drain timeout", file=sys.stderr, flush=True)
            self.should_exit = True

    return DrainingServer(config)


def serve(
    config,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_waiting: int = 1024,
    max_body_bytes: int = MAX_BODY_BYTES,
    drain_timeout: float = 30.0,
    log_level: str = "warning",
) -> None:
    """Build, warm and serve until a signal (the CLI's `nanoserve serve`). Mistakes that can be
    found before listening (a bad model directory, a port in use) raise NanoserveError; an engine
    that fails to build after the socket is open stops the server, also as a NanoserveError."""
    import socket

    import uvicorn

    from nanoserve.engine import build_engine
    from nanoserve.weights import resolve_model_dir

    config.validate()
    resolve_model_dir(config.model)  # fetch (first run) or check the directory before listening
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError as e:
            raise NanoserveError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    failed: list[str] = []

    def on_failure(reason: str) -> None:
        failed.append(reason)
        server.should_exit = True

    app = create_app(
        lambda on_phase: build_engine(config, on_phase),
        api_key=api_key,
        address=f"{host}:{port}",
        max_waiting=max_waiting,
        max_body_bytes=max_body_bytes,
        on_failure=on_failure,
    )
    uv_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = _draining_server(uv_config, app.state.nanoserve, drain_timeout)
    print(
        f"nanoserve: loading and warming; http://{host}:{port}/health says 503 until ready",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    if failed:
        raise NanoserveError(f"the engine failed to start ({failed[0]})")
    builder = app.state.build_thread
    if builder is not None and builder.is_alive():
        # stopped while loading or warming: the build thread is inside torch, and letting the
        # interpreter finalize under it aborts the process; nothing was admitted, so leave now
        sys.stderr.flush()
        os._exit(0)

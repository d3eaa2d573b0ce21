"""The server (days 35-47, 56): an OpenAI-compatible HTTP API around one engine.

    app = create_app(engine)                                  # an Engine, built and warmed
    app = create_app(lambda on_phase: build_engine(config, on_phase), address="127.0.0.1:8000")

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both streaming as server-sent
events when `stream` is true), `GET /v1/models`, `GET /health` (503 while the model loads and
warms, then 200 with the KV pool plan and the warm list next to it), `GET /metrics`
(Prometheus text). The request schema and the error object are in `api.py`.

The engine is not thread-safe and does not need to be: one thread, `EngineLoop`, owns it and
steps it whenever it has work (day 47). A request handler only tokenizes, validates, puts the
request in the loop's inbox and reads its own queue of `RequestOutput`s; the loop hands each
step's outputs to the handlers' asyncio queues with `call_soon_threadsafe`. A client that goes
away is an `abort` in the same inbox, so its blocks and its slot-table row are free after the
loop's next turn. Bad input never reaches the engine: it is answered with an OpenAI-style error
object and a 4xx, and requests in flight are not touched.

When `create_app` is given a builder instead of an engine, the app starts listening at once and
builds in a background thread, so `/health` can say 503 "loading" / "warming" while it happens;
the generation routes answer 503 until the warm list is recorded (day 56: the door opens after
the warm-up, not before). The boot line is printed when the engine is ready.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import secrets
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve.api import (
    APIError,
    ChatRequest,
    CompletionRequest,
    check_supported,
    validation_message,
)
from nanoserve.engine import Engine, RequestOutput
from nanoserve.errors import NanoserveError
from nanoserve.sampling import SamplingParams

# --- the engine loop (day 47) --------------------------------------------------------------------


@dataclasses.dataclass
class _Stream:
    sink: Callable[[Any], None]  # thread-safe: puts an item on the handler's asyncio queue
    arrival: float
    prompt_tokens: int
    last: float | None = None  # when its previous token came out
    generated: int = 0


class Accepted:
    """The first item on a handler's queue when the engine took its request."""


@dataclasses.dataclass
class Refused:
    """The engine loop's answer when it cannot take or finish a request."""

    message: str
    status: int = 400

    def error(self) -> APIError:
        kind = "server_busy" if self.status == 429 else "server_error" if self.status >= 500 else None
        return APIError(self.status, self.message, type=kind or "invalid_request_error")


class EngineLoop:
    """Owns the engine: drains the inbox (adds and aborts), steps, hands out the outputs."""

    def __init__(self, engine: Engine, metrics: Metrics | None = None, max_waiting: int = 1024):
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, _Stream] = {}
        self.steps = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="nanoserve-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.inbox.put(("wake",))
        self.thread.join(timeout=30)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, sink) -> None:
        self.inbox.put(("add", request_id, prompt_ids, params, sink, time.perf_counter()))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def _handle(self, item) -> None:
        if item[0] == "add":
            _, rid, prompt_ids, params, sink, arrival = item
            if len(self.engine.scheduler.waiting) >= self.max_waiting:
                sink(Refused(f"the server has {self.max_waiting} requests waiting; try again later", 429))
                return
            try:
                self.engine.add_request(prompt_ids, params, request_id=rid)
            except (ValueError, NanoserveError) as e:
                sink(Refused(str(e)))
                return
            self.streams[rid] = _Stream(sink, arrival, len(prompt_ids))
            sink(Accepted())
        elif item[0] == "abort":
            stream = self.streams.pop(item[1], None)
            if stream is not None and self.engine.abort(item[1]):
                stream.sink(RequestOutput(item[1], [], finish_reason="abort"))
                if self.metrics:
                    self.metrics.finished(stream, "abort")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                block = not self.engine.has_unfinished()
                item = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
                self._handle(item)
                while True:  # everything else that arrived, before the next step
                    self._handle(self.inbox.get_nowait())
            except queue.Empty:
                pass
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                outs = self.engine.step()
            except Exception:  # a bug, not a bad request: end what is in flight, keep serving
                traceback.print_exc(file=sys.stderr)
                self._fail_all("the engine failed on this step; the request was aborted")
                continue
            self.steps += 1
            now = time.perf_counter()
            for out in outs:
                stream = self.streams.get(out.request_id)
                if stream is None:
                    continue
                if self.metrics:
                    self.metrics.token(stream, now)
                stream.generated += len(out.new_token_ids)
                stream.last = now
                stream.sink(out)
                if out.finished:
                    del self.streams[out.request_id]
                    if self.metrics:
                        self.metrics.finished(stream, out.finish_reason)
        self._fail_all("the server is shutting down; the request was aborted")

    def _fail_all(self, message: str) -> None:
        for rid, stream in list(self.streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                traceback.print_exc(file=sys.stderr)
            stream.sink(Refused(message, 500))
        self.streams.clear()


# --- metrics ------------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics in the app's own registry: histograms and counters the loop updates,
    plus the engine's state (running, waiting, blocks, preemptions, graphs) read at scrape."""

    def __init__(self, state: ServerState):
        self.registry = CollectorRegistry()
        self.state = state
        r = self.registry
        latency_buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
        self.ttft = Histogram(
            "nanoserve_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            buckets=latency_buckets,
            registry=r,
        )
        self.itl = Histogram(
            "nanoserve_inter_token_latency_seconds",
            "Time between two consecutive tokens of one request.",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5),
            registry=r,
        )
        self.e2e = Histogram(
            "nanoserve_e2e_request_latency_seconds",
            "Time from a request's arrival to its last token.",
            buckets=latency_buckets,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "nanoserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter("nanoserve_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "nanoserve_requests", "Requests that ended, by finish reason.", ["finish_reason"], registry=r
        )
        r.register(_EngineCollector(state))

    def token(self, stream: _Stream, now: float) -> None:
        if stream.last is None:
            self.ttft.observe(now - stream.arrival)
        else:
            self.itl.observe(now - stream.last)
        self.generation_tokens.inc()

    def finished(self, stream: _Stream, reason: str) -> None:
        self.e2e.observe(time.perf_counter() - stream.arrival)
        self.prompt_tokens.inc(stream.prompt_tokens)
        self.requests.labels(finish_reason=reason).inc()


class _EngineCollector:
    def __init__(self, state: ServerState):
        self.state = state

    def collect(self):
        engine = self.state.engine
        if engine is None:
            return
        sched, alloc = engine.scheduler, engine.allocator
        values = [
            ("nanoserve_requests_running", "Requests in the running set.", len(sched.running)),
            ("nanoserve_requests_waiting", "Requests waiting for admission.", len(sched.waiting)),
            ("nanoserve_kv_blocks_used", "KV blocks held by requests.", alloc.num_used),
            ("nanoserve_kv_blocks_total", "KV blocks in the pool.", alloc.num_blocks),
            ("nanoserve_warm_graphs", "Graphs recorded by the warm-up.", _warm(engine).get("graphs", 0)),
            ("nanoserve_graphs", "Decode graphs recorded in all.", len(engine.runner.graphs)),
        ]
        for name, doc, value in values:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("nanoserve_preemptions", "Requests preempted.", value=sched.num_preemptions)
        yield CounterMetricFamily(
            "nanoserve_cold_captures", "Graphs recorded mid-run.", value=engine.runner.cold_captures
        )


def _warm(engine: Engine) -> dict:
    return engine.warm_report.as_dict() if engine.warm_report is not None else {}


# --- the app ------------------------------------------------------------------------------------


class ServerState:
    def __init__(self):
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.phase = "loading"  # loading | warming | ready | failed
        self.error: str | None = None
        self.created = int(time.time())


def pool_dict(engine: Engine) -> dict:
    plan = engine.pool
    return dataclasses.asdict(plan) | {"num_slots": plan.num_slots, "describe": plan.describe()}


def boot_line(engine: Engine, address: str | None = None) -> str:
    """One line: model, dtype, device, pool, warm list, and where it listens."""
    p, w = engine.pool, engine.warm_report
    warm = f"{w.graphs} graphs in {w.seconds:.2f} s, {w.bytes / 1e6:.1f} MB" if w else "none"
    where = f" · listening on http://{address}" if address else ""
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
    on_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """The FastAPI app. `engine` is a built Engine or a builder `f(on_phase) -> Engine` run in a
    background thread at startup (`/health` is 503 until it returns; if it raises, /health says
    "failed" with the reason and `on_failure(reason)` is called)."""
    state = ServerState()
    metrics = Metrics(state)

    def ready(eng: Engine) -> None:
        state.engine = eng
        state.loop = EngineLoop(eng, metrics, max_waiting)
        state.loop.start()
        print(boot_line(eng, address), file=sys.stderr, flush=True)
        state.phase = "ready"  # after the boot line: whoever sees 200 can also read the line

    def build() -> None:
        try:
            ready(engine(lambda phase: setattr(state, "phase", phase)))
        except Exception as e:  # reported by /health and on stderr; the process keeps answering
            state.phase, state.error = "failed", f"{type(e).__name__}: {e}"
            print(f"nanoserve: error: the engine failed to start: {e}", file=sys.stderr, flush=True)
            if on_failure is not None:
                on_failure(state.error)

    async def lifespan(app: FastAPI):
        if isinstance(engine, Engine):
            ready(engine)
        else:
            threading.Thread(target=build, name="nanoserve-build", daemon=True).start()
        yield
        if state.loop is not None:
            state.loop.stop()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.nanoserve = state
    app.state.metrics = metrics

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
        if state.phase != "ready":
            why = state.error or f"the model is {state.phase}; try again when /health says ok"
            raise APIError(503, why, type="service_unavailable")
        return state.engine

    @app.get("/health")
    async def health():
        eng = state.engine
        if state.phase != "ready":
            body = {"status": state.phase, "error": state.error}
            return JSONResponse(body, status_code=503)
        return {
            "status": "ok",
            "model": eng.model_name,
            "max_model_len": eng.max_model_len,
            "pool": pool_dict(eng),
            "warm": _warm(eng) or None,
            "running": len(eng.scheduler.running),
            "waiting": len(eng.scheduler.waiting),
            "kv_blocks_used": eng.allocator.num_used,
        }

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
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(
                    400, "send one prompt per request (a list of several is not supported)", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        prompt_ids = _encode(eng, prompt)
        return await _run(eng, req, request, prompt_ids, chat=False, default_max=16)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(req: ChatRequest, request: Request):
        eng = serving_engine()
        check_model(eng, req.model)
        check_supported(req)
        messages = []
        for m in req.messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        prompt_ids = _encode(eng, messages)
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        return await _run(eng, req, request, prompt_ids, chat=True, default_max=None)

    def check_model(eng: Engine, name: str | None) -> None:
        if name is not None and name != eng.model_name:
            raise APIError(
                404,
                f"the model '{name}' does not exist here; this server serves '{eng.model_name}'",
                param="model",
                code="model_not_found",
            )

    def _encode(eng: Engine, prompt) -> list[int]:
        try:
            ids = eng.encode_prompt(prompt)
        except (ValueError, NanoserveError) as e:
            raise APIError(400, str(e), param="prompt") from None
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        return ids

    async def _run(eng: Engine, req, request: Request, prompt_ids, chat: bool, default_max):
        n_prompt, limit = len(prompt_ids), eng.max_model_len
        if n_prompt >= limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens and the prompt is {n_prompt} "
                "tokens, which leaves no room to generate; shorten it",
                param="messages" if chat else "prompt",
                code="context_length_exceeded",
            )
        explicit = bool({"max_tokens", "max_completion_tokens"} & req.model_fields_set)
        max_tokens = req.max_tokens
        if not explicit or max_tokens is None:  # the default: 16 (completions) or the rest of the context
            max_tokens = min(default_max or limit, limit - n_prompt)
        if max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
        if n_prompt + max_tokens > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens; the prompt is {n_prompt} tokens "
                f"and max_tokens asks for {max_tokens} more; lower max_tokens to {limit - n_prompt} or less",
                param="max_tokens",
                code="context_length_exceeded",
            )
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise APIError(400, "stop is at most 4 non-empty strings", param="stop")
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0),
            max_tokens=max_tokens,
            stop=tuple(stop),
            seed=req.seed,
            ignore_eos=req.ignore_eos,
        )
        try:
            params.validate()
        except ValueError as e:
            raise APIError(400, str(e)) from None

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        aio = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        state.loop.submit(rid, prompt_ids, params, lambda item: aio.call_soon_threadsafe(q.put_nowait, item))
        first = await q.get()
        if isinstance(first, Refused):
            raise first.error()
        created, model = int(time.time()), eng.model_name
        obj = "chat.completion" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def usage(n_out: int) -> dict:
            return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

        if not req.stream:

            async def collect() -> JSONResponse:
                text, token_ids, finish = [], [], None
                while finish is None:
                    item = await q.get()
                    if isinstance(item, Refused):
                        return item.error().response()
                    text.append(item.text_delta)
                    token_ids.extend(item.new_token_ids)
                    finish = item.finish_reason
                choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
                if chat:
                    choice["message"] = {"role": "assistant", "content": "".join(text)}
                else:
                    choice["text"] = "".join(text)
                if req.return_token_ids:
                    choice["token_ids"] = token_ids
                body = {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage(len(token_ids)),
                }
                return JSONResponse(body)

            return WhenDone(collect, on_disconnect=lambda: state.loop.abort(rid))

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list, **extra) -> str:
            body = {"id": rid, "object": chunk_obj, "created": created, "model": model, "choices": choices}
            return f"data: {json.dumps(body | extra, ensure_ascii=False)}\n\n"

        async def events():
            finished, n_out = False, 0
            try:
                if chat:
                    yield event(
                        [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "finish_reason": None,
                                "logprobs": None,
                            }
                        ]
                    )
                while not finished:
                    item = await q.get()
                    if isinstance(item, Refused):
                        yield f"data: {json.dumps(item.error().body())}\n\n"
                        finished = True
                        break
                    n_out += len(item.new_token_ids)
                    finished = item.finished
                    if not item.text_delta and not finished:
                        continue  # a token that completes no character yet (or is held by a stop)
                    choice: dict[str, Any] = {"index": 0, "finish_reason": item.finish_reason}
                    choice["logprobs"] = None
                    if chat:
                        choice["delta"] = {"content": item.text_delta} if item.text_delta else {}
                    else:
                        choice["text"] = item.text_delta
                    if req.return_token_ids:
                        choice["token_ids"] = item.new_token_ids
                    yield event([choice], **({"usage": None} if include_usage else {}))
                if include_usage:
                    yield event([], usage=usage(n_out))
                yield "data: [DONE]\n\n"
            finally:
                if not finished:
                    state.loop.abort(rid)  # the client went away: free its blocks and row now

        return EventStream(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    return app


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


# --- running it ---------------------------------------------------------------------------------


class ServerThread:
    """uvicorn serving `app` on a background thread, for tests and notebooks:

        with ServerThread(create_app(engine)) as url:     # url = "http://127.0.0.1:PORT"
            httpx.get(url + "/health")

    Port 0 picks a free port. Leaving the block shuts the server down (the lifespan stops the
    engine loop, aborting anything still in flight)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def serve(
    config,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_waiting: int = 1024,
    log_level: str = "warning",
) -> None:
    """Build, warm and serve until interrupted (the CLI's `nanoserve serve`). Mistakes that can be
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
        on_failure=on_failure,
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    )
    print(
        f"nanoserve: loading and warming; http://{host}:{port}/health says 503 until ready",
        file=sys.stderr,
        flush=True,
    )
    server.run()
    if failed:
        raise NanoserveError(f"the engine failed to start ({failed[0]})")

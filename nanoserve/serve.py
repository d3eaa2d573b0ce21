"""The server's routes (days 35-47, 56): an OpenAI-compatible HTTP API around one engine.

    app = create_app(engine)                                  # an Engine, built and warmed
    app = create_app(lambda on_phase: build_engine(config, on_phase), address="127.0.0.1:8000")

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both streaming as server-sent
events when `stream` is true), `GET /v1/models`, `GET /health`, `GET /metrics`, and vLLM's
`POST /tokenize`, `POST /detokenize` and `GET /version`. This module holds `create_app`: the
routes, the API key, the error handlers, and a prompt's way from JSON to token ids, which
`/tokenize` shares with the generation routes so that it counts what they would send. The rest
is in modules of their own: the request schema, its caps and the error object (`api.py`); the
tokenizer endpoints' bodies, the request ids, the access log and CORS (`http_extras.py`);
running a request once it is tokens, streamed or whole (`handlers.py`); the
response shapes (`responses.py`); `/health`'s body and the boot line (`status.py`); the engine
loop that owns the engine (`loop.py`); the metrics (`metrics.py`); and the process around the
app, `serve()` with its drain on SIGTERM (`lifecycle.py`; `serve` and `drain` are importable
from here too).

A route checks the request, renders and tokenizes its prompt on a worker thread (so one huge
prompt never stalls other streams or `/health`), and hands it to `handlers.run`. Bad input never
reaches the engine: it gets an OpenAI error object and a 4xx, and requests in flight are not
touched. A body larger than `max_body_bytes` is refused with 413 before it is read, a prompt
whose characters cannot fit the context is refused before it is tokenized, and a request whose
scores could exceed `max_score_entries` is refused before it starts. Anything unexpected in a
route is a 500 with the same error object (the traceback goes to the server's log only).

With an API key, every `/v1` route and `/tokenize` and `/detokenize` need `Authorization: Bearer
<key>` (compared as UTF-8 bytes, in constant time; vLLM leaves the last two open, but they use the
model's tokenizer and show its vocabulary, which a server with a key keeps to its callers);
`/health`, `/metrics` and `/version` stay open for probes and scrapers, and the
generated docs (`/docs`, `/redoc`, `/openapi.json`) are off: their pages cannot send the key,
and a server that asks for one should tell nothing to a caller without it.

`/health` is the server's state: 503 "loading" / "warming" while a builder runs (day 56: the
door opens after the warm-up), 200 with the pool and the warm plan when ready, 503 "draining"
during a graceful shutdown, 503 "failed" with the reason when the build failed or the engine
loop died.
"""

from __future__ import annotations

import secrets
import sys
import threading
from collections.abc import Callable

import anyio
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanoserve import __version__
from nanoserve.api import (
    MAX_BODY_BYTES,
    MAX_SCORE_ENTRIES,
    APIError,
    BodyLimit,
    ChatRequest,
    CompletionRequest,
    check_supported,
    validation_message,
)
from nanoserve.engine import Engine
from nanoserve.errors import NanoserveError
from nanoserve.grammar import Guided
from nanoserve.handlers import LIVENESS_POLL, run
from nanoserve.http_extras import (
    CORS,
    REQUEST_ID_HEADER,
    AccessLog,
    DetokenizeRequest,
    RequestLog,
    TokenizeRequest,
    cors_options,
    request_id_of,
)
from nanoserve.lifecycle import drain, serve
from nanoserve.loop import EngineLoop
from nanoserve.metrics import Metrics
from nanoserve.sampling import InvalidParam
from nanoserve.status import ServerState, boot_line, health, paths_dict, pool_dict, tp_dict, warm_dict
from nanoserve.tools import check_tools, tool_grammar

__all__ = [
    "LIVENESS_POLL",
    "MAX_BODY_BYTES",
    "MAX_SCORE_ENTRIES",
    "ServerState",
    "boot_line",
    "check_supported",
    "create_app",
    "drain",
    "paths_dict",
    "pool_dict",
    "serve",
    "tp_dict",
    "warm_dict",
]


def create_app(
    engine: Engine | Callable[[Callable[[str], None]], Engine],
    *,
    api_key: str | None = None,
    address: str | None = None,
    max_waiting: int = 1024,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_score_entries: int = MAX_SCORE_ENTRIES,
    served_model_names: list[str] | None = None,
    on_failure: Callable[[str], None] | None = None,
    allowed_origins: list[str] | None = None,
    allowed_methods: list[str] | None = None,
    allowed_headers: list[str] | None = None,
    allow_credentials: bool = False,
    access_log: bool = False,
    access_log_skip: tuple[str, ...] = (),
) -> FastAPI:
    """The FastAPI app. `engine` is a built Engine or a builder `f(on_phase) -> Engine` run in a
    background thread at startup (`/health` is 503 until it returns; if it raises, /health says
    "failed" with the reason and `on_failure(reason)` is called). `max_score_entries`: the most
    log-probabilities (chosen and alternatives) one request may ask for (api.score_entries).
    `served_model_names`: the names a request's `model` may give (default: the model directory's
    name); the first is the one answers carry and /v1/models lists first. `allowed_origins`
    (with `allowed_methods`, `allowed_headers`, `allow_credentials`): CORS for those origins; None
    answers no cross-origin request. `access_log`: one line per request on stderr, except for the
    paths in `access_log_skip` (off by default here, so notebooks and tests stay quiet; the CLI
    turns it on). Every response carries the request's `X-Request-Id` either way."""
    if served_model_names is not None and (
        not served_model_names or not all(isinstance(n, str) and n for n in served_model_names)
    ):
        raise ValueError("served model names are one or more non-empty strings")
    state = ServerState()
    metrics = Metrics(state)

    def ready(eng: Engine) -> None:
        if served_model_names:
            eng.model_name = served_model_names[0]
        state.served_names = tuple(served_model_names or [eng.model_name])
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

    open_docs = api_key is None
    app = FastAPI(
        title="nanoserve",
        lifespan=lifespan,
        docs_url="/docs" if open_docs else None,
        redoc_url="/redoc" if open_docs else None,
        openapi_url="/openapi.json" if open_docs else None,
    )
    app.state.nanoserve = state
    app.state.metrics = metrics
    app.state.build_thread = None
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if allowed_origins is not None:  # outside BodyLimit: its 413 carries the CORS headers too
        app.add_middleware(
            CORS, **cors_options(allowed_origins, allowed_methods, allowed_headers, allow_credentials)
        )
    app.state.access_log = AccessLog() if access_log else None
    app.add_middleware(RequestLog, log=app.state.access_log, skip=tuple(access_log_skip))  # outermost

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

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        # Starlette raises the exception again after this answer, and uvicorn logs its traceback
        message = (
            f"the server failed on {request.method} {request.url.path} ({type(exc).__name__}); "
            "this is a bug in the server, not in the request, and it is in the server's log"
        )
        response = APIError(500, message, type="server_error").response()
        rid = request_id_of(request)  # this answer is sent outside RequestLog, so the id goes on here
        if rid is not None:
            response.headers[REQUEST_ID_HEADER] = rid
        return response

    key = api_key.encode() if api_key is not None else None

    def authorize(request: Request) -> None:
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # ASGI headers are bytes, which Starlette decodes as latin-1: encoding back gives them
        # as sent, so a key outside ASCII matches its UTF-8 bytes and no header can raise here
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode("latin-1"), key):
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
    async def health_route():
        body, status = health(state)
        return body if status == 200 else JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models():
        eng = serving_engine()
        cards = [
            {
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "nanoserve",
                "max_model_len": eng.max_model_len,
            }
            for name in state.served_names
        ]
        return {"object": "list", "data": cards}

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
        return await run(
            state,
            eng,
            req,
            prompt_ids,
            chat=False,
            default_max=16,
            echo=echo,
            score_budget=max_score_entries,
            request_id=request_id_of(request),
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat_completions(req: ChatRequest, request: Request):
        eng = serving_engine()
        check_model(eng, req.model)
        check_supported(req)
        messages = chat_messages(req.messages)
        check_fits(eng, sum(len(m["content"]) for m in messages), "messages")
        tools, guided = None, None
        if req.tools or req.tool_choice is not None:  # tools.py: checked, rendered, maybe enforced
            tok = tokenizer_of(eng, "tools")
            try:
                check_tools(req.tools, req.tool_choice, tok.supports_tools)
            except InvalidParam as e:
                raise APIError(400, str(e), param=e.param) from None
            if req.tools and req.tool_choice != "none":
                tools = list(req.tools)
                # "required" or a named function; parallel_tool_calls false: one call at most
                grammar = tool_grammar(tools, req.tool_choice, req.parallel_tool_calls is not False)
                guided = Guided("grammar", grammar, "tool_choice") if grammar else None
        prompt_ids = await encode_all(eng, [messages], "messages", tools=tools)
        if req.max_completion_tokens is not None:
            req.max_tokens = req.max_completion_tokens
        return await run(
            state,
            eng,
            req,
            prompt_ids,
            chat=True,
            default_max=None,
            score_budget=max_score_entries,
            request_id=request_id_of(request),
            tools=tools is not None,
            guided=guided,
        )

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(req: TokenizeRequest):
        eng = serving_engine()
        check_model(eng, req.model)
        if (req.prompt is None) == (req.messages is None):
            param = "prompt" if req.prompt is None else "messages"
            raise APIError(
                400,
                "give either 'prompt' (a text) or 'messages' (a chat, rendered with the chat template), "
                + ("not both" if req.prompt is not None else "one of them"),
                param=param,
            )
        chat = req.messages is not None
        param = "messages" if chat else "prompt"
        tok = tokenizer_of(eng, param)
        special = req.add_special_tokens if req.add_special_tokens is not None else not chat

        def work() -> list[int]:
            try:
                if not chat:  # with special tokens, the completions endpoint's own way
                    return eng.encode_prompt(req.prompt) if special else tok.encode(req.prompt, add_bos=False)
                messages = chat_messages(req.messages)
                if req.add_generation_prompt and not special:
                    return eng.encode_prompt(messages)  # the chat endpoint's own way
                text = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
                return tok.encode(text, add_bos=None if special else False)
            except (ValueError, NanoserveError) as e:
                raise APIError(400, str(e), param=param) from None

        ids = await anyio.to_thread.run_sync(work)
        body = {"count": len(ids), "max_model_len": eng.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [tok.backend.id_to_token(t) for t in ids]
        return body

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(req: DetokenizeRequest):
        eng = serving_engine()
        check_model(eng, req.model)
        tok = tokenizer_of(eng, "tokens")

        def work() -> str:
            vocab = tok.vocab_size
            for i, t in enumerate(req.tokens):
                if not 0 <= t < vocab:
                    raise APIError(
                        400,
                        f"tokens[{i}] is {t}, outside this model's vocabulary of {vocab} tokens "
                        f"(ids 0 to {vocab - 1})",
                        param="tokens",
                    )
            # special tokens kept (vLLM keeps them too), so detokenize(tokenize(x)) gives x back
            return tok.decode(req.tokens, skip_special_tokens=False)

        return {"prompt": await anyio.to_thread.run_sync(work)}

    def tokenizer_of(eng: Engine, param: str):
        if eng.tokenizer is None:
            raise APIError(
                400, "this server's engine has no tokenizer; it takes and gives token ids only", param=param
            )
        return eng.tokenizer

    def check_model(eng: Engine, name: str | None) -> None:
        if name is not None and name not in state.served_names:
            names = "', '".join(state.served_names)
            raise APIError(
                404,
                f"the model '{name}' does not exist here; this server serves '{names}'",
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

    async def encode_all(eng: Engine, prompts: list, param: str, tools=None) -> list[list[int]]:
        """Render and tokenize on a worker thread: the event loop keeps serving meanwhile.
        `tools`: a chat's tools, which its template writes into the prompt."""

        def work() -> list[list[int]]:
            out = []
            for i, prompt in enumerate(prompts):
                where = f" (prompt {i})" if len(prompts) > 1 else ""
                try:
                    ids = eng.encode_prompt(prompt) if tools is None else eng.encode_prompt(prompt, tools)
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
                offsets.append(detok.chars)
                detok.add(t)
            detok.flush()
            out.append((prompt if isinstance(prompt, str) else detok.text, ids, offsets))
        return out

    return app


def chat_messages(messages) -> list[dict]:
    """A request's `ChatMessage`s as the chat template takes them: a list of text parts joined,
    no content as empty text, `developer` as `system`. Shared by the chat endpoint and /tokenize,
    so /tokenize counts exactly the tokens a chat request would send."""
    out = []
    for m in messages:
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        message = {"role": "system" if m.role == "developer" else m.role, "content": content}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out

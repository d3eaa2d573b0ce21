"""The server's small endpoints and its HTTP operations (issue 32), in vLLM's shapes.

    app.add_middleware(CORS, **cors_options(["https://app.example"]))   # only when asked for
    app.add_middleware(RequestLog, log=AccessLog())                     # outermost

`POST /tokenize` and `POST /detokenize` let a client count and inspect tokens the way the server
does before it spends anything on generation; their bodies are `TokenizeRequest` and
`DetokenizeRequest` here (vLLM's fields, so a client written for vLLM works unchanged), and their
routes are in serve.py, next to the chat endpoint whose rendering `/tokenize` must repeat.

`RequestLog` gives every request an id: the client's `X-Request-Id` when it sends a usable one
(visible ASCII, at most `MAX_REQUEST_ID` characters), else a fresh one, and every response carries
it back in the same header, so a client and an operator can name the same request. An id that
cannot be echoed safely (spaces, control characters, too long) is a 400 naming the header rather
than silently replaced, which would break the client's correlation without telling it. With an
`AccessLog`, the same middleware writes one line per request to stderr as the answer's last bytes
go out (a stream's: its last event), with the client, method, path, status, duration and id:

    nanoserve: 127.0.0.1:51234 "GET /version" 200 0.5ms request_id=6ae571ab29e84ea2a689313b

The line is written by a thread of its own from a bounded queue: a stderr that nobody reads (a
pipe a parent drains only at the end) would otherwise block the event loop, and every request
with it, once the pipe is full. When the queue is full, lines are dropped and counted, and the
line written next is followed by the count. The path is written as the client sent it (`raw_path`,
percent-escapes kept) and anything outside visible ASCII is escaped, so a request cannot forge
log lines.

CORS is off unless the server is given origins (`--allowed-origins`): without them a browser page
from another origin cannot read any answer, which is the safe default for a server that may hold
an API key. `CORS` is Starlette's middleware with one change: a refused preflight is answered
with the server's error object instead of a plain-text 400. `X-Request-Id` is exposed to pages
of the allowed origins.
"""

from __future__ import annotations

import json
import queue
import re
import sys
import threading
import time
import uuid

from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers, MutableHeaders
from starlette.middleware.cors import CORSMiddleware

from nanoserve.api import MAX_MESSAGES, APIError, ChatMessage

MAX_REQUEST_ID = 256  # characters of an X-Request-Id the server echoes and logs
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")  # visible ASCII: no spaces, no control characters
_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s]+")  # scheme://host[:port], as a browser sends it


# --- the tokenizer endpoints' bodies (vLLM's TokenizeCompletionRequest / TokenizeChatRequest /
# DetokenizeRequest, merged into one body per route) --------------------------------------------


class TokenizeRequest(BaseModel):
    """`prompt` (a text, tokenized as /v1/completions tokenizes it) or `messages` (rendered with
    the chat template, as /v1/chat/completions renders them). `add_special_tokens`: a BOS where
    the tokenizer puts one; default true for a prompt and false for messages, whose template
    writes its own (vLLM's defaults). Unknown fields are refused: vLLM's others
    (`continue_final_message`, `chat_template`, `tools`, ...) would change the answer."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


# --- request ids and the access log -------------------------------------------------------------


def _printable(text: str) -> str:
    """`text` with everything outside visible ASCII escaped, so it cannot break a log line."""
    return "".join(c if "\x21" <= c <= "\x7e" else f"\\x{ord(c):02x}" for c in text)


class AccessLog:
    """One line per request on stderr, written by a daemon thread from a queue of at most
    `capacity` lines (module doc). `flush()` waits until every queued line is written; a line is
    queued before the last bytes of its answer are sent, so once a client has read a whole
    answer, `flush()` waits for that answer's line too."""

    def __init__(self, capacity: int = 4096):
        self.queue: queue.Queue[str] = queue.Queue(maxsize=capacity)
        self.dropped = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def write(self, line: str) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nanoserve-access-log", daemon=True)
                self._thread.start()
            try:
                self.queue.put_nowait(line)
            except queue.Full:
                self.dropped += 1

    def _run(self) -> None:
        while True:
            line = self.queue.get()
            try:
                with self._lock:
                    dropped, self.dropped = self.dropped, 0
                if dropped:
                    line += f"\nnanoserve: {dropped} access log line(s) dropped: stderr was not read in time"
                sys.stderr.write(line + "\n")  # looked up each time: whoever holds stderr now
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr closed: the lines have nowhere to go
                pass
            finally:
                self.queue.task_done()

    def flush(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)


def request_id_of(request) -> str | None:
    """The id `RequestLog` gave this request (a Starlette Request), or None outside it."""
    return request.scope.get("state", {}).get("request_id")


class RequestLog:
    """ASGI middleware: the request's id (echoed in `X-Request-Id` on every response, and put in
    `request.state.request_id`), and with `log` its access line. Outermost but for Starlette's
    own error middleware, so a 413 from `BodyLimit` or a CORS preflight is logged too; a route that
    raises is logged as 500 (the error middleware outside answers it, and serve.py's handler puts
    the id on that answer)."""

    def __init__(self, app, log: AccessLog | None = None, skip: tuple[str, ...] = ()):
        self.app, self.log, self.skip = app, log, frozenset(skip)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        usable = given is not None and len(given) <= MAX_REQUEST_ID and _REQUEST_ID.fullmatch(given)
        # made here: 24 hex digits (96 random bits), the answer ids' length before request ids existed
        rid = given if usable else uuid.uuid4().hex[:24]
        scope.setdefault("state", {})["request_id"] = rid
        status, logged = None, False

        def log() -> None:
            nonlocal logged
            if not logged and self.log is not None and scope["path"] not in self.skip:
                self.log.write(self._line(scope, status, time.perf_counter() - start, rid))
            logged = True

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = rid
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                log()  # before the last bytes go: a client that has its answer finds the line queued
            await send(message)

        try:
            if given is not None and not usable:
                refusal = APIError(
                    400,
                    f"the {REQUEST_ID_HEADER} header must be 1 to {MAX_REQUEST_ID} visible ASCII "
                    "characters (no spaces or control characters); this request was given the id "
                    f"{rid} instead",
                    param=REQUEST_ID_HEADER,
                )
                await refusal.response()(scope, receive, send_with_id)
            else:
                await self.app(scope, receive, send_with_id)
        except Exception:
            status = status or 500  # the error middleware outside answers it
            raise
        finally:
            log()  # a request that raised, or whose client left before its answer was over

    @staticmethod
    def _line(scope, status, seconds: float, rid: str) -> str:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        path = scope.get("raw_path")
        path = path.decode("latin-1") if path else scope["path"]
        shown = "-" if status is None else str(status)  # None: the client left before an answer
        return (
            f'nanoserve: {_printable(who)} "{_printable(scope["method"])} {_printable(path)}" '
            f"{shown} {seconds * 1000:.1f}ms request_id={rid}"
        )


# --- CORS ---------------------------------------------------------------------------------------


class CORS(CORSMiddleware):
    """Starlette's CORS middleware, but a refused preflight is the server's error object."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        why = response.body.decode(errors="replace").strip() or "Disallowed CORS request"
        origin = request_headers.get("origin", "")
        refusal = APIError(
            400,
            f"this server does not allow this cross-origin request from {origin!r} ({why}); "
            "start it with --allowed-origins (and --allowed-methods, --allowed-headers) naming it",
            param="Origin",
        )
        return refusal.response()


def parse_list(value: str | list[str] | None, flag: str) -> list[str] | None:
    """A flag's list: a JSON list ('["a", "b"]', vLLM's form) or a comma list ('a,b'); None or
    '' is None. Raises ValueError naming `flag` for anything else."""
    if value is None or isinstance(value, list):
        return value
    text = value.strip()
    if not text:
        return None
    if text.startswith(("[", "{")):
        try:
            items = json.loads(text)
        except ValueError:
            raise ValueError(f"{flag} is a JSON list of strings or a comma list, got {value!r}") from None
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(f"{flag} is a JSON list of strings or a comma list, got {value!r}")
    else:
        items = text.split(",")
    items = [i.strip() for i in items]
    if not all(items):
        raise ValueError(f"{flag} has an empty entry: {value!r}")
    return items


def cors_options(
    origins: list[str],
    methods: list[str] | None = None,
    headers: list[str] | None = None,
    credentials: bool = False,
) -> dict:
    """CORSMiddleware's options; methods and headers default to any (vLLM's defaults). An origin
    is '*' or scheme://host[:port] exactly as a browser sends it: 'example.com' or a trailing
    slash would never match, so they are refused here instead of failing silently later."""
    if not origins:
        raise ValueError("--allowed-origins needs at least one origin")
    for o in origins:
        if o != "*" and not _ORIGIN.fullmatch(o):
            raise ValueError(
                f"--allowed-origins: {o!r} is not an origin; give '*' or scheme://host[:port] with "
                "no path, e.g. https://app.example or http://localhost:3000"
            )
    return dict(
        allow_origins=list(origins),
        allow_methods=list(methods or ["*"]),
        allow_headers=list(headers or ["*"]),
        allow_credentials=credentials,
        expose_headers=[REQUEST_ID_HEADER],
    )

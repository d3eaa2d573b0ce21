"""The OpenAI request schema and its errors (days 36-40), as the server reads them.

`CompletionRequest` and `ChatRequest` are pydantic models of OpenAI's request bodies, strict
about types (a `max_tokens` of "5" is an error, not a 5), plus extensions: `top_k`,
`ignore_eos` and `return_token_ids`, and vLLM's sampling fields `repetition_penalty`, `min_p`,
`stop_token_ids`, `min_tokens` and `include_stop_str_in_output` (on both routes, as vLLM takes
them). Scores and several answers are served: `logprobs`, `echo` (with `max_tokens` 0 to score
a prompt alone), `n`, `best_of` and a list of prompts on completions; `logprobs` with
`top_logprobs` on chat. OpenAI's `presence_penalty`, `frequency_penalty` and `logit_bias` are
served too. Their ranges are checked once, by `SamplingParams.validate` (the engine's own
check, so the server and the engine cannot disagree), which the handler turns into a 400
naming the field; the schema here only checks their types. Any field that would change the
answer and that this server does not implement is refused by `check_supported` when set to
anything but its default, never silently ignored: OpenAI's suffix and older `functions`, and
the extensions other servers take (vLLM's `structured_outputs`, bad_words, ...; see
`ANSWER_CHANGING`). Structured output (`response_format`, vLLM's `guided_*`: grammar.py) and
tools (`tools`, `tool_choice`, `parallel_tool_calls`: tools.py) are served. Unknown fields that
change nothing (`user`, `metadata`) are ignored. A chat message other than the assistant's must
have content: a null or absent one is a 400 naming it (`messages.0.content`), not an empty turn
the model would answer anyway (an assistant's may be null, as OpenAI allows after a tool call).
Sizes are capped (`MAX_STOP_CHARS`, `MAX_MESSAGES`, `MAX_PARTS`, `MAX_N`, `MAX_PROMPTS`, `MAX_SAMPLES`,
`MAX_LOGPROBS`, and the scores a request may make: the server's `max_score_entries`,
`MAX_SCORE_ENTRIES` unless told), so no request can make the server do or hold far more than its
context allows, and `BodyLimit` (ASGI middleware) answers 413 to a body over the server's cap
before it is parsed. Every refusal is an `APIError`, which renders as OpenAI's error object:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from nanoserve.sampling import MAX_LOGPROBS

# --- errors --------------------------------------------------------------------------------------


class APIError(Exception):
    """An error a client caused (or a state it met), answered as OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param=None,
        code=None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = self.headers | ({"WWW-Authenticate": "Bearer"} if self.status == 401 else {})
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """pydantic's first complaint as one sentence, and the field it names."""
    errors = exc.errors()
    if not errors:
        return "the request body is not valid", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    raw = err.get("input")
    if err.get("type") == "json_invalid" or isinstance(raw, (bytes, str)) and not loc:
        try:
            json.loads(raw or b"")
        except (ValueError, TypeError):
            return "the request body is not valid JSON", None
    if err.get("type") == "missing" and loc:
        return f"the field '{'.'.join(loc)}' is required", ".".join(loc)
    if not loc:
        return f"the request body must be a JSON object ({err.get('msg', 'invalid')})", None
    field = ".".join(loc)
    return f"'{field}': {err.get('msg', 'invalid value')}", field


# --- the request schema (OpenAI's, plus top_k, ignore_eos, return_token_ids and vLLM's fields) ---

MAX_STOP = 4  # stop strings a request may give (OpenAI's limit)
MAX_STOP_CHARS = 256  # characters in one stop string
MAX_MESSAGES = 1024  # messages in one chat request
MAX_PARTS = 64  # text parts in one message's content
MAX_N = 16  # answers one prompt may ask for (n, and best_of, the samples they are chosen from)
MAX_PROMPTS = 64  # prompts in one completions request
MAX_SAMPLES = 256  # sequences one request may start: prompts x best_of (or n)
MAX_BODY_BYTES = 4 * 2**20  # the default request-body cap: far above any prompt a context holds
# The default cap on the scores one request may make: a score is a token's log-probability or
# one alternative's (a token asked with logprobs N has N + 1). 2**20 of them is 8 MiB held
# (an id and a float32 each) and some tens of MB of JSON; 16 answers x 2,048 tokens x 21 fit.
MAX_SCORE_ENTRIES = 2**20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # extras are checked by check_supported
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 or -1 turns it off
    stop: str | list[str] | None = None  # at most MAX_STOP, each at most MAX_STOP_CHARS (checked in serve)
    seed: int | None = Field(default=None, ge=0, le=2**64 - 1)  # what torch.Generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    # the sampling adjustments: types here, ranges in SamplingParams.validate (module doc)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    repetition_penalty: float | None = None  # vLLM's; None: 1, no penalty
    min_p: float | None = None  # vLLM's; None: 0, no cut
    stop_token_ids: list[int] | None = None  # vLLM's
    min_tokens: int | None = None  # vLLM's; None: 0
    include_stop_str_in_output: bool = False  # vLLM's
    # structured output (grammar.py): OpenAI's response_format, vLLM's guided_* (one at most)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None  # a JSON schema (or its text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # llguidance's Lark
    user: str | None = None
    ignore_eos: bool = False  # extension
    # vLLM's: the request's place under --scheduling-policy priority (lower first); refused as a
    # 400 by a server that serves in arrival order, unless 0
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    return_token_ids: bool = False  # extension: each choice carries the generated token ids


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"a request takes at most {MAX_PROMPTS} prompts, this one has {len(value)}")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # validate_default: an absent content is checked as a null one
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    # an assistant turn's calls, as the answer returned them (tools.py checks them when rendering)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None  # a tool turn's: the call it answers

    @field_validator("content")
    @classmethod
    def _few_parts(cls, value):
        if isinstance(value, list) and len(value) > MAX_PARTS:
            raise ValueError(f"a message's content has at most {MAX_PARTS} parts, this one has {len(value)}")
        return value

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, value, info: ValidationInfo):
        # an assistant turn may be null (OpenAI's, when it called tools); any other has content
        role = info.data.get("role")  # absent when the role itself was refused
        if value is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content; only an assistant's may be null")
        return value


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: "required" admits one call, not several


# Fields other servers take that would change the answer, with the value that changes nothing
# (_REFUSE: any value other than null is refused). Sent with another value, they get a 400.
_REFUSE = object()
ANSWER_CHANGING: dict[str, Any] = {
    "echo": False,  # chat: vLLM's "prepend the last message"; completions defines its own echo
    "best_of": 1,  # chat: vLLM takes it there too; completions defines its own best_of
    "length_penalty": 1,
    "top_a": 0,
    "typical_p": 1,
    "mirostat": 0,
    "use_beam_search": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "add_generation_prompt": True,
    "continue_final_message": False,
    "bad_words": _REFUSE,
    "allowed_token_ids": _REFUSE,
    "prompt_logprobs": _REFUSE,
    "logits_processors": _REFUSE,
    "guided_decoding_backend": _REFUSE,
    "structured_outputs": _REFUSE,
    "grammar": _REFUSE,
    "json_schema": _REFUSE,
    "functions": _REFUSE,
    "function_call": _REFUSE,
    "prediction": _REFUSE,
    "audio": _REFUSE,
    "modalities": _REFUSE,
    "reasoning_effort": _REFUSE,
    "chat_template": _REFUSE,
    "chat_template_kwargs": _REFUSE,
    "truncate_prompt_tokens": _REFUSE,
    "n_probs": _REFUSE,
}


def check_supported(req: _Common) -> None:
    """Fields we parse but do not implement are refused when set to anything but their default."""
    best_of = getattr(req, "best_of", None)
    checks = [
        (
            "best_of",
            best_of is not None and best_of < req.n,
            f"best_of ({best_of}) must be at least n ({req.n}): n answers are chosen from best_of samples",
        ),
        (
            "best_of",
            best_of is not None and best_of > req.n and req.stream,
            "best_of > n cannot be streamed: the best answers are known only when every sample is done",
        ),
        (
            "top_logprobs",
            getattr(req, "top_logprobs", None) is not None and not getattr(req, "logprobs", False),
            "top_logprobs needs logprobs: true",
        ),
        ("suffix", bool(getattr(req, "suffix", None)), "suffix is not supported"),
    ]
    for param, bad, message in checks:
        if bad:
            raise APIError(400, message, param=param)
    for name, value in (req.model_extra or {}).items():
        default = ANSWER_CHANGING.get(name)
        if name in ANSWER_CHANGING and value is not None and (default is _REFUSE or value != default):
            raise APIError(
                400, f"'{name}' is not supported by this server and would change the answer", param=name
            )


# --- the body cap -------------------------------------------------------------------------------


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 with an error object. A declared
    Content-Length over the cap is refused before anything is read; a body without one (chunked)
    is read up to the cap first and refused as soon as it crosses it, then handed on whole."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, size: str) -> Response:
        message = f"the request body is {size}; this server takes at most {self.max_bytes:,} bytes"
        return APIError(413, message, code="request_too_large").response()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                return await self._too_large(f"{int(length):,} bytes")(scope, receive, send)
            return await self.app(scope, receive, send)  # the server stops at the length it declared
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was complete
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(f"over {self.max_bytes:,} bytes")(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect can come

        await self.app(scope, replay, send)


# --- the score budget ---------------------------------------------------------------------------


def score_entries(sequences: int, max_tokens: int, top: int, prompt_tokens: int = 0) -> int:
    """Scores a request can make: each generated token of each sequence, and each echoed prompt
    token, has its own log-probability and `top` alternatives'. 4 sequences x 100 tokens with
    logprobs 5 -> 4 * 100 * 6 = 2,400."""
    return (sequences * max_tokens + prompt_tokens) * (top + 1)


def check_score_budget(
    budget: int, chat: bool, prompts: int, samples: int, max_tokens: int, top: int, prompt_tokens: int
) -> None:
    """Refuse, before any work, a request whose scores could exceed `budget` entries."""
    entries = score_entries(prompts * samples, max_tokens, top, prompt_tokens)
    if entries <= budget:
        return
    top_field = "top_logprobs" if chat else "logprobs"
    counts = f"{prompts} prompt(s) x {samples} sample(s) (n or best_of) x {max_tokens} max_tokens"
    if prompt_tokens:
        counts = f"({counts} + {prompt_tokens} echoed prompt tokens)"
    raise APIError(
        400,
        f"this request could make {entries:,} scores, {counts} x {top + 1} a token ({top_field} "
        f"{top} + 1), and this server keeps at most {budget:,} a request; lower n, best_of, "
        f"max_tokens, {top_field} or the number of prompts",
        param=top_field if chat and top else "logprobs",
        code="too_many_scores",
    )

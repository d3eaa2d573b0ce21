"""The OpenAI request schema and its errors (days 36-40), as the server reads them.

`CompletionRequest` and `ChatRequest` are pydantic models of OpenAI's request bodies, strict
about types (a `max_tokens` of "5" is an error, not a 5), plus three extensions: `top_k`,
`ignore_eos` and `return_token_ids`. Fields this server parses but does not implement (`n` > 1,
logprobs, echo, best_of, penalties, logit_bias, suffix, tools) are refused by `check_supported`
when set to anything but their default, rather than silently ignored. Every refusal is an
`APIError`, which renders as OpenAI's error object:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

# --- errors --------------------------------------------------------------------------------------


class APIError(Exception):
    """An error a client caused (or a state it met), answered as OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        body = self.body()
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


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


# --- the request schema (OpenAI's, plus top_k, ignore_eos and return_token_ids) -----------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 or -1 turns it off
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # extension
    return_token_ids: bool = False  # extension: each choice carries the generated token ids


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None


def check_supported(req: _Common) -> None:
    """Fields we parse but do not implement are refused when set to anything but their default."""
    checks = [
        ("n", req.n != 1, "n > 1 is not supported; send one request per completion"),
        ("presence_penalty", bool(req.presence_penalty), "presence_penalty is not supported"),
        ("frequency_penalty", bool(req.frequency_penalty), "frequency_penalty is not supported"),
        ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
        ("logprobs", bool(getattr(req, "logprobs", None)), "logprobs are not supported"),
        ("echo", bool(getattr(req, "echo", False)), "echo is not supported"),
        ("best_of", (getattr(req, "best_of", None) or 1) != 1, "best_of is not supported"),
        ("suffix", bool(getattr(req, "suffix", None)), "suffix is not supported"),
        ("tools", bool(getattr(req, "tools", None)), "tools are not supported by this server"),
    ]
    for param, bad, message in checks:
        if bad:
            raise APIError(400, message, param=param)

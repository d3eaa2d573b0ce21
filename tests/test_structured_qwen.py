"""Structured output with Qwen2.5-Coder-0.5B-Instruct served (issue 32), through the openai client.

One served model for the module (the GGUF fetched first). Eight of evals/schemas.py's 50 schemas,
chosen to cover its shapes in few tokens (an enum array, a nullable pattern and an optional
field, a union of two objects with const, nested objects, an open object, exclusiveMinimum),
answered greedy through response_format: every answer parses and validates. The same prompts
without response_format do not all validate, so the check can fail. The openai client's
`beta.chat.completions.parse` with a pydantic model returns a parsed object. tool_choice
"required" returns a tool call whose arguments validate, and streamed, its deltas join to the
same call. The whole set (evals/schemas.py) runs the 50 greedy and sampled, with tools "auto"
and a named function.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from evals.schemas import SCHEMAS, SERVED, TOOL_PARAMS, TOOLS, book_model

pytestmark = pytest.mark.slow

CHOSEN = ("book", "person", "payment", "employee", "sports_match", "hotel_booking", "dns_record", "planet")
CASES = [c for c in SCHEMAS if c.name in CHOSEN]
WEATHER = "What's the weather like in Paris right now?"


@pytest.fixture(scope="module")
def client():
    import openai

    from nanoserve.config import EngineConfig
    from nanoserve.engine import build_engine
    from nanoserve.fetch import fetch_named_gguf
    from nanoserve.serve import create_app
    from nanoserve.threads import ServerThread

    fetch_named_gguf("qwen2.5-coder-0.5b-instruct")
    eng = build_engine(
        EngineConfig(
            model="qwen2.5-coder-0.5b-instruct",
            weights="gguf",
            quant_activations="int8",
            max_batch=16,
            max_model_len=4096,
        )
    )
    with ServerThread(create_app(eng)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)


def answers(client, constrained: bool, max_tokens: int = 300) -> list:
    """The eight prompts, greedy, all at once; each choice."""

    def ask(case):
        kw = {}
        if constrained:
            kw["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": case.name, "schema": case.schema},
            }
        r = client.chat.completions.create(
            model=SERVED,
            messages=[{"role": "user", "content": case.prompt}],
            temperature=0.0,
            max_tokens=max_tokens,
            **kw,
        )
        return r.choices[0]

    with ThreadPoolExecutor(len(CASES)) as pool:
        return list(pool.map(ask, CASES))


def why_invalid(content, schema) -> str | None:
    try:
        jsonschema.validate(json.loads(content or ""), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def test_eight_schemas_greedy_all_validate(client):
    assert len(CASES) == 8
    for case, choice in zip(CASES, answers(client, constrained=True)):
        assert choice.finish_reason == "stop", (case.name, choice.finish_reason, choice.message.content)
        assert why_invalid(choice.message.content, case.schema) is None, (case.name, choice.message.content)


def test_the_same_prompts_unconstrained_do_not_all_validate(client):
    """So the check above can fail: left to itself the model writes a markdown fence, prose, its own
    keys or values outside the enums (a cut answer, max_tokens 150, is not JSON either)."""
    failed = [
        case.name
        for case, choice in zip(CASES, answers(client, constrained=False, max_tokens=150))
        if why_invalid(choice.message.content, case.schema) is not None
    ]
    assert failed, "every unconstrained answer validated; pick a schema the free answer misses"


def test_beta_parse_returns_the_pydantic_object(client):
    Book = book_model()
    r = client.beta.chat.completions.parse(
        model=SERVED,
        messages=[
            {"role": "user", "content": "Invent a book: title, author, year, genres, pages and publisher."}
        ],
        response_format=Book,
        temperature=0.0,
        max_tokens=300,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Book), r.choices[0].message.content
    assert 1450 <= parsed.year <= 2025 and 1 <= len(parsed.genres) <= 3


def required_call(client, stream: bool):
    """tool_choice "required" on the weather prompt, greedy: (finish_reason, [(name, arguments)])."""
    kw = dict(
        model=SERVED,
        messages=[{"role": "user", "content": WEATHER}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0.0,
        max_tokens=200,
    )
    if not stream:
        r = client.chat.completions.create(**kw)
        calls = r.choices[0].message.tool_calls or []
        return r.choices[0].finish_reason, [(c.function.name, c.function.arguments) for c in calls]
    parts, finish = {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        for tc in chunk.choices[0].delta.tool_calls or []:
            part = parts.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            part["id"] += tc.id or ""
            if tc.function is not None:
                part["name"] += tc.function.name or ""
                part["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert all(p["id"].startswith("call_") for p in parts.values())
    return finish, [(parts[i]["name"], parts[i]["arguments"]) for i in sorted(parts)]


def test_tool_choice_required_returns_a_valid_call_streamed_alike(client):
    finish, calls = required_call(client, stream=False)
    assert finish == "tool_calls" and calls
    for name, arguments in calls:
        assert name in TOOL_PARAMS
        assert why_invalid(arguments, TOOL_PARAMS[name]) is None, (name, arguments)
    assert calls[0][0] == "get_weather"
    streamed_finish, streamed = required_call(client, stream=True)
    assert streamed_finish == "tool_calls"
    assert streamed == calls

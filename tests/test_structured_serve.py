"""Structured output through the server on the default path (issue 32): SmolLM2's GGUF with the
fused decode step, asked by the `openai` client.

A schema-constrained request answers JSON that validates, streamed or not, with n samples and
penalties riding along; vLLM's guided_choice and guided_regex through `extra_body`; plain
requests batched with constrained ones keep their tokens; each refusal is a 400 naming its field;
every KV block comes back. Qwen2.5-Coder's 50 schemas, the pydantic parse and tool calls are in
tests/test_structured_qwen.py and evals/schemas.py; the mask itself in tests/test_grammar.py.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from nanoserve.config import EngineConfig
from nanoserve.engine import build_engine
from nanoserve.serve import create_app
from nanoserve.threads import ServerThread

NAME = "SmolLM2-135M-Instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name, an age and their pets."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


@pytest.fixture(scope="module")
def served(smollm_gguf):
    engine = build_engine(
        EngineConfig(weights="gguf", quant_activations="int8", max_batch=8, max_model_len=2048)
    )
    assert "decode step fused" in engine.paths_line()
    with ServerThread(create_app(engine)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), engine


def valid(text: str) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    return value


def test_a_schema_is_answered_by_valid_json_whole_and_streamed_with_n(served):
    client, engine = served
    kw = dict(model=NAME, messages=ASK, response_format=FORMAT, max_tokens=80, temperature=0.8, seed=7, n=2)
    whole = client.chat.completions.create(**kw)
    texts = [c.message.content for c in whole.choices]
    for c in whole.choices:
        valid(c.message.content)
        assert c.finish_reason == "stop"
    streamed = ["", ""]
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == texts  # seeded: the same samples, streamed
    greedy = client.chat.completions.create(model=NAME, messages=ASK, response_format=FORMAT, max_tokens=80)
    valid(greedy.choices[0].message.content)
    # the same request unconstrained is not this JSON (so the check above can fail)
    free = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=80, temperature=0)
    with pytest.raises((json.JSONDecodeError, jsonschema.ValidationError)):
        valid(free.choices[0].message.content)


def test_penalties_and_json_object_ride_along(served):
    client, _ = served
    r = client.chat.completions.create(
        model=NAME,
        messages=ASK,
        response_format=FORMAT,
        max_tokens=80,
        presence_penalty=1.5,
        frequency_penalty=0.5,
        extra_body={"repetition_penalty": 1.3, "min_p": 0.05},
    )
    valid(r.choices[0].message.content)
    r = client.chat.completions.create(
        model=NAME, messages=ASK, response_format={"type": "json_object"}, max_tokens=120, temperature=0
    )
    assert r.choices[0].finish_reason == "length" or isinstance(
        json.loads(r.choices[0].message.content), dict
    )


def test_guided_choice_and_regex_through_extra_body(served):
    client, _ = served
    question = [{"role": "user", "content": "Is the sea salty?"}]
    r = client.chat.completions.create(
        model=NAME, messages=question, max_tokens=8, extra_body={"guided_choice": ["yes", "no", "unsure"]}
    )
    assert r.choices[0].message.content in ("yes", "no", "unsure")
    r = client.completions.create(
        model=NAME,
        prompt="The date, as YYYY-MM-DD:",
        max_tokens=12,
        extra_body={"guided_regex": r"\d{4}-\d{2}-\d{2}"},
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.choices[0].text), r.choices[0].text


def test_plain_requests_batched_with_constrained_ones_keep_their_tokens(served):
    client, engine = served
    prompts = ["Name three colours.", "Count to five.", "Say hello in French."]

    def plain(p):
        r = client.completions.create(
            model=NAME, prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
        )
        return r.choices[0].text

    def constrained(i):
        return (
            client.chat.completions.create(
                model=NAME, messages=ASK, response_format=FORMAT, max_tokens=80, temperature=1.0, seed=i
            )
            .choices[0]
            .message.content
        )

    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        together = [pool.submit(plain, p) for p in prompts]
        shaped = [pool.submit(constrained, i) for i in range(3)]
        assert [f.result() for f in together] == alone
        for f in shaped:
            valid(f.result())
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize(
    "body,param",
    [
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
        ({"guided_json": PERSON, "guided_regex": "a+"}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # SmolLM2 has no tools
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "none"}, "tools"),
    ],
)
def test_each_refusal_is_a_400_naming_its_field(served, body, param):
    client, engine = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4, extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"]
    assert engine.allocator.num_free == engine.allocator.num_blocks

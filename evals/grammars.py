"""Structured output (issue 32): xgrammar against llguidance on this CPU, for our own tokenizers.

    .venv/bin/python evals/grammars.py [--models SmolLM2-135M-Instruct ...] [--steps 160]

Issue 32 asks for response_format json_object / json_schema and vLLM's guided_json,
guided_regex, guided_choice and guided_grammar through a grammar library that turns a grammar
into a per-step token mask. Two are well kept and on PyPI, xgrammar and llguidance; this script
is the measurement that chooses between them. Neither is a dependency of the project yet:
install them by hand (`pip install --no-deps xgrammar apache-tvm-ffi`, since xgrammar's wheel
asks for triton, a GPU compiler we never use; `pip install llguidance jsonschema`).

For each of our three models' tokenizers (SmolLM2-135M-Instruct, 49,152 logits rows;
Qwen2.5-Coder-0.5B-Instruct, 151,936; gemma-3-270m, 262,144) it builds each library's tokenizer
object from the `transformers` fast tokenizer of the model directory, with the mask as wide as the
model's logits (config.json's vocab_size; both libraries pad a shorter tokenizer to that width,
xgrammar through `vocab_size=`, llguidance through `n_vocab=`). It then measures, on 25 JSON
schemas of varied shape, the builtin "any JSON object", one regex, one choice list and one small
context-free grammar (EBNF for xgrammar, the same language in Lark for llguidance):

- compile time of each grammar, cold, and again for the same grammar (xgrammar keeps compiled
  grammars in its compiler's cache; llguidance has no cache, so "again" is a second build), and
  the time to the first mask (making the matcher and filling one row);
- the per-step cost at 16 rows: 16 matchers of different grammars advanced together along a valid
  answer, token by token (a hand-written instance of each schema, checked against the schema with
  `jsonschema`, tokenized without special tokens; a row that finishes takes the end token and
  starts over; the check below has visited every state once before). Each step fills a
  (16, vocab) bitmask, applies it to (16, vocab) fp32 logits and advances every matcher by its
  token, timed apart. Filling is timed both as a Python loop over
  the rows and through each library's batch call (xgrammar's BatchGrammarMatcher, llguidance's
  LLExecutor), both with 2 threads. The figure to quote is the ratio of a step's mask time (fill
  and apply) to what `nanoserve.sampling.sample_rows` takes for 16 greedy rows of the same
  vocabulary, measured in the same run;
- correctness: at every position of every answer the answer's next token (and at its end the end
  token) is allowed by both libraries' masks, and a planted wrong continuation (a `}` right after
  the `{` of an object with required fields, a value outside an enum or a range, a string past its
  maxLength, an item past maxItems, a key the schema does not have) is refused by both before it
  is complete. At every state the two libraries' masks are compared and any difference is counted
  and shown with example tokens (with which library's set is the narrower). A few probes go past
  the schemas: a JSON escape inside a maxLength string (valid), a raw tab there (invalid JSON), a
  special token of the chat format inside a string, and for Qwen2.5 one of the padding rows our
  GGUF-written tokenizer.json spells as the text "[PADn]".

It prints the CPU line every benchmark prints, the library versions and a table for each model,
and writes every figure to evals/grammars.csv (one row a figure). Timings are medians and p99s in
microseconds; the machine is shared, so the ratio to the sampler is the figure to compare.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from nanocourse import write_csv  # noqa: E402
from nanoserve.bench import cpu_line  # noqa: E402
from nanoserve.sampling import SamplingParams, sample_rows  # noqa: E402

MODELS_DIR = Path.home() / ".cache" / "nanoserve" / "models"
MODELS = ("SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct", "gemma-3-270m")
ROWS = 16
THREADS = 2


def obj(properties: dict, required=None, **extra) -> dict:
    """An object schema with no properties beyond `properties` (OpenAI's strict mode asks the same),
    all of them required unless `required` names fewer."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


STR = {"type": "string"}
INT = {"type": "integer"}
NUM = {"type": "number"}
BOOL = {"type": "boolean"}

# (name, schema, a valid instance, planted wrong continuations as (valid prefix text, wrong text)).
# The instance is written out with json.dumps, properties in the schema's order.
SCHEMAS = [
    (
        "person",
        obj(
            {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
            },
            required=["name", "age"],
        ),
        {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org"},
        [("{", "}"), ('{"name": "Ada Lovelace", "age": ', "-3"), ('{"name": "Ada", "age": 1', "51")],
    ),
    (
        "point",
        obj({"x": NUM, "y": NUM}),
        {"x": 1.5, "y": -2.25},
        [("{", "}"), ('{"x": 1.5', "}")],
    ),
    (
        "tags",
        {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        ["red", "green", "blue"],
        [("[", "]"), ('["red", "green", "blue"', ', "x"]'), ('["', "abcdefghijklmnop")],
    ),
    (
        "color_enum",
        {"type": "string", "enum": ["red", "green", "blue"]},
        "green",
        [('"', "yellow"), ('"gr', "ay")],
    ),
    (
        "order",
        obj(
            {
                "id": {"type": "integer", "minimum": 1},
                "customer": obj({"name": STR, "vip": BOOL}),
                "items": {
                    "type": "array",
                    "items": obj(
                        {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        }
                    ),
                    "minItems": 1,
                    "maxItems": 4,
                },
            }
        ),
        {
            "id": 1042,
            "customer": {"name": "Grace Hopper", "vip": True},
            "items": [{"sku": "ABC-1234", "qty": 2}, {"sku": "XYZ-0001", "qty": 12}],
        },
        [
            ('{"id": ', "0"),
            ('{"id": 1042, "customer": {"name": "Grace", "vip": true}, "items": [{"sku": "', "abc"),
            ('{"id": 1, "customer": {"name": "G", "vip": false}, "items": [{"sku": "ABC-1234", "qty": ', "0"),
        ],
    ),
    (
        "nullable",
        obj(
            {
                "nickname": {"anyOf": [STR, {"type": "null"}]},
                "score": {"anyOf": [NUM, {"type": "null"}]},
            }
        ),
        {"nickname": None, "score": 9.5},
        [('{"nickname": ', "true"), ('{"nickname": null, "score": ', '"high"')],
    ),
    (
        "flags",
        obj({"enabled": BOOL, "verbose": BOOL, "retries": {"type": "integer", "minimum": 0, "maximum": 5}}),
        {"enabled": True, "verbose": False, "retries": 3},
        [('{"enabled": ', '"yes"'), ('{"enabled": true, "verbose": false, "retries": ', "7")],
    ),
    (
        "matrix",
        {
            "type": "array",
            "items": {"type": "array", "items": INT, "maxItems": 3},
            "maxItems": 3,
        },
        [[1, 2, 3], [4, 5, 6]],
        [("[[1, 2, 3", ", 4"), ("[[", '"a"')],
    ),
    (
        "address",
        obj(
            {
                "street": STR,
                "city": STR,
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "CA", "MX"]},
            }
        ),
        {"street": "12 Elm St", "city": "Springfield", "zip": "62704", "country": "US"},
        [
            ('{"street": "12 Elm St", "city": "Springfield", "zip": "1234', "a"),
            ('{"street": "1", "city": "S", "zip": "62704", "country": "', "UK"),
        ],
    ),
    (
        "event",
        obj(
            {
                "title": {"type": "string", "maxLength": 30},
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "attendees": {"type": "array", "items": STR, "maxItems": 5},
                "online": BOOL,
            }
        ),
        {"title": "Design review", "date": "2026-12-03", "attendees": ["Ann", "Bo"], "online": True},
        [('{"title": "Design review", "date": "2026-', "Dec"), ('{"title": "', "x" * 40)],
    ),
    (
        "product",
        obj(
            {
                "name": STR,
                "price": {"type": "number", "minimum": 0, "exclusiveMaximum": 10000},
                "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
                "in_stock": BOOL,
            }
        ),
        {"name": "Kettle", "price": 39.99, "currency": "EUR", "in_stock": False},
        [('{"name": "Kettle", "price": ', "-1"), ('{"name": "K", "price": 1, "currency": "', "CHF")],
    ),
    (
        "weather",
        obj(
            {
                "city": STR,
                "temperature_c": {"type": "number", "minimum": -90, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            }
        ),
        {"city": "Oslo", "temperature_c": -3.5, "conditions": "snow", "humidity": 81},
        [
            ('{"city": "Oslo", "temperature_c": -3.5, "conditions": "', "fog"),
            ('{"city": "O", "temperature_c": 1, "conditions": "rain", "humidity": ', "101"),
        ],
    ),
    (
        "tool_call",
        obj(
            {
                "name": {"const": "get_weather"},
                "arguments": obj({"city": STR, "unit": {"enum": ["celsius", "fahrenheit"]}}),
            }
        ),
        {"name": "get_weather", "arguments": {"city": "Lisbon", "unit": "celsius"}},
        [
            ('{"name": "', "search"),
            ('{"name": "get_weather", "arguments": {"city": "L", "unit": "', "kelvin"),
        ],
    ),
    (
        "people",
        {"type": "array", "items": obj({"name": STR, "age": INT}), "minItems": 2, "maxItems": 3},
        [{"name": "Ann", "age": 31}, {"name": "Bo", "age": 27}],
        [('[{"name": "A", "age": 1}', "]"), ("[{", '"age"')],
    ),
    (
        "sentiment",
        obj(
            {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
        {"label": "positive", "confidence": 0.87},
        [('{"label": "', "happy"), ('{"label": "neutral", "confidence": ', "2")],
    ),
    (
        "deep",
        obj({"a": obj({"b": obj({"c": obj({"d": INT})})})}),
        {"a": {"b": {"c": {"d": 4}}}},
        [('{"a": {"b": {"c": {', '"e"'), ('{"a": {"b": {"c": {"d": 4}}', "}}}")],
    ),
    (
        "lengths",
        obj(
            {
                "code": {"type": "string", "minLength": 3, "maxLength": 5},
                "note": {"type": "string", "maxLength": 10},
            }
        ),
        {"code": "AB12", "note": "short one"},
        [('{"code": "', "abcdef"), ('{"code": "ab', '"'), ('{"code": "abc", "note": "', "0123456789x")],
    ),
    (
        "union",
        obj(
            {
                "shape": {
                    "anyOf": [
                        obj({"kind": {"const": "circle"}, "radius": NUM}),
                        obj({"kind": {"const": "square"}, "side": NUM}),
                    ]
                }
            }
        ),
        {"shape": {"kind": "square", "side": 2}},
        [('{"shape": {"kind": "', "triangle"), ('{"shape": {"kind": "circle", "', "side")],
    ),
    (
        "scores",
        obj(
            {
                "scores": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 10},
                    "maxItems": 5,
                }
            }
        ),
        {"scores": [1, 7, 10, 0]},
        [('{"scores": [1, ', "11"), ('{"scores": [1, 2, 3, 4, 5', ", 6")],
    ),
    (
        "optional",
        obj({"id": INT, "comment": STR}, required=["id"]),
        {"id": 7},
        [('{"id": 7, "', "extra"), ("{", "}")],
    ),
    (
        "open_object",
        {"type": "object", "properties": {"k": STR}, "required": ["k"]},
        {"k": "v"},
        [("{", "}"), ('{"k": ', "1")],
    ),
    (
        "refs",
        {
            "$defs": {"money": obj({"amount": NUM, "currency": {"enum": ["USD", "EUR"]}})},
            **obj({"price": {"$ref": "#/$defs/money"}, "tax": {"$ref": "#/$defs/money"}}),
        },
        {"price": {"amount": 10, "currency": "USD"}, "tax": {"amount": 2.1, "currency": "USD"}},
        [('{"price": {"amount": 10, "currency": "', "GBP"), ('{"price": {', '"value"')],
    ),
    (
        "tree",
        {
            "$defs": {
                "node": obj(
                    {
                        "value": INT,
                        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                    }
                )
            },
            "$ref": "#/$defs/node",
        },
        {
            "value": 1,
            "children": [
                {"value": 2, "children": []},
                {"value": 3, "children": [{"value": 4, "children": []}]},
            ],
        },
        [('{"value": 1, "children": [{"value": 2, "children": []}, {', '"kids"'), ('{"value": ', '"one"')],
    ),
    (
        "countries",
        obj(
            {
                "country": {
                    "enum": ["France", "Germany", "Italy", "Spain", "Portugal", "Poland", "Norway", "Sweden"]
                    + ["Finland", "Denmark", "Austria", "Greece"]
                },
                "capital": {"type": "string", "maxLength": 20},
            }
        ),
        {"country": "Portugal", "capital": "Lisbon"},
        [('{"country": "', "Japan"), ('{"country": "Po', "rtugala")],
    ),
    (
        "formats",
        obj(
            {
                "email": {"type": "string", "format": "email"},
                "when": {"type": "string", "format": "date"},
                "id": {"type": "string", "format": "uuid"},
            }
        ),
        {"email": "ada@example.com", "when": "2026-12-03", "id": "123e4567-e89b-12d3-a456-426614174000"},
        [('{"email": "ada@example.com", "when": "', "tomorrow")],
    ),
]

REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]"
CHOICES = ["positive", "negative", "neutral", "mixed"]
# The same language twice: arithmetic over non-negative integers with + - * / and parentheses.
EBNF = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9]+
"""
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""

# (name, kind, spec, answer text, planted wrong continuations); kind picks each library's compile call.
OTHERS = [
    (
        "json_object",
        "json_object",
        None,
        '{"answer": [1, 2.5, "three", null], "ok": true}',
        [("{", "]"), ('{"a": 1', ",}")],
    ),
    ("regex_datetime", "regex", REGEX, "2026-12-03T21:45", [("2026-1", "3"), ("2026-12-03T2", "5")]),
    ("choice", "choice", CHOICES, "neutral", [("", "maybe"), ("neg", "ative!")]),
    ("grammar_arith", "grammar", (EBNF, LARK), "(12+3)*4-56/(7+8)", [("(12+", ")"), ("(1", "+*")]),
]


BOUNDED = {"type": "string", "maxLength": 20}
FREE = {"type": "string"}
# Edge cases both libraries should get right, as (label, schema, how to build the token ids from the
# tokenizer, whether the text is valid): a JSON escape inside a length-bounded string (valid), a raw
# control character there (invalid JSON: json.loads refuses it), a special token of the chat format
# inside a free string (the library should never offer one), and one of the padding rows past the
# real vocabulary that our GGUF-written tokenizer.json spells as the text "[PADn]" (Qwen2.5 only).
PROBES = [
    (
        "escape in a maxLength string",
        BOUNDED,
        lambda hf: hf.encode(json.dumps('say "hi"'), add_special_tokens=False),
        True,
    ),
    (
        "raw tab in a maxLength string",
        BOUNDED,
        lambda hf: hf.encode('"a\tb"', add_special_tokens=False),
        False,
    ),
    ("special token in a string", FREE, lambda hf: _around(hf, _special_id(hf)), False),
    ("pad row in a string", FREE, lambda hf: _around(hf, _pad_id(hf)), False),
]


def _special_id(hf) -> int | None:
    """A special token of the chat format that is not the end token."""
    for text in ("<|im_start|>", "<start_of_turn>"):
        i = hf.convert_tokens_to_ids(text)
        if isinstance(i, int) and i != hf.unk_token_id:
            return i
    return None


def _pad_id(hf) -> int | None:
    """The first padding row of the vocabulary, if the tokenizer has any ("[PAD151665]" in Qwen2.5's)."""
    pads = [i for t, i in hf.get_vocab().items() if re.fullmatch(r"\[PAD\d+\]", t)]
    return min(pads) if pads else None


def _around(hf, token: int | None) -> list[int] | None:
    """`"x` + token + `"`: one token placed inside a JSON string (None if there is no such token)."""
    if token is None:
        return None
    return hf.encode('"x', add_special_tokens=False) + [token] + hf.encode('"', add_special_tokens=False)


def grammars() -> list[tuple[str, str, object, str, list]]:
    """Every grammar as (name, kind, spec, answer text, wrong continuations), each answer checked
    against its grammar first (jsonschema for the schemas, re.fullmatch for the regex)."""
    from jsonschema import Draft202012Validator

    out = []
    for name, schema, instance, bad in SCHEMAS:
        Draft202012Validator.check_schema(schema)
        Draft202012Validator(schema).validate(instance)
        out.append((name, "json_schema", schema, json.dumps(instance), [b for b in bad if b[1]]))
    for name, kind, spec, text, bad in OTHERS:
        if kind == "regex":
            assert re.fullmatch(spec, text), (name, text)
        if kind == "choice":
            assert text in spec
        if kind == "json_object":
            assert isinstance(json.loads(text), dict)
        out.append((name, kind, spec, text, [b for b in bad if b[1]]))
    return out


def logits_rows(model: str) -> int:
    """The model's vocabulary as its logits see it (config.json's vocab_size, or its text_config's)."""
    config = json.loads((MODELS_DIR / model / "config.json").read_text())
    return config.get("vocab_size") or config["text_config"]["vocab_size"]


def ns() -> int:
    """The clock every figure here is read from."""
    return time.perf_counter_ns()


def pct(values: list[float], q: float) -> float:
    """The q-quantile of `values` (nearest rank); q=0.5 is the median."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def allowed(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    """A (vocab,) bool tensor of the tokens one bitmask row allows (bit j of word i is token 32i+j)."""
    shifts = torch.arange(32, dtype=torch.int32)
    return (((bitmask_row.view(-1, 1) >> shifts) & 1).view(-1)[:vocab]).bool()


class Xgr:
    """xgrammar behind the calls this script needs: compile a grammar, make a matcher, fill a row,
    fill a batch, apply, advance."""

    name = "xgrammar"

    def __init__(self, hf_tokenizer, vocab: int):
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        t = ns()
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab)
        self.tokenizer_ms = (ns() - t) / 1e6
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=THREADS, cache_enabled=True)
        self.batch = xgr.BatchGrammarMatcher(max_threads=THREADS)
        self.eos = list(self.info.stop_token_ids)

    def about(self) -> str:
        """What the tokenizer object made of the vocabulary."""
        i = self.info
        return f"; {i.vocab_type.name}, {len(i.special_token_ids)} tokens taken as special"

    def compile(self, kind: str, spec):
        """The compiled grammar (cached by the compiler: a second call with the same spec hits)."""
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=True)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in spec))
        return c.compile_grammar(spec[0])

    def matcher(self, compiled):
        """A fresh matcher at the grammar's start."""
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, rows: int) -> torch.Tensor:
        """An int32 (rows, ceil(vocab / 32)) bitmask."""
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of the bitmask from matcher m."""
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms: list, bitmask: torch.Tensor) -> None:
        """Every row at once, on the batch matcher's threads."""
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """-inf into the disallowed logits (xgrammar's native CPU kernel)."""
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def advance(self, m, token: int) -> bool:
        """Feed one token; False if the matcher refuses it."""
        return m.accept_token(token)

    def advance_batch(self, ms: list, tokens: list[int]) -> list[bool]:
        """Feed one token to each matcher in one call."""
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)

    def done(self, m) -> bool:
        """Has the matcher taken the end token?"""
        return m.is_terminated()

    def reset(self, m) -> None:
        """Back to the grammar's start."""
        m.reset()


class Llg:
    """llguidance behind the same calls. It has no compiled-grammar cache: building the matcher
    from the grammar string is the compile, and its lexer is built lazily while masks are filled."""

    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt, self.vocab = llguidance, llguidance.torch, vocab
        t = ns()
        self.tok = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab)
        self.tokenizer_ms = (ns() - t) / 1e6
        self.executor = llguidance.LLExecutor(num_threads=THREADS)
        self.eos = list(self.tok.eos_tokens)

    def about(self) -> str:
        """What the tokenizer object made of the vocabulary."""
        return f"; canonical {self.tok.is_canonical}"

    def grammar(self, kind: str, spec) -> str:
        """The llguidance grammar string for a spec (vLLM's defaults: flexible whitespace)."""
        M = self.llg.LLMatcher
        if kind == "json_schema":
            return M.grammar_from_json_schema(json.dumps(spec), defaults={"whitespace_flexible": True})
        if kind == "json_object":
            return M.grammar_from_json_schema('{"type": "object"}', defaults={"whitespace_flexible": True})
        if kind == "regex":
            return M.grammar_from_regex(spec)
        if kind == "choice":
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in spec))
        return M.grammar_from_lark(spec[1])

    def compile(self, kind: str, spec):
        """A matcher built from the grammar; raises with the library's message if it is refused."""
        m = self.llg.LLMatcher(self.tok, self.grammar(kind, spec), log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return (kind, spec, m)

    def matcher(self, compiled):
        """A fresh matcher at the grammar's start: a copy of the compiled one."""
        return compiled[2].deep_copy()

    def bitmask(self, rows: int) -> torch.Tensor:
        """An int32 (rows, ceil(vocab / 32)) bitmask."""
        return self.lt.allocate_token_bitmask(rows, self.vocab)

    def fill(self, m, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of the bitmask from matcher m."""
        self.lt.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms: list, bitmask: torch.Tensor) -> None:
        """Every row at once, on the executor's threads."""
        self.lt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """-inf into the disallowed logits (llguidance's torch.compile'd kernel)."""
        self.lt.apply_token_bitmask_inplace(logits, bitmask)

    def advance(self, m, token: int) -> bool:
        """Feed one token; False if the matcher refuses it."""
        return m.consume_token(token)

    def advance_batch(self, ms: list, tokens: list[int]) -> list[bool]:
        """Feed one token to each matcher in one call."""
        return self.lt.consume_token_par(self.executor, list(zip(ms, tokens)))

    def done(self, m) -> bool:
        """Has the matcher taken the end token?"""
        return m.is_stopped()

    def reset(self, m) -> None:
        """Back to the grammar's start."""
        m.reset()


def measure_compile(lib, items, model: str, rows: list[dict]) -> dict:
    """Compile every grammar cold, then again, then time a matcher's first mask; returns the
    compiled grammars by name (a refused one is reported and left out)."""
    lib.compile("json_schema", {"type": "object", "properties": {"warm": INT}})  # one-off set-up costs
    compiled, bm = {}, lib.bitmask(1)
    for name, kind, spec, _, _ in items:
        t = ns()
        try:
            c = lib.compile(kind, spec)
        except Exception as e:  # a feature the library refuses is a finding, not a crash
            msg = " ".join(str(e).split())[:300]
            print(f"  {lib.name}: {name} refused: {msg}")
            rows.append(
                dict(
                    section="compile", model=model, library=lib.name, grammar=name, metric="refused", note=msg
                )
            )
            continue
        cold = (ns() - t) / 1e6
        t = ns()
        lib.compile(kind, spec)
        again = (ns() - t) / 1e6
        t = ns()
        m = lib.matcher(c)
        lib.fill(m, bm, 0)
        first = (ns() - t) / 1e6
        compiled[name] = c
        for metric, value in (("cold_ms", cold), ("again_ms", again), ("first_mask_ms", first)):
            rows.append(
                dict(
                    section="compile",
                    model=model,
                    library=lib.name,
                    grammar=name,
                    metric=metric,
                    value=round(value, 4),
                )
            )
    return compiled


def walk(lib, m, tokens: list[int], bm: torch.Tensor, vocab: int, masks: list | None) -> tuple[int, int]:
    """Feed `tokens` one by one, checking each is allowed by the mask first; returns (how many
    went in, the index of the first refused by the mask or -1). With `masks`, each state's
    allowed set is appended to it (for comparing the libraries)."""
    for i, tok in enumerate(tokens):
        lib.fill(m, bm, 0)
        ok = allowed(bm[0], vocab)
        if masks is not None:
            masks.append(ok)
        if not ok[tok]:
            return i, i
        if not lib.advance(m, tok):
            return i, -2  # allowed by the mask but refused by the matcher: a library bug
    return len(tokens), -1


def check(libs, compiled, items, hf, vocab: int, model: str, rows: list[dict]) -> dict:
    """Correctness and agreement: every answer goes through with each next token (and finally the
    end token) allowed; every planted wrong continuation is refused; and the two libraries' masks
    are compared at every state of every answer."""
    summary = dict(answers_ok=0, answers=0, wrong_refused=0, wrong=0, states=0, count_diff=0, mask_diff=0)
    summary.update(first_narrower=0, second_narrower=0, neither_narrower=0)
    examples, failed = [], set()
    bms = {lib.name: lib.bitmask(1) for lib in libs}
    for name, _, _, text, bad in items:
        if not all(name in compiled[lib.name] for lib in libs):
            continue
        tokens = hf.encode(text, add_special_tokens=False)
        masks = {}
        for lib in libs:
            m, bm = lib.matcher(compiled[lib.name][name]), bms[lib.name]
            seq = []
            went, refused = walk(lib, m, tokens + [lib.eos[0]], bm, vocab, seq)
            masks[lib.name] = seq
            ok = went == len(tokens) + 1 and lib.done(m)
            summary["answers"] += 1
            summary["answers_ok"] += ok
            if not ok:
                failed.add(name)
                where = hf.decode(tokens[:went])
                print(f"  FAIL {lib.name} {name}: answer refused at token {went} after {where!r} ({refused})")
            rows.append(
                dict(
                    section="check",
                    model=model,
                    library=lib.name,
                    grammar=name,
                    metric="answer_ok",
                    value=int(ok),
                )
            )
            for prefix, wrong in bad:
                m = lib.matcher(compiled[lib.name][name])
                p = hf.encode(prefix, add_special_tokens=False) if prefix else []
                w = hf.encode(wrong, add_special_tokens=False)
                went, _ = walk(lib, m, p, bm, vocab, None)
                if went < len(p):
                    print(f"  BAD TEST {lib.name} {name}: prefix {prefix!r} refused at token {went}")
                    continue
                _, refused = walk(lib, m, w, bm, vocab, None)
                summary["wrong"] += 1
                summary["wrong_refused"] += refused >= 0
                if refused < 0:
                    print(f"  FAIL {lib.name} {name}: wrong {wrong!r} after {prefix!r} was accepted")
                rows.append(
                    dict(
                        section="check",
                        model=model,
                        library=lib.name,
                        grammar=name,
                        metric="wrong_refused_at_token",
                        value=refused,
                        note=f"{prefix!r} + {wrong!r}",
                    )
                )
        if len(libs) < 2:
            continue
        a, b = (masks[lib.name] for lib in libs)
        for step, (x, y) in enumerate(zip(a, b)):
            summary["states"] += 1
            if int(x.sum()) != int(y.sum()):
                summary["count_diff"] += 1
            diff = (x ^ y).nonzero().view(-1).tolist()
            if diff:
                summary["mask_diff"] += 1
                only_x = [t for t in diff if x[t]]
                only_y = [t for t in diff if y[t]]
                narrower = "second" if not only_y else "first" if not only_x else "neither"
                summary[f"{narrower}_narrower"] += 1
                shown = ", ".join(
                    f"{who} only {len(ts)}: " + " ".join(repr(hf.decode([t])) for t in ts[:4])
                    for who, ts in ((libs[0].name, only_x), (libs[1].name, only_y))
                    if ts
                )
                note = (
                    f"after {hf.decode(tokens[:step])!r}: {int(x.sum())} vs {int(y.sum())} allowed; {shown}"
                )
                examples.append((name, note))
                rows.append(
                    dict(section="disagree", model=model, grammar=name, metric="state", value=step, note=note)
                )
    for label, schema, build, valid in PROBES:
        tokens = build(hf)
        if tokens is None:
            continue
        said = []
        for lib in libs:
            m, bm = lib.matcher(lib.compile("json_schema", schema)), bms[lib.name]
            went, refused = walk(lib, m, tokens + [lib.eos[0]], bm, vocab, None)
            ok = (went == len(tokens) + 1 and lib.done(m)) if valid else 0 <= refused < len(tokens)
            summary["probes"] = summary.get("probes", 0) + 1
            summary["probes_ok"] = summary.get("probes_ok", 0) + ok
            said.append(f"{lib.name} {'right' if ok else 'WRONG'}")
            rows.append(
                dict(
                    section="probe",
                    model=model,
                    library=lib.name,
                    grammar=label,
                    metric="right",
                    value=int(ok),
                )
            )
        shown = hf.decode(tokens)
        print(f"  probe {label} ({shown!r}, {'valid' if valid else 'invalid'}): {', '.join(said)}")
    for key, value in summary.items():
        rows.append(dict(section="check", model=model, metric=key, value=value))
    summary["failed"] = failed
    seen = set()
    for name, note in examples:
        if name not in seen:  # one example a grammar
            seen.add(name)
            print(f"  differ {name}: {note}")
    return summary


def measure_steps(lib, compiled, items, hf, vocab: int, steps: int, batched: bool, skip=()) -> dict:
    """16 matchers of different grammars advanced together for `steps` steps, in batches that cover
    every grammar (but those in `skip`, whose answer a library refused); each step's fill, apply and
    advance timed apart, in microseconds."""
    names = [n for n, *_ in items if n in compiled and n not in skip]
    answers = {n: hf.encode(t, add_special_tokens=False) + [lib.eos[0]] for n, _, _, t, _ in items}
    batches = [[names[(s + i) % len(names)] for i in range(ROWS)] for s in range(0, len(names), ROWS)]
    bm = lib.bitmask(ROWS)
    source = torch.randn(ROWS, vocab)
    logits = source.clone()
    times = {"fill": [], "apply": [], "advance": [], "mask": []}
    for batch in batches:
        ms = [lib.matcher(compiled[n]) for n in batch]
        pos = [0] * ROWS
        for _ in range(steps):
            logits.copy_(source)
            t0 = ns()
            if batched:
                lib.fill_batch(ms, bm)
            else:
                for i, m in enumerate(ms):
                    lib.fill(m, bm, i)
            t1 = ns()
            lib.apply(logits, bm)
            t2 = ns()
            tokens = [answers[n][p] for n, p in zip(batch, pos)]
            if batched:
                ok = lib.advance_batch(ms, tokens)
            else:
                ok = [lib.advance(m, tok) for m, tok in zip(ms, tokens)]
            t3 = ns()
            assert all(ok), f"{lib.name}: a matcher refused its answer's token"
            picked = logits.gather(1, torch.tensor(tokens).view(-1, 1))
            assert torch.isfinite(picked).all(), f"{lib.name}: the mask removed an answer's token"
            times["fill"].append((t1 - t0) / 1e3)
            times["apply"].append((t2 - t1) / 1e3)
            times["mask"].append((t2 - t0) / 1e3)
            times["advance"].append((t3 - t2) / 1e3)
            for i, n in enumerate(batch):
                pos[i] += 1
                if pos[i] == len(answers[n]):  # took the end token: start the answer over
                    lib.reset(ms[i])
                    pos[i] = 0
    return times


def sampler_us(vocab: int, repeats: int = 200) -> list[float]:
    """What nanoserve's sampler takes for 16 greedy rows of this vocabulary (microseconds a call)."""
    logits = torch.randn(ROWS, vocab)
    params, gens = [SamplingParams(temperature=0.0) for _ in range(ROWS)], [None] * ROWS
    for _ in range(10):
        sample_rows(logits, params, gens)
    out = []
    for _ in range(repeats):
        t = ns()
        sample_rows(logits, params, gens)
        out.append((ns() - t) / 1e3)
    return out


def run_model(model: str, items, steps: int, rows: list[dict]) -> None:
    """Everything for one model's tokenizer: both libraries' tokenizers, compile, check, steps."""
    from transformers import AutoTokenizer

    vocab = logits_rows(model)
    hf = AutoTokenizer.from_pretrained(MODELS_DIR / model)
    print(f"\n== {model}: tokenizer {len(hf):,} tokens, logits {vocab:,} rows, end token {hf.eos_token_id}")
    libs = []
    for cls in (Xgr, Llg):
        try:
            lib = cls(hf, vocab)
        except Exception as e:
            print(f"  {cls.name}: tokenizer did not convert: {e}")
            rows.append(
                dict(section="tokenizer", model=model, library=cls.name, metric="failed", note=str(e)[:300])
            )
            continue
        libs.append(lib)
        print(
            f"  {lib.name}: tokenizer object built in {lib.tokenizer_ms:,.0f} ms; "
            f"end tokens {lib.eos}{lib.about()}"
        )
        rows.append(
            dict(
                section="tokenizer",
                model=model,
                library=lib.name,
                metric="build_ms",
                value=round(lib.tokenizer_ms, 1),
            )
        )
    compiled = {lib.name: measure_compile(lib, items, model, rows) for lib in libs}
    for lib in libs:
        vals = {
            metric: [
                r["value"]
                for r in rows
                if r.get("metric") == metric and r["model"] == model and r.get("library") == lib.name
            ]
            for metric in ("cold_ms", "again_ms", "first_mask_ms")
        }
        js = [
            r["value"]
            for r in rows
            if r.get("metric") == "cold_ms"
            and r["model"] == model
            and r.get("library") == lib.name
            and r["grammar"] in {s[0] for s in SCHEMAS}
        ]
        med = {k: statistics.median(v) for k, v in vals.items()}
        top = {k: max(v) for k, v in vals.items()}
        print(
            f"  {lib.name:10s} compile ms: schemas cold median {statistics.median(js):.2f} "
            f"max {max(js):.2f}; all cold median {med['cold_ms']:.2f} max {top['cold_ms']:.2f}; "
            f"again median {med['again_ms']:.3f}; first mask median {med['first_mask_ms']:.3f} "
            f"max {top['first_mask_ms']:.3f}"
        )
        for metric, v in (("schema_cold_ms", js), *vals.items()):
            for q, label in ((0.5, "median"), (1.0, "max")):
                rows.append(
                    dict(
                        section="compile",
                        model=model,
                        library=lib.name,
                        grammar="*",
                        metric=f"{metric}_{label}",
                        value=round(pct(v, q), 4),
                    )
                )
    summary = check(libs, compiled, items, hf, vocab, model, rows)
    print(
        f"  check: {summary['answers_ok']}/{summary['answers']} answers went through, "
        f"{summary['wrong_refused']}/{summary['wrong']} wrong continuations refused; "
        f"masks compared at {summary['states']} states: {summary['count_diff']} differ in count, "
        f"{summary['mask_diff']} in the set"
    )
    if len(libs) == 2 and summary["mask_diff"]:
        print(
            f"  where they differ, {libs[1].name} allows a subset of {libs[0].name}'s tokens at "
            f"{summary['second_narrower']} states, the reverse at {summary['first_narrower']}, "
            f"neither at {summary['neither_narrower']}"
        )
    samp = sampler_us(vocab)
    s50, s99 = pct(samp, 0.5), pct(samp, 0.99)
    print(f"  sampler, 16 greedy rows: median {s50:,.0f} us, p99 {s99:,.0f} us")
    rows += [
        dict(section="sampler", model=model, metric="median_us", value=round(s50, 1)),
        dict(section="sampler", model=model, metric="p99_us", value=round(s99, 1)),
    ]
    print(
        f"  {'16-row step, us':28s} {'fill':>15s} {'apply':>15s} {'mask':>15s} {'advance':>15s}  mask/sampler"
    )
    for lib in libs:
        t = ns()
        lib.apply(torch.randn(ROWS, vocab), lib.bitmask(ROWS))  # llguidance's kernel compiles on first use
        first = (ns() - t) / 1e6
        print(f"  {lib.name} first apply (any kernel compile): {first:,.0f} ms")
        rows.append(
            dict(
                section="step", model=model, library=lib.name, metric="first_apply_ms", value=round(first, 1)
            )
        )
        for batched in (False, True):
            how = "batch" if batched else "loop"
            times = measure_steps(
                lib, compiled[lib.name], items, hf, vocab, steps, batched, summary["failed"]
            )
            cells = []
            for part in ("fill", "apply", "mask", "advance"):
                p50, p99 = pct(times[part], 0.5), pct(times[part], 0.99)
                cells.append(f"{p50:7,.0f}/{p99:7,.0f}")
                rows += [
                    dict(
                        section="step",
                        model=model,
                        library=lib.name,
                        grammar=how,
                        metric=f"{part}_median_us",
                        value=round(p50, 1),
                    ),
                    dict(
                        section="step",
                        model=model,
                        library=lib.name,
                        grammar=how,
                        metric=f"{part}_p99_us",
                        value=round(p99, 1),
                    ),
                ]
            ratio = pct(times["mask"], 0.5) / s50
            rows.append(
                dict(
                    section="step",
                    model=model,
                    library=lib.name,
                    grammar=how,
                    metric="mask_over_sampler",
                    value=round(ratio, 3),
                )
            )
            print(
                f"  {lib.name + ' ' + how:28s} {' '.join(cells)}  {ratio:.2f}x  ({len(times['mask'])} steps)"
            )


def main(argv=None) -> None:
    """Print the set-up, run every model, write the CSV."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument(
        "--steps", type=int, default=160, help="steps each batch of 16 rows runs (rows restart when done)"
    )
    ap.add_argument("--out", default=str(HERE / "grammars.csv"))
    args = ap.parse_args(argv)
    torch.set_num_threads(THREADS)
    versions = {
        p: metadata.version(p) for p in ("xgrammar", "llguidance", "torch", "transformers", "tokenizers")
    }
    print(cpu_line())
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    items = grammars()
    print(f"{len(items)} grammars: {len(SCHEMAS)} JSON schemas, " + ", ".join(n for n, *_ in OTHERS))
    rows = [dict(section="env", metric="cpu", note=cpu_line())]
    rows += [dict(section="env", library=k, metric="version", note=v) for k, v in versions.items()]
    for model in args.models:
        run_model(model, items, args.steps, rows)
    print(f"\nwrote {write_csv(rows, args.out)}")


if __name__ == "__main__":
    main()

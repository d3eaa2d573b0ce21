"""Structured output (issue 32): a grammar a request, a token mask a step.

A request may constrain what it generates: `response_format` `{"type": "json_object"}` (any JSON
object) or `{"type": "json_schema", "json_schema": {"schema": ...}}`, and vLLM's `guided_json`
(a schema), `guided_regex`, `guided_choice` (one of a list of strings) and `guided_grammar` (a
context-free grammar in llguidance's Lark dialect). Each becomes a `Guided` (a kind and its text)
in `SamplingParams.guided`.

The grammar library is llguidance (evals/grammars.py measured it against xgrammar on this CPU:
every grammar compiled in under 1.6 ms where xgrammar took up to 91 ms, and it kept JSON strings
valid where xgrammar let a raw tab through and mis-bounded an escaped quote; xgrammar fills a
mask faster). It works in bytes over our own vocabulary: `Grammars` hands it the tokenizer's
tokenizer.json, so the mask is computed for exactly the token ids our engine samples from, as
wide as the model's logits. A GGUF-converted Qwen2.5 spells its 271 padding rows (151,665 up)
as the text "[PADn]"; those entries are left out of what llguidance sees, so it never offers one
as text (it would, in any JSON string).

A request's life:
- the server compiles its grammar before the request reaches the engine thread
  (`Grammars.compile` in a worker thread, `serve.py`), so a slow or refused grammar costs the
  engine nothing; a grammar the library refuses is a 400 naming the request's field. The
  compiled grammar is kept in an LRU cache keyed by (kind, text), so the same schema is compiled
  once; each request then starts from a copy of the compiled matcher (`Grammars.matcher`).
- each step, for the rows that sample and have a matcher, llguidance fills one row of an int32
  bitmask each (bit t % 32 of word t / 32 set where token t may come next: a token that keeps
  the text a prefix of some answer, except where the grammar forces text, where llguidance
  allows only the first token of the tokenizer's own spelling of it, day 66; on its own threads,
  `LLExecutor`), and the sampler writes -inf into every refused logit before anything else
  (`apply_mask`, mask.cpp natively). Greedy and sampled rows alike then pick among the allowed
  tokens; rows without a grammar are untouched, and a step with none runs no op for this.
- the picked token is fed to the row's matcher (`advance`). When the grammar is complete the
  mask allows only the end tokens, so the row stops with finish_reason "stop"; when max_tokens
  comes first the answer is cut, as any other ("length").

Scores (`logprobs`) stay those of the raw distribution, as vLLM reports them: a constrained
token is scored by what the model gave it, not renormalized over the allowed set (sampling.py).

JSON is written compactly by the schema's order, `{"a": 1, "b": [2, 3]}` (llguidance's default
separators, no free whitespace): a small model given free whitespace can spend its tokens on
newlines, which is vLLM's `disable-any-whitespace` problem; here it cannot.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from nanoserve.sampling import InvalidParam

KINDS = ("json", "json_object", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled grammars kept (each a few hundred kB at most)
# JSON as json.dumps writes it, `{"a": 1, "b": [2, 3]}`: no free whitespace (the module doc)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PAD_TOKEN = re.compile(r"\[PAD\d+\]")  # a GGUF's padding rows, as gguf_file.py writes them


@dataclass(frozen=True)
class Guided:
    """A request's constraint: `kind` (one of KINDS) and its text (`spec`: the schema as JSON,
    the regex, the choices as a JSON list, the Lark grammar; empty for
    json_object; a schema keeps its properties' order, which is the order they are written in).
    `param` is the request field it came from, which a refusal names; it is not
    part of the cache key."""

    kind: str
    spec: str = ""
    param: str = field(default="guided_json", compare=False)

    @classmethod
    def json_schema(cls, schema, param: str = "guided_json") -> Guided:
        """A JSON schema, given as a dict (or True) or as its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidParam(param, f"{param} is not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidParam(
                param, f"{param} must be a JSON schema (an object), got {type(schema).__name__}"
            )
        return cls("json", json.dumps(schema, ensure_ascii=False), param)

    @classmethod
    def choice(cls, choices, param: str = "guided_choice") -> Guided:
        if (
            not isinstance(choices, (list, tuple))
            or not choices
            or not all(isinstance(c, str) for c in choices)
        ):
            raise InvalidParam(param, f"{param} must be a non-empty list of strings")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), param)

    @classmethod
    def text(cls, kind: str, source, param: str) -> Guided:
        """A regex or a Lark grammar."""
        if not isinstance(source, str) or not source:
            raise InvalidParam(param, f"{param} must be a non-empty string")
        return cls(kind, source, param)

    def grammar(self) -> str:
        """llguidance's grammar text for this constraint."""
        import llguidance

        M = llguidance.LLMatcher
        if self.kind == "json":
            return M.grammar_from_json_schema(self.spec, defaults=JSON_LAYOUT)
        if self.kind == "json_object":
            return M.grammar_from_json_schema('{"type": "object"}', defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return M.grammar_from_regex(self.spec)
        if self.kind == "choice":
            # each choice a Lark string literal; json.dumps writes the escapes Lark reads
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.spec)))
        if self.kind == "grammar":
            return M.grammar_from_lark(self.spec)
        raise InvalidParam(self.param, f"unknown constraint kind {self.kind!r}; one of {', '.join(KINDS)}")


def guided_from_request(
    response_format=None, guided_json=None, guided_regex=None, guided_choice=None, guided_grammar=None
) -> Guided | None:
    """The request's one constraint, or None. More than one is refused (which would win is not
    obvious, and vLLM refuses it too)."""
    given = [
        (name, value)
        for name, value in (
            ("guided_json", guided_json),
            ("guided_regex", guided_regex),
            ("guided_choice", guided_choice),
            ("guided_grammar", guided_grammar),
        )
        if value is not None
    ]
    fmt = None
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "json_object":
            fmt = Guided("json_object", "", "response_format")
        elif kind == "json_schema":
            wrapper = response_format.get("json_schema")
            schema = wrapper.get("schema") if isinstance(wrapper, dict) else None
            if schema is None:
                raise InvalidParam(
                    "response_format", "response_format json_schema needs json_schema.schema, the JSON schema"
                )
            fmt = Guided.json_schema(schema, "response_format")
        elif kind != "text":
            raise InvalidParam(
                "response_format",
                f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            )
        if fmt is not None:
            given.append(("response_format", fmt))
    if len(given) > 1:
        raise InvalidParam(given[1][0], f"give one constraint, not {' and '.join(n for n, _ in given)}")
    if not given:
        return None
    name, value = given[0]
    if name == "response_format":
        return value
    if name == "guided_json":
        return Guided.json_schema(value, name)
    if name == "guided_choice":
        return Guided.choice(value, name)
    return Guided.text("regex" if name == "guided_regex" else "grammar", value, name)


def llg_tokenizer_json(tokenizer_json: str) -> str:
    """The tokenizer.json llguidance is given: ours without the GGUF's "[PADn]" padding rows
    (the module doc), so those ids are no token at all to it, as they are to Hugging Face's."""
    data = json.loads(tokenizer_json)
    vocab = data.get("model", {}).get("vocab")
    if isinstance(vocab, dict):
        pads = [t for t in vocab if PAD_TOKEN.fullmatch(t)]
        for t in pads:
            del vocab[t]
        if pads:
            return json.dumps(data, ensure_ascii=False)
    return tokenizer_json


class Grammars:
    """Compiled grammars for one tokenizer and vocabulary width: the llguidance tokenizer (built
    once, on first use: about a second for Qwen2.5's vocabulary), an LRU cache of compiled
    matchers, a worker thread for compiling off the engine thread, and the executor whose
    threads fill a step's masks."""

    def __init__(
        self, tokenizer, vocab_size: int, eos_ids=(), threads: int = 2, cache_size: int = CACHE_SIZE
    ):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_ids = sorted(eos_ids)
        self.threads, self.cache_size = threads, cache_size
        self.words = (vocab_size + 31) // 32
        self._llg = None
        self._executor = None
        self._cache: OrderedDict[Guided, object] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-grammar")
        self.compiled = self.hits = 0  # counters: grammars compiled, and compiles the cache saved

    def llg_tokenizer(self):
        with self._lock:
            if self._llg is None:
                import llguidance

                if self.tokenizer is None:
                    raise ValueError("this engine has no tokenizer, so it cannot constrain its output")
                text = llg_tokenizer_json(self.tokenizer.backend.to_str())
                eos = self.eos_ids or None
                self._llg = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
                self._executor = llguidance.LLExecutor(num_threads=self.threads)
            return self._llg

    def compile(self, guided: Guided):
        """The compiled matcher for `guided` (cached); an InvalidParam naming guided.param if the
        library refuses the grammar. Safe from any thread."""
        with self._lock:
            if guided in self._cache:
                self._cache.move_to_end(guided)
                self.hits += 1
                return self._cache[guided]
        import llguidance

        tok = self.llg_tokenizer()
        try:
            matcher = llguidance.LLMatcher(tok, guided.grammar(), log_level=0)
        except (ValueError, TypeError, RuntimeError) as e:
            raise InvalidParam(guided.param, f"{guided.param} could not be compiled: {e}") from None
        if matcher.is_error():
            raise InvalidParam(guided.param, f"{guided.param} could not be compiled: {matcher.get_error()}")
        with self._lock:
            self.compiled += 1
            self._cache[guided] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def compile_async(self, guided: Guided) -> Future:
        """`compile` on the grammar thread (the server awaits it before the engine sees the request)."""
        return self._pool.submit(self.compile, guided)

    def matcher(self, guided: Guided):
        """A fresh matcher at the grammar's start, for one sequence."""
        return self.compile(guided).deep_copy()

    def fill(self, matchers: list) -> torch.Tensor:
        """The masks of `matchers`' next tokens, one row each: an int32 (len, words) bitmask. A
        matcher whose grammar is complete allows only the end tokens (llguidance's rule); the
        engine's every end token is allowed there, not only the tokenizer's first."""
        self.llg_tokenizer()
        bitmask = torch.zeros(len(matchers), self.words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), self.words * 4, len(matchers)
        )
        for i, m in enumerate(matchers):
            if m.is_accepting():
                for e in self.eos_ids:
                    bitmask[i, e // 32] |= _bit(e % 32)
        return bitmask

    @staticmethod
    def advance(matcher, token: int) -> str | None:
        """Feed the sampled token; a sentence if the matcher refuses it (a mask and a sampler that
        disagree: a bug, reported on the row rather than hidden)."""
        if matcher.is_stopped():
            return None  # the end token was taken; nothing more comes
        if not matcher.consume_token(token):
            # llguidance's error is a multi-line parser dump ending in the grammar; its first line says it
            why = (matcher.get_error() or "not allowed here").strip().splitlines()[0][:200]
            return f"the grammar refused token {token} ({why})"
        return None


def _bit(k: int) -> int:
    """Bit k of an int32 word, as a Python int that fits one (bit 31 is the sign)."""
    return -(2**31) if k == 31 else 1 << k


def mask_allows(bitmask_row: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def apply_mask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Write -inf into every logit of `rows` whose bit in that row of `bitmask` is clear, in place
    (logits fp32 (B, V), bitmask int32 (len(rows), words)). The native kernel where there is one;
    otherwise the bits unpacked by torch ops (the same result, ~7 ms for 16 rows of Qwen2.5's
    vocabulary on 2 cores against ~0.3 ms)."""
    from nanoserve.kernels import native

    index = torch.tensor(rows, dtype=torch.long)
    ext = native()
    if ext is not None and hasattr(ext, "apply_token_bitmask") and logits.is_contiguous():
        ext.apply_token_bitmask(logits, index, bitmask.contiguous())
        return
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

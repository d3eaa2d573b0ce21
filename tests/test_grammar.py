"""grammar.py: structured output, a token mask a step (issue 32).

The mask itself (native kernel against torch ops, a planted bit order caught), the request's
fields to one `Guided` (and each refusal naming its field), the padding rows of a GGUF-converted
Qwen2.5 kept out of llguidance's view, and the engine: a random-weight model with SmolLM2's real
tokenizer answers only JSON that validates, greedy and sampled, batched with unconstrained rows
that keep their own tokens; scores stay those of the raw distribution. The 50 schemas with
Qwen2.5-Coder through the server are evals/schemas.py; the server's refusals are in
tests/test_serve.py's BAD list too.
"""

import json

import jsonschema
import pytest
import torch

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.grammar import (
    Grammars,
    Guided,
    apply_mask,
    guided_from_request,
    llg_tokenizer_json,
    mask_allows,
)
from nanoserve.kernels import native
from nanoserve.sampling import InvalidParam, SamplingParams, sample_rows
from nanoserve.tokenizer import Tokenizer
from tests.test_model import make_tiny_dir, ours_from_dir

# --- the mask -------------------------------------------------------------------------------------


def torch_mask(logits, rows, bitmask):
    """The reference: bit t % 32 of word t // 32 of a row's mask, set where token t is allowed."""
    out = logits.clone()
    for j, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [64, 100, 129])
def test_apply_mask_writes_minus_inf_where_a_bit_is_clear(vocab, monkeypatch):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, words), dtype=torch.int32, generator=g)
    bitmask[1, 0] = -1  # a whole word allowed
    logits = torch.randn(4, vocab, generator=g)
    want = torch_mask(logits, [3, 1], bitmask)
    got = logits.clone()
    apply_mask(got, [3, 1], bitmask)
    assert torch.equal(got, want)
    if native() is not None:  # the torch-ops fallback gives the same
        monkeypatch.setattr("nanoserve.kernels.native", lambda: None)
        fallback = logits.clone()
        apply_mask(fallback, [3, 1], bitmask)
        assert torch.equal(fallback, want)
    # a planted wrong bit order (most significant bit first) is caught by the same comparison
    flipped = torch.tensor([[_reverse32(int(w)) for w in row] for row in bitmask.tolist()], dtype=torch.int32)
    wrong = logits.clone()
    apply_mask(wrong, [3, 1], flipped)
    assert not torch.equal(wrong, want)


def _reverse32(word: int) -> int:
    bits = f"{word & 0xFFFFFFFF:032b}"[::-1]
    value = int(bits, 2)
    return value - 2**32 if value >= 2**31 else value


def test_masked_rows_are_sampled_inside_the_mask_and_the_others_untouched():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=g)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 5  # only token 37
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=1), SamplingParams()]
    gens = [None, params[1].make_generator(), None]
    tokens = sample_rows(logits, params, gens, masks=([1], bitmask))
    assert tokens[1] == 37
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    # the input logits are not touched (the engine scores tokens under them)
    assert torch.isfinite(logits).all()


# --- what a request asks --------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_each_field_becomes_one_constraint():
    assert guided_from_request() is None
    assert guided_from_request({"type": "text"}) is None
    assert guided_from_request({"type": "json_object"}).kind == "json_object"
    g = guided_from_request({"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    assert (g.kind, json.loads(g.spec), g.param) == ("json", SCHEMA, "response_format")
    assert guided_from_request(guided_json=json.dumps(SCHEMA)) == Guided("json", json.dumps(SCHEMA))
    assert guided_from_request(guided_regex="a+").kind == "regex"
    assert guided_from_request(guided_choice=["x", "y"]).kind == "choice"
    assert guided_from_request(guided_grammar='start: "x"').kind == "grammar"
    # properties keep the order they are written in (it is the order they are generated in)
    ordered = guided_from_request(guided_json={"properties": {"b": {}, "a": {}}})
    assert ordered.spec.index('"b"') < ordered.spec.index('"a"')


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
        (dict(guided_json="{not json"), "guided_json"),
        (dict(guided_json=[1, 2]), "guided_json"),
        (dict(guided_choice=[]), "guided_choice"),
        (dict(guided_choice=["a", 1]), "guided_choice"),
        (dict(guided_regex=""), "guided_regex"),
        (dict(guided_json=SCHEMA, guided_regex="a"), "guided_regex"),
        (dict(response_format={"type": "json_object"}, guided_choice=["a"]), "response_format"),
    ],
)
def test_a_bad_request_is_a_sentence_naming_its_field(kwargs, param):
    with pytest.raises(InvalidParam) as e:
        guided_from_request(**kwargs)
    assert e.value.param == param and str(e.value)


@pytest.fixture(scope="module")
def smollm_tokenizer(smollm_dir):
    return Tokenizer.from_dir(smollm_dir)


@pytest.fixture(scope="module")
def grammars(smollm_tokenizer):
    return Grammars(smollm_tokenizer, 49152, smollm_tokenizer.eos_ids)


@pytest.mark.parametrize(
    "guided",
    [
        Guided("json", '{"type": "nonsense"}', "guided_json"),
        Guided("json", '{"type": "string", "format": "no-such-format"}', "response_format"),
        Guided("regex", "(ab", "guided_regex"),
        Guided("grammar", "start: undefined_rule", "guided_grammar"),
    ],
)
def test_a_grammar_the_library_refuses_is_an_invalid_param(grammars, guided):
    with pytest.raises(InvalidParam) as e:
        grammars.compile(guided)
    assert e.value.param == guided.param and "could not be compiled" in str(e.value)


def test_compiled_grammars_are_cached_by_kind_and_text(grammars):
    g = Guided("regex", "[0-9]{3}", "guided_regex")
    before = grammars.compiled
    first = grammars.compile(g)
    assert grammars.compile(Guided("regex", "[0-9]{3}", "guided_json")) is first  # the field aside
    assert grammars.compiled == before + 1
    assert grammars.compile_async(g).result() is first
    assert grammars.matcher(g) is not first  # each sequence its own state


def test_the_end_tokens_are_allowed_only_once_the_grammar_is_complete(grammars, smollm_tokenizer):
    m = grammars.matcher(Guided("regex", "[0-9]{3}", "guided_regex"))
    ids = smollm_tokenizer.encode("123", add_bos=False)
    eos = sorted(smollm_tokenizer.eos_ids)
    for t in ids[:-1]:
        assert not any(mask_allows(grammars.fill([m])[0], e) for e in eos)
        assert grammars.advance(m, t) is None
    assert grammars.advance(m, ids[-1]) is None
    row = grammars.fill([m])[0]
    assert all(mask_allows(row, e) for e in eos)
    assert not mask_allows(row, smollm_tokenizer.encode("4", add_bos=False)[0])
    # a token outside the mask is refused with a sentence
    m2 = grammars.matcher(Guided("regex", "[0-9]{3}", "guided_regex"))
    assert "refused" in grammars.advance(m2, smollm_tokenizer.encode("x", add_bos=False)[0])


@pytest.mark.slow
def test_qwens_padding_rows_are_never_offered():
    """A GGUF-converted Qwen2.5 spells rows 151,665-151,935 "[PADn]"; left in, llguidance offers
    them inside any JSON string (the planted check: the whole tokenizer.json)."""
    import llguidance

    from nanoserve.fetch import fetch_named_model

    tok = Tokenizer.from_dir(fetch_named_model("qwen2.5-coder-0.5b-instruct"))
    text = tok.backend.to_str()
    assert llg_tokenizer_json(text) != text
    grammars = Grammars(tok, 151936, tok.eos_ids)
    m = grammars.matcher(Guided("json", '{"type": "string"}'))
    for t in tok.encode('"ab', add_bos=False):
        assert grammars.advance(m, t) is None
    row = grammars.fill([m])[0]
    assert not any(mask_allows(row, t) for t in range(151665, 151936))
    assert mask_allows(row, tok.encode("cd", add_bos=False)[0])
    planted = llguidance.LLTokenizer(text, n_vocab=151936)
    pm = llguidance.LLMatcher(planted, Guided("json", '{"type": "string"}').grammar(), log_level=0)
    pm.consume_tokens(tok.encode('"ab', add_bos=False))
    bitmask = torch.zeros(1, grammars.words, dtype=torch.int32)
    pm.unsafe_compute_mask_ptr(bitmask.data_ptr(), grammars.words * 4)
    assert mask_allows(bitmask[0], 151665)


# --- the engine -----------------------------------------------------------------------------------

# every value bounded, so a random-weight model finishes within max_tokens
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "color", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    """A random-weight Llama as wide as SmolLM2's vocabulary: its tokens are noise, so only the
    grammar can make them JSON."""
    path = tmp_path_factory.mktemp("tiny-grammar")
    make_tiny_dir(path, seed=5, vocab_size=49152)
    return ours_from_dir(path)


def engine_of(model, tokenizer, max_batch=8):
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    return Engine(model, tokenizer, EngineConfig(max_batch=max_batch, kv_budget=per_block * 256))


PROMPTS = ["Write a person as JSON.", "Another one, please.", "JSON!"]


def test_noise_constrained_by_a_schema_is_valid_json_greedy_and_sampled(random_model, smollm_tokenizer):
    engine = engine_of(random_model, smollm_tokenizer)
    guided = Guided.json_schema(BOUNDED)
    answers = []
    for seed in range(4):
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, guided=guided)
        answers += engine.generate(PROMPTS, params, use_tqdm=False)
    answers += engine.generate(PROMPTS, SamplingParams(max_tokens=120, guided=guided), use_tqdm=False)
    for c in answers:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), BOUNDED)
    assert len({c.text for c in answers}) > 5  # sampled: different answers, each valid
    # without the grammar, the same noise is not JSON
    free = engine.generate(PROMPTS, SamplingParams(max_tokens=40), use_tqdm=False)
    assert not any(c.text.startswith("{") and c.text.endswith("}") for c in free)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_choice_regex_and_lark_constrain_the_noise(random_model, smollm_tokenizer):
    import re

    engine = engine_of(random_model, smollm_tokenizer)
    cases = [
        (Guided.choice(["alpha", "beta gamma"]), lambda t: t in ("alpha", "beta gamma")),
        (
            Guided.text("regex", r"[A-Z][a-z]{2,4}-\d{3}", "guided_regex"),
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,4}-\d{3}", t),
        ),
        (
            Guided.text("grammar", 'start: "(" num ("+" num)* ")"\nnum: /[1-9]/', "guided_grammar"),
            lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t),
        ),
    ]
    for guided, ok in cases:
        for seed in range(3):
            (c,) = engine.generate(
                ["x"],
                SamplingParams(max_tokens=30, temperature=1.0, seed=seed, guided=guided),
                use_tqdm=False,
            )
            assert ok(c.text), (guided.kind, c.text)


def test_rows_without_a_grammar_keep_their_tokens_beside_one(random_model, smollm_tokenizer):
    engine = engine_of(random_model, smollm_tokenizer)
    plain = [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True),
    ]
    alone = [engine.generate(["hello there"], p, use_tqdm=False)[0].token_ids for p in plain]
    ids = []
    for i, p in enumerate(plain):
        ids.append(engine.add_request("hello there", p))
        engine.add_request(
            PROMPTS[i],
            SamplingParams(max_tokens=60, temperature=1.0, seed=i, guided=Guided.json_schema(BOUNDED)),
        )
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got[i] for i in ids] == alone


def test_a_constrained_tokens_score_is_the_raw_distributions(random_model, smollm_tokenizer):
    """logprobs of a constrained answer are what the unconstrained model gives those tokens:
    scored again as a prompt (prompt_logprobs) without any grammar, they agree."""
    engine = engine_of(random_model, smollm_tokenizer)
    prompt = smollm_tokenizer.encode("Write a person as JSON.")

    def outputs(ids, params):
        rid = engine.add_request(ids, params)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.request_id == rid]
        return outs

    params = SamplingParams(max_tokens=40, logprobs=0, guided=Guided.json_schema(BOUNDED))
    outs = outputs(prompt, params)
    tokens = [t for o in outs for t in o.new_token_ids]
    got = [s.logprob for o in outs for s in o.logprobs]
    (first,) = outputs(prompt + tokens, SamplingParams(max_tokens=1, prompt_logprobs=0))[:1]
    raw = [s.logprob for s in first.prompt_logprobs[len(prompt) :]]
    assert len(raw) == len(tokens) and got == pytest.approx(raw, abs=1e-4)
    # renormalized over the allowed tokens, a forced token would score near 0; these do not
    assert min(got) < -1.0


def test_a_preempted_constrained_row_resumes_its_grammar(random_model, smollm_tokenizer):
    """A pool too small for eight rows preempts some; their matchers keep their state (the tokens
    already taken stay taken) and every answer still validates."""
    per_block = random_model.cfg.kv_bytes_per_token(random_model.dtype) * 16
    engine = Engine(random_model, smollm_tokenizer, EngineConfig(max_batch=8, kv_budget=per_block * 12))
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, guided=Guided.json_schema(BOUNDED))
        for s in range(8)
    ]
    ids = smollm_tokenizer.encode("Write a person as JSON, please, with every field filled in.")
    answers = [engine.generate([ids], p, use_tqdm=False)[0] for p in params[:2]]  # alone: no preemption
    rids = [engine.add_request(ids, p) for p in params]
    texts: dict[str, list[int]] = {}
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert engine.scheduler.num_preemptions > 0
    for rid in rids:
        assert finished[rid] == "stop"
        jsonschema.validate(json.loads(smollm_tokenizer.decode(texts[rid])), BOUNDED)
    assert [a.token_ids for a in answers] == [
        texts[rid] for rid in rids[:2]
    ]  # seeded: the same tokens, preempted or not
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_min_tokens_holds_the_end_off_until_the_grammar_is_complete(random_model, smollm_tokenizer):
    """min_tokens keeps an open grammar going (the end token is held off while the grammar could
    go on), but a complete grammar, which allows only its end, ends the answer: it outranks
    min_tokens rather than leave the row with no token at all."""
    engine = engine_of(random_model, smollm_tokenizer)
    choice = Guided.choice(["yes", "no"])
    (c,) = engine.generate(["x"], SamplingParams(max_tokens=20, min_tokens=5, guided=choice), use_tqdm=False)
    assert c.text in ("yes", "no") and c.finish_reason == "stop"
    letters = Guided.text("regex", "[a-z]{1,60}", "guided_regex")
    for seed in range(3):
        params = SamplingParams(max_tokens=40, min_tokens=12, temperature=1.0, seed=seed, guided=letters)
        (c,) = engine.generate(["x"], params, use_tqdm=False)
        assert len(c.token_ids) >= 12 and c.text.isalpha() and c.text.islower(), c

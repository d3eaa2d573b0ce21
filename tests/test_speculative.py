"""Speculative decoding (speculative.py): the n-gram proposer, the acceptance rule, and the
engine with drafts — greedy tokens equal to decoding without them, the sampled distribution
kept (a chi-square over a tiny model's two-token continuations), and every block back.

Each gate is shown failing on a wrongly built input: a planted off-by-one in the accepted length
breaks greedy equality and the chi-square; a proposer that ignores the latest occurrence, or a
turn-down rule that never pauses, fails its hand-computed case."""

import random

import pytest
import torch

import nanoserve.engine as engine_module
from nanoserve.sampling import SamplingParams
from nanoserve.speculative import (
    FIRST_PAUSE,
    MIN_RATE,
    WINDOW,
    NgramProposer,
    RowState,
    accepted_length,
)
from tests.test_engine import check_same_or_near_tie, tiny_engine
from tests.test_model import make_tiny_dir, ours_from_dir


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-spec")
    make_tiny_dir(path, seed=7, max_position_embeddings=256)
    return ours_from_dir(path)


# --- the proposer and the rule, by hand ------------------------------------------------------------


def test_the_longest_ngram_is_looked_up_at_its_latest_occurrence():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # the context ends in (6, 7): it occurred at 1-2 (then 8) and at 5-6 (then 1, 2, 6): the latest wins
    assert p.propose(RowState(), tokens, limit=10) == [1, 2, 6]
    # the 3-gram (2, 6, 7) has no earlier occurrence, the 2-gram does; with max_n 3 it is tried first
    assert p.propose(RowState(), tokens + [1, 2, 6, 7], limit=10) == [1, 2, 6]
    # limit cuts the proposal; nothing to look up gives none
    assert p.propose(RowState(), tokens, limit=1) == [1]
    assert p.propose(RowState(), [1, 2, 3, 4], limit=5) == []
    # min_n 2: a lone repeated token is not enough
    assert NgramProposer(3, 2, 3).propose(RowState(), [4, 9, 9, 5, 9], limit=5) == []
    assert NgramProposer(3, 1, 3).propose(RowState(), [4, 9, 9, 5, 9], limit=5) == [5, 9]


def test_the_index_grows_with_the_context():
    """One state across steps (as the engine keeps it): each lookup sees the tokens appended since."""
    p, state = NgramProposer(k=2, min_n=2, max_n=2), RowState()
    tokens = [1, 2, 3, 4]
    assert p.propose(state, tokens, 5) == []
    tokens += [1, 2]
    assert p.propose(state, tokens, 5) == [3, 4]
    tokens += [7, 3, 4]
    assert p.propose(state, tokens, 5) == [1, 2]  # (3, 4) ended at 4 then (then 1, 2): not at 9


def test_accepted_length_is_the_agreeing_prefix():
    assert accepted_length([4, 5, 6], [4, 5, 6, 9]) == 3
    assert accepted_length([4, 5, 6], [4, 7, 6, 9]) == 1
    assert accepted_length([4, 5, 6], [3, 5, 6, 9]) == 0
    assert accepted_length([4], ["a sentence", 1]) == 0


def test_a_row_whose_drafts_do_not_pay_stops_proposing_for_a_while():
    p, state = NgramProposer(k=4, min_n=1, max_n=2), RowState()
    tokens = [1, 2, 1, 2, 1]
    for _ in range(WINDOW - 1):
        p.record(state, 0, 4)
    assert state.pause == 0 and p.propose(state, tokens, 9)  # not yet judged
    p.record(state, 0, 4)
    assert state.pause == FIRST_PAUSE
    for _ in range(FIRST_PAUSE):
        assert p.propose(state, tokens, 9) == []
    assert p.propose(state, tokens, 9) == [2, 1]  # what followed (2, 1) last time, to the end
    for _ in range(WINDOW):
        p.record(state, 1, 4)  # a quarter kept: still short
    assert state.pause == 2 * FIRST_PAUSE  # a second failure pauses longer
    # a row that keeps MIN_RATE of what it proposes keeps proposing, and its next pause is short again
    for _ in range(3 * WINDOW):
        p.record(state, 2, 4)
    assert state.next_pause == FIRST_PAUSE
    ok = RowState()
    for _ in range(3 * WINDOW):
        p.record(ok, int(MIN_RATE * 4), 4)
    assert ok.pause == 0


# --- the engine: greedy equality, blocks, budget ---------------------------------------------------


def _copy_prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts that repeat a span of themselves, so the lookup finds something to propose."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        head = [rng.randrange(1, 250) for _ in range(rng.randrange(4, 40))]
        out.append(head + head[: rng.randrange(2, len(head))])
    return out


def _run_staggered(engine, prompts, params, join_every: int = 3) -> dict[str, list[int]]:
    """Add a prompt every `join_every` steps (rows join and leave while others decode); each
    request's tokens; checks the pool's invariants as it goes."""
    pending, tokens, step = list(enumerate(prompts)), {}, 0
    while pending or engine.has_unfinished():
        if pending and step % join_every == 0:
            i, p = pending.pop(0)
            engine.add_request(p, params[i] if isinstance(params, list) else params, request_id=f"r{i}")
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.allocator.check_invariants([s.block_table for s in engine.scheduler.running])
        step += 1
    assert engine.allocator.num_used == 0, "a block was not given back"
    return tokens


@pytest.mark.parametrize("attention", ["native", "gather"])
def test_greedy_tokens_equal_decoding_without_drafts(tiny_model, attention):
    prompts = _copy_prompts(1, 10)
    sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    off = _run_staggered(tiny_engine(tiny_model, attention=attention), prompts, sp)
    eng = tiny_engine(tiny_model, attention=attention, speculative="ngram", num_speculative_tokens=5)
    on = _run_staggered(eng, prompts, sp)
    ties = []
    for i, p in enumerate(prompts):
        check_same_or_near_tie(tiny_model, p, off[f"r{i}"], on[f"r{i}"], ties)
    assert len(ties) <= 1
    s = eng.spec_stats
    # the drafts were real: many proposed, many kept, and some refused
    assert s.verifications > 50 and 0 < s.accepted_tokens < s.draft_tokens
    assert s.mean_accepted_length > 1.5


def test_drafts_fit_the_budget_and_a_tight_pool(tiny_model):
    """A token budget a little over the rows, a pool that forces preemptions: drafts are cut
    before anyone is preempted for them, the tokens still equal, every block back."""
    prompts = _copy_prompts(2, 8)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    per_block = tiny_model.cfg.kv_bytes_per_token(torch.float32) * 4
    cfg = dict(max_num_batched_tokens=10, kv_budget=per_block * 36, max_model_len=128)
    off = _run_staggered(tiny_engine(tiny_model, **cfg), prompts, sp, join_every=1)
    eng = tiny_engine(tiny_model, speculative="ngram", **cfg)
    seen = []
    real = eng.scheduler.schedule

    def schedule():
        batch = real()
        seen.append(sum(end - start for _, start, end in batch.as_chunks()))
        return batch

    eng.scheduler.schedule = schedule
    on = _run_staggered(eng, prompts, sp, join_every=1)
    ties = []
    for i, p in enumerate(prompts):
        check_same_or_near_tie(tiny_model, p, off[f"r{i}"], on[f"r{i}"], ties)
    assert len(ties) <= 1
    assert max(seen) <= 10, "a step carried more tokens than the budget"
    assert eng.scheduler.num_preemptions > 0 and eng.spec_stats.accepted_tokens > 0


def test_max_tokens_and_the_context_bound_the_drafts(tiny_model):
    """A row never gets more than max_tokens, nor runs past the context, whatever was proposed."""
    prompt = [3, 4, 5, 6] * 8
    eng = tiny_engine(tiny_model, speculative="ngram", num_speculative_tokens=8)
    for n in (1, 2, 5, 9):
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        (c,) = eng.generate([prompt], sp, use_tqdm=False)
        assert len(c.token_ids) == n and c.finish_reason == "length"
    long = [3, 4, 5, 6] * 62  # 248 of the 256 positions
    (c,) = eng.generate([long], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(long) + len(c.token_ids) == 256
    assert eng.allocator.num_used == 0


def test_logprobs_of_kept_tokens_are_those_without_drafts(tiny_model):
    prompt = _copy_prompts(3, 1)[0]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)

    def run(**kw):
        eng = tiny_engine(tiny_model, **kw)
        eng.add_request(prompt, sp, request_id="a")
        got = []
        while eng.has_unfinished():
            for out in eng.step():
                assert len(out.logprobs) == len(out.new_token_ids)
                got += [(t, lp.logprob) for t, lp in zip(out.new_token_ids, out.logprobs)]
        return got, eng

    off, _ = run()
    on, eng = run(speculative="ngram")
    assert eng.spec_stats.accepted_tokens > 0
    assert [t for t, _ in on] == [t for t, _ in off]
    assert max(abs(a - b) for (_, a), (_, b) in zip(on, off)) < 1e-4


def test_a_planted_off_by_one_in_the_accepted_length_is_caught(tiny_model, monkeypatch):
    """Keeping one draft token more than agreed: the greedy tokens part from decoding without drafts."""
    prompts = _copy_prompts(1, 6)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    off = _run_staggered(tiny_engine(tiny_model), prompts, sp)
    real = accepted_length
    monkeypatch.setattr(engine_module, "accepted_length", lambda d, s: min(len(d), real(d, s) + 1))
    on = _run_staggered(tiny_engine(tiny_model, speculative="ngram"), prompts, sp)
    assert sum(off[k] != on[k] for k in off) >= 3


def test_seeded_sampled_rows_repeat(tiny_model):
    prompts = _copy_prompts(4, 4)
    params = [SamplingParams(max_tokens=30, temperature=0.8, seed=s, ignore_eos=True) for s in range(4)]
    runs = [_run_staggered(tiny_engine(tiny_model, speculative="ngram"), prompts, params) for _ in range(2)]
    assert runs[0] == runs[1]


# --- the sampled distribution: a chi-square --------------------------------------------------------


class FixedDraft:
    """A proposer that proposes `draft` at a row's first decode step and nothing after."""

    k = 2

    def __init__(self, prompt_len: int, draft: list[int]):
        self.prompt_len, self.draft = prompt_len, draft

    def propose(self, state, tokens, limit):
        return list(self.draft[:limit]) if len(tokens) == self.prompt_len + 1 else []

    def record(self, state, accepted, proposed):
        pass


def _law(model, prompt, length: int, top_k: int) -> dict[tuple, float]:
    """The exact distribution of the next `length` tokens under temperature 1 and top-k."""
    from tests.test_engine import NoCache

    def probs(ids):
        cache = NoCache()
        pos = torch.arange(len(ids))
        cache.begin(pos)
        logits = model(torch.tensor(ids), pos, cache, logits_at=torch.tensor([len(ids) - 1]))[0].double()
        top = logits.topk(top_k)
        return zip(top.indices.tolist(), top.values.softmax(-1).tolist())

    law = {(): 1.0}
    for _ in range(length):
        law = {k + (t,): p * q for k, p in law.items() for t, q in probs(prompt + list(k))}
    return law


def test_sampled_acceptance_keeps_the_distribution_and_a_planted_rule_does_not(tiny_model, monkeypatch):
    """Three tokens sampled (top-3, temperature 1); at the first decode step the engine verifies
    a fixed draft for the second. Over 3,200 draws the observed triples must fit the model's
    exact law (27 cells): chi-square p > 0.001. Keeping one draft token more than agreed (the
    planted rule) must not fit: p < 1e-6."""
    prompt = [17, 43, 99, 5, 61]
    law = _law(tiny_model, prompt, 3, top_k=3)
    assert min(law.values()) * 3200 > 5  # every cell expects enough draws for the test to hold

    def fit(planted=None):
        if planted is not None:
            monkeypatch.setattr(engine_module, "accepted_length", planted)
        eng = tiny_engine(tiny_model, max_batch=64, speculative="ngram", max_num_batched_tokens=512)
        # the draft: the likeliest second token, often right and often not
        second = max(law.items(), key=lambda kv: kv[1])[0][1]
        eng.proposer = FixedDraft(len(prompt), [second, second])
        counts, n, outside = dict.fromkeys(law, 0), 0, 0
        while n < 3200:
            ps = [
                SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=n + i, ignore_eos=True)
                for i in range(64)
            ]
            for comp in eng.generate([prompt] * 64, ps, use_tqdm=False):
                key = tuple(comp.token_ids)
                if key in counts:
                    counts[key] += 1
                else:  # a triple the law gives no mass: no chi-square needed
                    outside += 1
                n += 1
        assert eng.spec_stats.verifications == n and eng.allocator.num_used == 0
        stat = sum((counts[k] - n * p) ** 2 / (n * p) for k, p in law.items())
        df = torch.tensor((len(law) - 1) / 2, dtype=torch.float64)
        x = torch.tensor(stat / 2, dtype=torch.float64)
        return stat, 0.0 if outside else float(torch.special.gammaincc(df, x)), eng.spec_stats

    stat, pvalue, stats = fit()
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # drafts both kept and refused
    assert pvalue > 1e-3, f"chi-square {stat:.1f}, p {pvalue:.2e}: the sampled law moved"
    real = accepted_length
    stat, pvalue, _ = fit(lambda d, s: min(len(d), real(d, s) + 1))
    assert pvalue < 1e-6, f"the planted rule fit the law (chi-square {stat:.1f}, p {pvalue:.2e})"


# --- the default model, its own GGUF, through the server ----------------------------------------------


COPY_ASKS = [
    "Repeat this list exactly, one item a line: apples, pears, plums, cherries, apricots, figs, "
    "dates, limes, lemons, oranges.",
    "Copy this sentence twice: The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "Write out this code again with `total` renamed to `acc`:\n\ndef add_all(xs):\n    total = 0\n"
    "    for x in xs:\n        total = total + x\n    return total\n",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def smollm_engines(smollm_dir):
    from nanoserve.config import EngineConfig
    from nanoserve.engine import build_engine

    # fp32 activations over the GGUF's blocks (the fused step still runs): a server's steps
    # depend on when requests arrive (a decode row in a step with a prompt chunk takes the torch
    # ops, one without takes the fused call), and their float sums differ in the last bit. With
    # fp32 that moves a logit by ~1e-6, so tokens part only at a near-tie (TIE, the rule of
    # tests/test_engine.py); int8 activations magnify it to ~0.1 (tests/test_quant.py's
    # INT8_TIE), too wide a net to catch a wrong draft. A row's int8 product itself is batch
    # invariant (test_quant.py's test_an_int8_rows_product_does_not_depend_on_its_neighbours).
    base = dict(weights="gguf", quant_activations="fp32", max_batch=4, max_model_len=1024)
    return {spec: build_engine(EngineConfig(speculative=spec, **base)) for spec in (None, "ngram")}


def test_smollm_greedy_tokens_equal_without_drafts_through_the_server(smollm_engines):
    """SmolLM2's Q4_1 GGUF on the fused step, served: four chat requests sent together with
    different lengths (rows join and leave), greedy, each answer's tokens equal with drafts and
    without (or parting at a near-tie: which steps mix a prompt chunk with decode rows depends on
    arrival times); the drafts were verified and many kept; /health and /metrics report them."""
    import threading

    import httpx

    from nanoserve.serve import create_app
    from nanoserve.threads import ServerThread

    answers = {}
    for spec, eng in smollm_engines.items():
        with ServerThread(create_app(eng)) as url:
            got = [None] * len(COPY_ASKS)

            def ask(i, got=got):
                body = {
                    "messages": [{"role": "user", "content": COPY_ASKS[i]}],
                    "max_tokens": 40 + 12 * i,
                    "temperature": 0,
                    "return_token_ids": True,
                }
                r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
                got[i] = r.json()["choices"][0]["token_ids"]

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(COPY_ASKS))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            health = httpx.get(url + "/health").json()
            metrics = httpx.get(url + "/metrics").text
        answers[spec] = got
        assert eng.allocator.num_used == 0
    eng, ties = smollm_engines[None], []
    for i, (ref, got) in enumerate(zip(answers[None], answers["ngram"])):
        prompt = eng.encode_prompt([{"role": "user", "content": COPY_ASKS[i]}])
        check_same_or_near_tie(eng.model, prompt, ref, got, ties)
    assert len(ties) <= 1, ties
    spec = health["speculative"]
    assert spec["verifications"] > 10 and spec["accepted_tokens"] > 20, spec
    assert f"nanoserve_spec_accepted_tokens_total {float(spec['accepted_tokens'])}" in metrics


def test_smollm_stop_strings_logprobs_and_a_grammar_with_drafts(smollm_engines):
    """Through the engine with the default model: a stop string, logprobs, a JSON schema (the
    prompt holds the JSON the answer copies, so drafts are proposed inside the grammar) and
    sampled rows beside them. Greedy rows' text, tokens and scores equal those without drafts;
    the grammar's answer parses; drafts were kept."""
    import json

    from nanoserve.grammar import Guided

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "colors": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "colors"],
    }
    record = '{"name": "Ada Lovelace", "colors": ["red", "green", "blue", "yellow"]}'
    asks = [
        ([{"role": "user", "content": COPY_ASKS[0]}], dict(stop=["cherries"], max_tokens=60)),
        ([{"role": "user", "content": COPY_ASKS[1]}], dict(logprobs=3, max_tokens=48)),
        (
            [{"role": "user", "content": f"Return this JSON exactly: {record}"}],
            dict(guided=Guided.json_schema(schema), max_tokens=60),
        ),
    ]
    results = {}
    for spec, eng in smollm_engines.items():
        before = eng.spec_stats.accepted_tokens
        params = [SamplingParams(temperature=0, **kw) for _, kw in asks]
        for p in params:
            if p.guided is not None:
                eng.grammars.compile(p.guided)
        sampled = SamplingParams(temperature=0.9, seed=5, max_tokens=40)
        ids = [eng.add_request(m, p) for (m, _), p in zip(asks, params)]
        ids.append(eng.add_request([{"role": "user", "content": COPY_ASKS[2]}], sampled))
        got = {i: dict(tokens=[], text="", scores=[], finish=None) for i in ids}
        while eng.has_unfinished():
            for out in eng.step():
                g = got[out.request_id]
                g["tokens"] += out.new_token_ids
                g["text"] += out.text_delta
                g["scores"] += [round(s.logprob, 3) for s in out.logprobs or []]
                g["finish"] = out.finish_reason or g["finish"]
        results[spec] = [got[i] for i in ids[:3]]
        assert eng.allocator.num_used == 0
        if spec:
            assert eng.spec_stats.accepted_tokens - before > 20
    eng, ties = smollm_engines[None], []
    for (m, _), ref, got in zip(asks, results[None], results["ngram"]):
        if ref["tokens"] != got["tokens"]:  # only at a near-tie (see smollm_engines)
            check_same_or_near_tie(eng.model, eng.encode_prompt(m), ref["tokens"], got["tokens"], ties)
        else:
            assert got == ref
    assert len(ties) <= 1, ties
    stop, scored, guided = results["ngram"]
    assert stop["finish"] == "stop" and "cherries" not in stop["text"]
    assert len(scored["scores"]) == len(scored["tokens"])
    assert json.loads(guided["text"])["name"] == "Ada Lovelace"


def test_what_speculation_is_not_built_for_is_refused_with_a_sentence():
    """Tensor parallelism (its ranks are sent decode and prefill plans, not a verify step's) and
    bad settings are refused before anything loads."""
    from nanoserve.config import EngineConfig
    from nanoserve.errors import NanoserveError
    from nanoserve.tp import engine_config

    with pytest.raises(NanoserveError, match="not built for tensor parallelism"):
        engine_config(EngineConfig(speculative="ngram"))
    assert engine_config(EngineConfig()).decode_step == "ops"
    for kw, msg in [
        (dict(speculative="eagle"), "speculative is ngram"),
        (dict(speculative="ngram", num_speculative_tokens=0), "at least 1"),
    ]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig(**kw).validate()

"""Scores and several answers: logprobs, echo, n, best_of and prompt lists (issue 14).

The reference is transformers on the same fp32 weights: `log_softmax` of its logits. The
tolerance is derived, not picked: a log-probability is a logit minus the row's logsumexp, and
logsumexp moves by at most the largest logit error, so |our logprob - theirs| <= 2 x the largest
|logit difference|. tests/test_model.py holds our logits to within 1e-3 of transformers' on
SmolLM2, so scores are held to 2e-3 (what they really differ by is printed, and far smaller). A
top-N set may differ from the reference's only where the reference's N-th and (N+1)-th
log-probabilities are themselves closer than that tolerance: a measured near-tie.
"""

import json

import httpx
import pytest
import torch
import transformers

from nanoserve.config import EngineConfig
from nanoserve.engine import Engine
from nanoserve.sampling import MAX_LOGPROBS, SamplingParams, logprobs_of
from nanoserve.serve import create_app
from nanoserve.threads import ServerThread
from tests.test_engine import tiny_engine, tiny_model  # noqa: F401 -- a fixture
from tests.test_model import make_tiny_dir, ours_from_dir

LOGIT_TOL = 1e-3  # tests/test_model.py: our SmolLM2 logits against transformers'
TOL = 2 * LOGIT_TOL  # derived in the module docstring


def check_scores(entries, ids, ref_lp: torch.Tensor, top: int, tol: float = TOL) -> tuple[float, int]:
    """entries[j] scores ids[j] (entries[0] is None: nothing predicts the first token) under
    ref_lp (len(ids), V), row p predicting token p + 1. Returns (worst error, near-ties
    excused); raises AssertionError on anything else."""
    assert entries[0] is None and len(entries) == len(ids), (len(entries), len(ids))
    worst, ties = 0.0, 0
    for j in range(1, len(ids)):
        e, row = entries[j], ref_lp[j - 1]
        token, logprob, got_top = e if isinstance(e, tuple) else e.as_tuple()
        assert token == ids[j], f"position {j} scores token {token}, the prompt has {ids[j]}"
        err = abs(logprob - row[ids[j]].item())
        assert err <= tol, f"position {j}: logprob {logprob:.6f} vs {row[ids[j]].item():.6f}"
        worst = max(worst, err)
        if top:
            ref = row.topk(top + 1)
            want = set(ref.indices[:top].tolist())
            got = {t for t, _ in got_top}
            if got != want:
                gap = (ref.values[top - 1] - ref.values[top]).item()
                assert gap < tol, f"position {j}: top-{top} {sorted(got)} vs {sorted(want)}, gap {gap:.2e}"
                ties += 1
    return worst, ties


# --- the engine, on tiny random weights ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-scores")
    hf = make_tiny_dir(path, seed=3, max_position_embeddings=256)
    return hf, ours_from_dir(path)


def run(engine, requests):
    """requests: (prompt ids, params); every output by request, in order."""
    rids = [engine.add_request(ids, p) for ids, p in requests]
    outs = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return [outs[r] for r in rids]


def test_prompt_scores_match_transformers_through_chunks_and_batches(tiny_pair):
    hf, ours = tiny_pair
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 5, 37, 90)]
    # chunks of 16 tokens: the 90-token prompt is scored over six steps, beside the others
    engine = tiny_engine(ours, max_num_batched_tokens=16)
    outs = run(engine, [(ids, SamplingParams(max_tokens=2, prompt_logprobs=4)) for ids in prompts])
    worst = 0.0
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        err, _ = check_scores(out[0].prompt_logprobs, ids, ref, 4, tol=1e-4)
        worst = max(worst, err)
        assert all(o.prompt_logprobs is None for o in out[1:]), "the prompt's scores come once"
    print(f"tiny model: worst prompt logprob error {worst:.2e}")
    assert engine.allocator.num_used == 0


def test_the_score_check_fails_on_scores_shifted_by_one(tiny_pair):
    """The gate above, shown failing: scores of token p under the logits of position p (an
    off-by-one a prefill could make) are caught."""
    hf, ours = tiny_pair
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    (out,) = run(tiny_engine(ours), [(ids, SamplingParams(max_tokens=1, prompt_logprobs=2))])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    check_scores(out[0].prompt_logprobs, ids, ref, 2, tol=1e-4)
    with pytest.raises(AssertionError):
        check_scores(out[0].prompt_logprobs, ids, torch.cat([ref[:1], ref[:-1]]), 2, tol=1e-4)


def test_token_scores_are_of_the_raw_distribution(tiny_model):  # noqa: F811
    """A sampled token's score is log_softmax of the model's logits, whatever the temperature
    and top-k: the same text scores the same under any sampling settings."""
    engine = tiny_engine(tiny_model)
    ids = list(range(3, 19))
    hot = SamplingParams(max_tokens=6, temperature=1.7, top_k=5, seed=11, logprobs=3, ignore_eos=True)
    (out,) = run(engine, [(ids, hot)])
    tokens = [t for o in out for t in o.new_token_ids]
    scores = [o.logprobs[0] for o in out]
    with torch.no_grad():
        from tests.test_model import prefill_logits

        logits = prefill_logits(tiny_model, ids + tokens)
    for j, s in enumerate(scores):
        want = logprobs_of(logits[len(ids) - 1 + j : len(ids) + j], [tokens[j]], 3)[0]
        assert s.token_id == tokens[j] and abs(s.logprob - want.logprob) < 1e-4
        assert [t for t, _ in s.top] == [t for t, _ in want.top]


def test_scoring_a_prompt_alone_and_after_preemption(tiny_model):  # noqa: F811
    """max_tokens 0 ends after the prompt, unsampled. A scored request preempted later is
    recomputed (through the prefix cache, now that its prompt is scored) without its prompt's
    scores being computed or sent again."""
    ids = list(range(5, 65))
    (alone,) = run(tiny_engine(tiny_model), [(ids, SamplingParams(max_tokens=0, prompt_logprobs=1))])
    assert len(alone) == 1 and alone[0].finish_reason == "length" and alone[0].new_token_ids == []
    # 30 blocks of 4 for 3 x 50 + 90 tokens: decode preempts the newest, the scored request
    per_block = tiny_model.cfg.kv_bytes_per_token(torch.float32) * 4
    engine = tiny_engine(tiny_model, kv_budget=per_block * 30, max_model_len=100)
    others = [(list(range(40 + i, 50 + i)), SamplingParams(max_tokens=40, ignore_eos=True)) for i in range(3)]
    scored = (ids, SamplingParams(max_tokens=30, prompt_logprobs=1, ignore_eos=True))
    rids = [engine.add_request(p, sp) for p, sp in [*others, scored]]
    seq = engine.requests[rids[-1]].seq
    outs = {r: [] for r in rids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    outs = [outs[r] for r in rids]
    assert engine.requests == {} and engine.allocator.num_used == 0
    assert seq.num_preemptions > 0, "the scored request was never preempted: the test tests nothing"
    with_scores = [o for o in outs[-1] if o.prompt_logprobs is not None]
    assert len(with_scores) == 1, "the prompt's scores are sent once, preempted or not"
    got = with_scores[0].prompt_logprobs
    assert len(got) == len(ids)
    for a, b in zip(alone[0].prompt_logprobs[1:], got[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
    assert sum(len(o.new_token_ids) for o in outs[-1]) == 30


def test_samples_of_one_prompt_share_its_blocks(tiny_model):  # noqa: F811
    """n samples: the first computes the prompt, the others wait for it and take its full
    blocks from the prefix cache (the allocator's reference counts show the sharing)."""
    engine = tiny_engine(tiny_model, max_batch=8)
    ids = list(range(10, 47))  # 37 tokens: 9 full blocks of 4 and one partial
    first = engine.add_request(ids, SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True))
    rest = [
        engine.add_request(
            ids, SamplingParams(max_tokens=8, temperature=1.0, seed=5 + j, ignore_eos=True), after=first
        )
        for j in (1, 2, 3)
    ]
    assert len(engine.scheduler.waiting) == 1 and len(engine.held[first]) == 3
    engine.step()  # the first sample's prefill
    engine.step()  # the others: their prefill, 1 token each past the 9 cached blocks
    seq = engine.requests[first].seq
    shared = seq.block_table.blocks[:9]
    assert [engine.allocator.ref_count(b) for b in shared] == [4] * 9
    assert all(engine.requests[r].seq.block_table.num_cached_tokens == 36 for r in rest)
    # 9 shared + 4 own last blocks, where 4 separate prompts would hold 40
    assert engine.allocator.num_used == 9 + 4
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_used == 0


def test_an_aborted_first_sample_releases_the_others(tiny_model):  # noqa: F811
    engine = tiny_engine(tiny_model)
    ids = list(range(10, 30))
    first = engine.add_request(ids, SamplingParams(max_tokens=4, ignore_eos=True))
    other = engine.add_request(ids, SamplingParams(max_tokens=4, ignore_eos=True), after=first)
    engine.abort(first)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert len(done[other]) == 4 and first not in done


def test_bad_score_params_are_sentences():
    for bad in (
        dict(logprobs=MAX_LOGPROBS + 1),
        dict(logprobs=-1),
        dict(prompt_logprobs=True),
        dict(max_tokens=0),  # 0 only with prompt_logprobs
    ):
        with pytest.raises(ValueError, match="logprobs|max_tokens"):
            SamplingParams(**bad).validate()
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate()


# --- the server, on SmolLM2, against transformers --------------------------------------------------


@pytest.fixture(scope="module")
def real(smollm_dir):
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer

    ours = load_model(smollm_dir)
    hf = transformers.LlamaForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    return ours, hf, Tokenizer.from_dir(smollm_dir)


@pytest.fixture(scope="module")
def server(real):
    ours, _, tok = real
    config = EngineConfig(
        max_batch=8, bucket_decode=True, persist_inputs=True, capture_decode=True, max_model_len=1024
    )
    engine = Engine(ours, tok, config)
    engine.model_name = "SmolLM2-135M-Instruct"
    engine.warm_decode(8, 128)
    with ServerThread(create_app(engine)) as url:
        yield url, engine


TEXTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen. " * 3,
]


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].log_softmax(-1)


def post(url, path, body):
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_echo(lp: dict, ids: list[int], ref, top: int, tok) -> tuple[float, int]:
    """A completions `logprobs` object from echo: the prompt's positions against transformers."""
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][: len(ids)] == [tok.token_text(t) for t in ids]
    worst, ties = 0.0, 0
    for j in range(1, len(ids)):
        err = abs(lp["token_logprobs"][j] - ref[j - 1, ids[j]].item())
        assert err <= TOL, f"position {j}: {lp['token_logprobs'][j]} vs {ref[j - 1, ids[j]].item()}"
        worst = max(worst, err)
        got = set(lp["top_logprobs"][j]) - ({lp["tokens"][j]} if len(lp["top_logprobs"][j]) > top else set())
        best = ref[j - 1].topk(top + 1)
        want = {tok.token_text(t) for t in best.indices[:top].tolist()}
        if got != want:
            gap = (best.values[top - 1] - best.values[top]).item()
            assert gap < TOL, f"position {j}: top {sorted(got)} vs {sorted(want)} (gap {gap:.2e})"
            ties += 1
        for name, value in lp["top_logprobs"][j].items():  # every listed score is the reference's too
            t = next(t for t in (best.indices.tolist() + [ids[j]]) if tok.token_text(t) == name)
            assert abs(value - ref[j - 1, t].item()) <= TOL
    return worst, ties


@pytest.mark.slow
def test_echo_scores_match_transformers_whole_and_streamed(real, server):
    _, hf, tok = real
    url, engine = server
    worst, ties = 0.0, 0
    prompts = [tok.encode(t) for t in TEXTS]
    body = {"prompt": prompts, "echo": True, "logprobs": 5, "max_tokens": 1, "temperature": 0}
    whole = post(url, "/v1/completions", body)
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    for ids, choice in zip(prompts, whole["choices"]):
        ref = hf_logprobs(hf, ids)
        err, t = check_echo(choice["logprobs"], ids, ref, 5, tok)
        worst, ties = max(worst, err), ties + t
        assert (
            choice["text"].startswith(tok.decode(ids)) and len(choice["logprobs"]["tokens"]) == len(ids) + 1
        )
        offsets = choice["logprobs"]["text_offset"]
        assert offsets == sorted(offsets) and offsets[0] == 0

    # streamed: the echo chunk carries the prompt's scores, the token chunks their own
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=120) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for k in range(len(prompts)):
        merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        text = ""
        for f in frames:
            (c,) = f["choices"]
            if c["index"] == k:
                text += c["text"]
                for key in merged:
                    merged[key] += c["logprobs"][key]
        assert merged == whole["choices"][k]["logprobs"] and text == whole["choices"][k]["text"]
    print(f"SmolLM2 echo scores: worst |logprob - transformers| {worst:.2e}, {ties} near-tie top-5 sets")
    assert engine.allocator.num_used == 0 or engine.has_unfinished()


@pytest.mark.slow
def test_the_way_lm_eval_scores_a_choice(real, server):
    """lm-evaluation-harness's local-completions backend, as its source does it: context +
    continuation as token ids, a list of them in one request, echo with logprobs 1 and
    max_tokens 1; the continuation's log-likelihood is the sum of token_logprobs[ctxlen:-1],
    and it is greedy if each of those is the largest of its top_logprobs."""
    _, hf, tok = real
    url, _ = server
    context = tok.encode("Question: What color is the sky on a clear day?\nAnswer:")
    options = [" blue", " green", " loud", " seven"]
    prompts = [context + tok.encode(o) for o in options]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}
    out = post(url, "/v1/completions", body)
    got, ref = [], []
    for ids, choice in zip(prompts, sorted(out["choices"], key=lambda c: c["index"])):
        lp = choice["logprobs"]
        n = len(context)
        got.append(
            (
                sum(lp["token_logprobs"][n:-1]),
                all(
                    t == max(d.values()) for t, d in zip(lp["token_logprobs"][n:-1], lp["top_logprobs"][n:-1])
                ),
            )
        )
        r = hf_logprobs(hf, ids)
        cont = [r[p - 1, ids[p]].item() for p in range(n, len(ids))]
        greedy = all(r[p - 1].argmax().item() == ids[p] for p in range(n, len(ids)))
        ref.append((sum(cont), greedy))
    for (a, ga), (b, gb) in zip(got, ref):
        assert abs(a - b) <= TOL * len(options) and ga == gb
    assert max(range(4), key=lambda i: got[i][0]) == max(range(4), key=lambda i: ref[i][0]) == 0


@pytest.mark.slow
def test_chat_logprobs_match_the_tokens_and_transformers(real, server):
    _, hf, tok = real
    url, _ = server
    messages = [{"role": "user", "content": "Name a primary color."}]
    out = post(
        url,
        "/v1/chat/completions",
        {"messages": messages, "logprobs": True, "top_logprobs": 3, "max_tokens": 12, "temperature": 0}
        | {"return_token_ids": True},
    )
    choice = out["choices"][0]
    content, ids = choice["logprobs"]["content"], choice["token_ids"]
    assert [c["token"] for c in content] == [tok.token_text(t) for t in ids]
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == choice["message"]["content"]
    prompt = tok.encode_chat(messages)
    ref = hf_logprobs(hf, prompt + ids)
    for j, c in enumerate(content):
        row = ref[len(prompt) - 1 + j]
        assert abs(c["logprob"] - row[ids[j]].item()) <= TOL
        assert (
            len(c["top_logprobs"]) == 3
            and c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][-1]["logprob"]
        )
        assert c["logprob"] >= c["top_logprobs"][-1]["logprob"] - TOL  # greedy: the token is the top one


@pytest.mark.slow
def test_n_samples_repeat_and_a_prompt_list_keeps_its_order(real, server):
    _, _, tok = real
    url, engine = server
    body = {
        "prompt": "Once upon a time",
        "n": 4,
        "max_tokens": 12,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": 0,
    }
    a, b = post(url, "/v1/completions", body), post(url, "/v1/completions", body)
    texts = [c["text"] for c in a["choices"]]
    assert texts == [c["text"] for c in b["choices"]] and len(set(texts)) > 1
    assert a["usage"]["prompt_tokens"] == len(tok.encode("Once upon a time"))
    # a list of 8 prompts: 8 choices, each what the prompt gets alone
    prompts = [f"Count to {i}:" for i in range(1, 9)]
    listed = post(url, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
    assert [c["index"] for c in listed["choices"]] == list(range(8))
    for p, c in zip(prompts, listed["choices"]):
        alone = post(url, "/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0})
        assert c["text"] == alone["choices"][0]["text"], p
    # best_of 4, n 2: the two of the four samples best per token
    best = post(url, "/v1/completions", body | {"n": 2, "best_of": 4})
    means = [
        sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in a["choices"]
    ]
    got = [
        sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"]) for c in best["choices"]
    ]
    assert got == pytest.approx(sorted(means, reverse=True)[:2], abs=1e-4)
    assert best["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]

"""Day 36's tables: OpenAI-style completions against a server booted in-process, over real HTTP.

Three tables, one CSV each, all from SmolLM2-135M-Instruct behind `create_app` on loopback:

* `day-36-requests.csv`: one request of each shape the completions route takes (a text prompt,
  a stop string, a token-id prompt, echo with scores and max_tokens 0, n with scores, best_of
  drawing the same samples, a list of prompts with n, and two refusals), with the status code,
  the choices' indices and finish reasons, and the server's usage counts.
* `day-36-scores.csv`: multiple-choice questions scored the way an evaluation harness scores
  them: context + option as token ids, echo, logprobs 1, max_tokens 0, the option's
  log-likelihood the sum of its tokens' `token_logprobs`. Beside each sum: the same sum from
  log_softmax of the model's own logits (`reference_sum`, one forward in this process) and from
  a scorer that forgets the shift between a position and the token it predicts (`shifted_sum`).
* `day-36-batching.csv`: the options of each question scored as one request with a list of
  prompts against one request per option sent one after another (the way a client does it
  without lists): requests, engine steps, and this machine's wall time.

    python days/day36/completions.py                 # writes the three CSVs next to this file
    python days/day36/completions.py --questions 2   # fewer questions (the notebook's size)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx
import torch

from nanocourse import engine_config, served, write_csv
from nanoserve.contiguous import NoCache
from nanoserve.engine import Engine

HERE = Path(__file__).resolve().parent
MODEL_NAME = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"

# (context, options, index of the right option): everyday facts, four options each
QUESTIONS = [
    ("Question: What color is the sky on a clear day?\nAnswer:", [" blue", " green", " loud", " seven"], 0),
    ("Question: How many legs does a spider have?\nAnswer:", [" two", " eight", " six", " none"], 1),
    ("Question: What do bees make?\nAnswer:", [" milk", " glass", " honey", " rain"], 2),
    ("Question: What is frozen water called?\nAnswer:", [" steam", " sand", " smoke", " ice"], 3),
    ("Question: Which planet is the largest?\nAnswer:", [" Jupiter", " Mars", " Mercury", " the Moon"], 0),
    ("Question: What is the opposite of hot?\nAnswer:", [" warm", " cold", " loud", " tall"], 1),
]


def make_engine(model, tokenizer) -> Engine:
    """The engine the day serves: SmolLM2 on a 32 MiB pool (720 tokens), 8 rows, the default
    linears (packed in place for oneDNN where the CPU allows, about half the CPU time of plain
    ones here). A forward outside the engine (`logits_of`) runs the same packed matrices."""
    config = engine_config(36, max_batch=8, max_model_len=512, kv_budget=32 * 2**20)
    engine = Engine(model, tokenizer, config)
    engine.model_name = MODEL_NAME
    return engine


HTTP = httpx.Client(timeout=120)  # one client, kept-alive connections (a top-level httpx.post builds its own)


def post(url: str, body: dict) -> httpx.Response:
    return HTTP.post(url + "/v1/completions", json=body)


# --- scores -------------------------------------------------------------------------------------


def logits_of(model, ids: list[int]) -> torch.Tensor:
    """The model's own logits at every position of ids (T, V), one forward with no cache."""
    cache = NoCache()
    positions = torch.arange(len(ids))
    cache.begin(positions)
    with torch.no_grad():
        return model(torch.tensor(ids), positions, cache)


def reference_sums(model, ids: list[int], ctxlen: int) -> tuple[float, float]:
    """log P(ids[ctxlen:] | ids[:ctxlen]) from log_softmax of the logits, two ways, one forward:
    right, the token at position p scored by the row of position p - 1; and shifted, the
    classic off-by-one, each token scored by its own row (which predicts the token after it)."""
    lp = logits_of(model, ids).log_softmax(-1)  # (T, V)
    span = range(ctxlen, len(ids))
    return sum(lp[p - 1, ids[p]].item() for p in span), sum(lp[p, ids[p]].item() for p in span)


def harness_sum(logprobs: dict, ctxlen: int) -> tuple[float, bool]:
    """What an evaluation harness reads off an echoed, max_tokens 0 choice: the sum of the
    continuation's token_logprobs, and whether each continuation token was the most likely."""
    lps, tops = logprobs["token_logprobs"][ctxlen:], logprobs["top_logprobs"][ctxlen:]
    return sum(lps), all(lp >= max(top.values()) for lp, top in zip(lps, tops))


def score_question(url: str, tokenizer, context: str, options: list[str]) -> tuple[list[dict], list]:
    """Every option of one question in one request: a list of token-id prompts (context ids +
    option ids, so the context's tokens are the same in each), echo, logprobs 1, max_tokens 0.
    Returns (per option: ids, ctxlen, sum, greedy) and the choices as the server sent them."""
    ctx = tokenizer.encode(context)
    prompts = [ctx + tokenizer.encode(o) for o in options]
    body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0, "model": MODEL_NAME}
    r = post(url, body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    out = []
    for ids, c in zip(prompts, choices):
        total, greedy = harness_sum(c["logprobs"], len(ctx))
        out.append({"ids": ids, "ctxlen": len(ctx), "sum": total, "greedy": greedy})
    return out, choices


def scores_table(url: str, model, tokenizer, questions=QUESTIONS) -> list[dict]:
    rows = []
    for q, (context, options, right) in enumerate(questions):
        scored, _ = score_question(url, tokenizer, context, options)
        ref, shifted = zip(*(reference_sums(model, s["ids"], s["ctxlen"]) for s in scored))
        for s, r in zip(scored, ref):
            assert abs(s["sum"] - r) < 1e-4, f"question {q}: the server's {s['sum']} against {r}"
        best = max(range(len(options)), key=lambda i: scored[i]["sum"])
        best_shifted = max(range(len(options)), key=lambda i: shifted[i])
        for i, option in enumerate(options):
            rows.append(
                {
                    "question": q,
                    "option": option.strip(),
                    "right": "yes" if i == right else "",
                    "cont_tokens": len(scored[i]["ids"]) - scored[i]["ctxlen"],
                    "server_sum": round(scored[i]["sum"], 3),
                    "reference_sum": round(ref[i], 3),
                    "shifted_sum": round(shifted[i], 3),
                    "greedy": "yes" if scored[i]["greedy"] else "no",
                    "picked": "yes" if i == best else "",
                    "picked_shifted": "yes" if i == best_shifted else "",
                }
            )
    return rows


# --- one request of each shape ------------------------------------------------------------------


def request_shapes(tokenizer) -> list[tuple[str, dict]]:
    """(what it shows, body) for each request of the requests table."""
    ids = tokenizer.encode(PROMPT)
    sampled = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 1}
    return [
        ("text prompt", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "return_token_ids": True}),
        ("stop string", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stop": ["."]}),
        ("token-id prompt", {"prompt": ids, "max_tokens": 2, "temperature": 0}),
        ("echo, score only", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}),
        ("n 5, seeded, scored", sampled | {"n": 5, "logprobs": 0}),
        ("best_of 5, n 2", sampled | {"n": 2, "best_of": 5}),
        ("3 prompts, n 2", {"prompt": ["Red", "Green", "Blue"], "max_tokens": 2, "temperature": 0, "n": 2}),
        ("refused: max_tokens 0 alone", {"prompt": PROMPT, "max_tokens": 0}),
        ("refused: best_of < n", {"prompt": PROMPT, "n": 3, "best_of": 2}),
    ]


def request_row(url: str, kind: str, body: dict) -> tuple[dict, dict]:
    t0 = time.perf_counter()
    r = post(url, body)
    ms = (time.perf_counter() - t0) * 1000
    j = r.json()
    row = {"kind": kind, "status": r.status_code}
    if r.status_code == 200:
        cs = j["choices"]
        row |= {
            "choices": len(cs),
            "indices": " ".join(str(c["index"]) for c in cs),
            "finish_reasons": " ".join(c["finish_reason"] for c in cs),
            "prompt_tokens": j["usage"]["prompt_tokens"],
            "completion_tokens": j["usage"]["completion_tokens"],
            "error_param": "",
        }
    else:
        row |= {
            "choices": 0,
            "indices": "",
            "finish_reasons": "",
            "prompt_tokens": "",
            "completion_tokens": "",
            "error_param": j["error"]["param"],
        }
    return row | {"ms": round(ms, 1)}, j


def requests_table(url: str, tokenizer) -> tuple[list[dict], list[dict]]:
    rows, bodies = [], []
    for kind, body in request_shapes(tokenizer):
        row, j = request_row(url, kind, body)
        rows.append(row)
        bodies.append(j)
    return rows, bodies


# --- one list request against one request per option --------------------------------------------


def batching_table(url: str, engine, tokenizer, questions=QUESTIONS) -> list[dict]:
    """Score every question's options both ways; the engine's step count before and after each
    way (the loop is idle between requests, so the difference is that way's steps)."""
    totals = {"one request, a list of prompts": [0, 0, 0.0], "one request per option": [0, 0, 0.0]}
    for context, options, _ in questions:
        ctx = tokenizer.encode(context)
        prompts = [ctx + tokenizer.encode(o) for o in options]
        body = {"echo": True, "logprobs": 1, "max_tokens": 0}
        sums = {}
        for way, bodies in (
            ("one request, a list of prompts", [body | {"prompt": prompts}]),
            ("one request per option", [body | {"prompt": p} for p in prompts]),
        ):
            before = sum(engine.step_kinds.values())
            t0 = time.perf_counter()
            got = []
            for b in bodies:
                r = post(url, b)
                assert r.status_code == 200, r.text
                got += [harness_sum(c["logprobs"], len(ctx))[0] for c in r.json()["choices"]]
            totals[way][2] += time.perf_counter() - t0
            totals[way][0] += len(bodies)
            totals[way][1] += sum(engine.step_kinds.values()) - before
            sums[way] = got
        a, b = sums.values()
        assert all(abs(x - y) < 1e-3 for x, y in zip(a, b)), "the two ways scored differently"
    n_prompts = sum(len(q[1]) for q in questions)
    return [
        {
            "way": way,
            "questions": len(questions),
            "prompts": n_prompts,
            "requests": requests,
            "engine_steps": steps,
            "ms": round(seconds * 1000, 1),
        }
        for way, (requests, steps, seconds) in totals.items()
    ]


def main() -> None:
    from nanoserve.bench import cpu_line
    from nanoserve.models import load_model
    from nanoserve.tokenizer import Tokenizer
    from nanoserve.weights import fetch_default_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--questions", type=int, default=len(QUESTIONS), help="how many of QUESTIONS to score")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=HERE, help="folder for the CSVs")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    model_dir = fetch_default_model()
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    engine = make_engine(model, tok)
    questions = QUESTIONS[: args.questions]
    with served(engine) as url:
        requests, _ = requests_table(url, tok)
        scores = scores_table(url, model, tok, questions)
        batching = batching_table(url, engine, tok, questions)
    requests = [r | {"cpu": cpu_line()} for r in requests]  # their ms columns are this machine's
    batching = [r | {"cpu": cpu_line()} for r in batching]
    for name, rows in (("requests", requests), ("scores", scores), ("batching", batching)):
        for row in rows:
            print(row)
        write_csv(rows, args.out / f"day-36-{name}.csv")


if __name__ == "__main__":
    main()

"""Day 32's benchmark: does a request's output depend on the batch it runs in?

A batched engine computes a request's logits with matrix products whose shapes depend on who
else is in the step: how many rows, how long the other prompts are, how a prompt was chunked.
Floating-point sums taken in a different order round differently, so the logits move a little
with the batch. Greedy tokens change only where the top two logits are closer than that.

For every request the script runs it alone and in batches of 2 to 16 with different neighbours,
with prompts chunked (a step budget of 16 tokens) and unchunked (512), and compares each run
with the eager one-sequence reference (`generate.greedy_tokens`; reference logits from one
cacheless forward over prompt and tokens, as the tests' `top2_gap` computes them): whether the
greedy tokens are equal, the largest absolute logit difference over the positions whose history
is the reference's, the smallest top-2 gap of the reference on those positions, and the
differences the tests' rule (`tests.test_engine.check_same_or_near_tie`, a near-tie is a top-2
gap under 1e-4 at the first differing position) excuses as near-ties. Three CSVs:

* `day-32-tiny.csv`: the tiny random-weight Llama, 64 prompts of 3 to 40 tokens, 16 greedy tokens
  each, per budget, batch size and draw of neighbours;
* `day-32-smollm.csv`: SmolLM2-135M-Instruct (fp32), six short chat questions, 16 tokens each,
  alone, in pairs, all six at once and arriving one a step, per budget;
* `day-32-tolerance.csv`: a planted bug (in a batch, every decode row after the first attends
  over one position too few), the tiny pool in batches of 8: how many requests diverge, and how
  many of them the near-tie rule excuses at tolerances from 1e-7 to 1e-2 (the tests' is 1e-4).

Every engine is the one of day 32 (`engine_config(32, ...)`: prefill-first steps, the gather
read of the pool, the model's own linears).

    python days/day32/invbench.py                 # writes the three CSVs next to this file
    python days/day32/invbench.py --skip-smollm   # the tiny model only
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from nanocourse import REPO, engine_config, tiny_llama, write_csv
from nanoserve.bench import cpu_line
from nanoserve.contiguous import NoCache
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.sampling import SamplingParams

sys.path.insert(0, str(REPO))
from tests.test_engine import TIE, check_same_or_near_tie  # noqa: E402  the tests' own rule

HERE = Path(__file__).resolve().parent
BUDGETS = {16: "chunked", 512: "unchunked"}
BATCHES = (1, 2, 4, 8, 16)
TOLERANCES = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2)
QUESTIONS = [
    "What is a lighthouse?",
    "Name three rivers.",
    "Why is the sky blue?",
    "What is rain?",
    "How do bees make honey?",
    "Say something kind.",
]


# --- running and comparing ---------------------------------------------------------------------


def reference(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The eager greedy tokens, and the logits (n, V) that predict each of them from one
    cacheless forward over prompt + tokens (what `top2_gap` in the tests reads)."""
    tokens = greedy_tokens(model, prompt, n)
    ids = prompt + tokens
    cache, pos = NoCache(), torch.arange(len(ids))
    cache.begin(pos)
    at = torch.arange(len(prompt) - 1, len(ids) - 1)
    return tokens, model(torch.tensor(ids), pos, cache, logits_at=at)


def run_batch(engine: Engine, reqs: dict, stagger: int = 0, plan_hook=None):
    """Run reqs {id: (prompt, n)} on engine, added together (or `stagger` steps apart); returns
    each request's tokens and the logits each of its tokens was sampled from, {(id, k): (V,)}."""
    execute, plan, logits = engine.runner.execute, engine.runner.plan, {}

    def watched(p):
        out = execute(p)
        rows = [(r, s) for r, s in enumerate(p.rows)] if p.is_decode else [
            (r, s) for r, (s, _, end) in enumerate(p.chunks) if end == len(s.token_ids)
        ]  # fmt: skip
        for r, seq in rows:
            logits[seq.request_id, len(seq.token_ids) - len(seq.prompt_ids)] = out[r].clone()
        return out

    engine.runner.execute = watched
    if plan_hook is not None:
        engine.runner.plan = lambda batch: plan_hook(plan(batch))
    pending, tokens, step = list(reqs.items()), {rid: [] for rid in reqs}, 0
    while pending or engine.has_unfinished():
        if pending and (stagger == 0 or step % stagger == 0):
            for rid, (prompt, n) in pending if stagger == 0 else pending[:1]:
                engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True), request_id=rid)
            pending = [] if stagger == 0 else pending[1:]
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
    return tokens, logits


def compare(model, prompt, ref, ref_logits, got, got_logits, rid, tol=TIE) -> dict:
    """One request's run against the reference: equal or not, where it first differs, the
    largest logit difference and the smallest reference top-2 gap over the positions up to and
    including the first difference (their history is the reference's), and the verdict of the
    tests' near-tie rule at tolerance `tol`."""
    k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
    upto = range(min(k + 1, len(ref)))
    diff = max((got_logits[rid, j] - ref_logits[j]).abs().max().item() for j in upto)
    top = ref_logits[list(upto)].topk(2).values
    gap = (top[:, 0] - top[:, 1]).min().item()
    verdict = "equal"
    if got != ref:
        try:
            near_tie_rule(model, prompt, ref, got, tol)
            verdict = "near-tie"
        except AssertionError:
            verdict = "rejected"
    return {"first_diff": k if got != ref else None, "max_diff": diff, "closest_gap": gap, "verdict": verdict}


def near_tie_rule(model, prompt, ref, got, tol):
    """The tests' `check_same_or_near_tie` at tolerance `tol` (the tests' own is TIE = 1e-4)."""
    import tests.test_engine as rule

    saved, rule.TIE = rule.TIE, tol
    try:
        check_same_or_near_tie(model, prompt, ref, got, [])
    finally:
        rule.TIE = saved


def summarize(results: list[dict], **labels) -> dict:
    return labels | {
        "requests": len(results),
        "tokens_equal": sum(r["verdict"] == "equal" for r in results),
        "near_ties": sum(r["verdict"] == "near-tie" for r in results),
        "rejected": sum(r["verdict"] == "rejected" for r in results),
        "max_abs_diff": f"{max(r['max_diff'] for r in results):.2e}",
        "closest_gap": f"{min(r['closest_gap'] for r in results):.2e}",
    }


# --- the tiny model ---------------------------------------------------------------------------


def tiny_model():
    return tiny_llama(0, 0.05, 512)


def tiny_engine(model, budget: int, max_batch: int = 16) -> Engine:
    per_block = model.cfg.kv_bytes_per_token(torch.float32) * 4
    cfg = engine_config(
        32, max_batch=max_batch, max_model_len=256, block_size=4, kv_budget=per_block * 1024,
        max_num_batched_tokens=budget,
    )  # fmt: skip
    return Engine(model, None, cfg)


def tiny_pool(n: int = 64, new: int = 16, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {f"r{i:02d}": ([rng.randrange(1, 256) for _ in range(rng.randint(3, 40))], new) for i in range(n)}


def groups(ids: list[str], size: int, draw: int) -> list[list[str]]:
    """The pool cut into batches of `size`; each draw shuffles it differently (new neighbours)."""
    ids = list(ids)
    random.Random(1000 * draw + size).shuffle(ids)
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def tiny_table(model=None, pool=None, budgets=BUDGETS, batches=BATCHES, draws=2, refs=None) -> list[dict]:
    model = model or tiny_model()
    pool = pool or tiny_pool()
    refs = refs or {rid: reference(model, p, n) for rid, (p, n) in pool.items()}
    rows = []
    for budget, label in budgets.items():
        for size in batches:
            for draw in range(1 if size == 1 else draws):
                results = []
                for group in groups(pool, size, draw):
                    tokens, logits = run_batch(tiny_engine(model, budget), {r: pool[r] for r in group})
                    for rid in group:
                        ref, ref_logits = refs[rid]
                        results.append(
                            compare(model, pool[rid][0], ref, ref_logits, tokens[rid], logits, rid)
                        )
                rows.append(summarize(results, prefill=label, budget=budget, batch=size, draw=draw))
    return rows


def short_context(plan):
    """The planted bug: in a decode step of more than one row, every row after the first
    attends over one position too few (its newest key is left out). A request alone never
    meets it."""
    if plan.is_decode and len(plan.rows) > 1:
        plan.context_lens = plan.context_lens.clone()
        plan.context_lens[1:] -= 1
    return plan


def tolerance_table(model=None, pool=None, size: int = 8, refs=None) -> list[dict]:
    model = model or tiny_model()
    pool = pool or tiny_pool()
    refs = refs or {rid: reference(model, p, n) for rid, (p, n) in pool.items()}
    runs = {"correct": None, "bug: short context": short_context}
    rows = []
    for name, hook in runs.items():
        got = {}
        for group in groups(pool, size, 0):
            tokens, logits = run_batch(tiny_engine(model, 512), {r: pool[r] for r in group}, plan_hook=hook)
            got |= {rid: (tokens[rid], logits) for rid in group}
        for tol in TOLERANCES:
            results = [
                compare(model, pool[rid][0], *refs[rid], got[rid][0], got[rid][1], rid, tol) for rid in pool
            ]
            rows.append(summarize(results, engine=name, tolerance=f"{tol:g}"))
    return rows


# --- SmolLM2 ------------------------------------------------------------------------------------


def smol_table(model, tok, new: int = 16) -> list[dict]:
    prompts = {
        f"q{i}": (tok.encode_chat([{"role": "user", "content": q}]), new) for i, q in enumerate(QUESTIONS)
    }
    refs = {rid: reference(model, p, n) for rid, (p, n) in prompts.items()}
    ids = list(prompts)
    layouts = {
        "alone": ([[r] for r in ids], 0),
        "pairs": ([ids[i : i + 2] for i in range(0, len(ids), 2)], 0),
        "all six": ([ids], 0),
        "one a step": ([ids], 1),
    }
    rows = []
    for budget, label in BUDGETS.items():
        for name, (batches, stagger) in layouts.items():
            results = []
            for group in batches:
                cfg = engine_config(
                    32, max_batch=8, max_model_len=256, kv_budget="16MiB", max_num_batched_tokens=budget
                )
                engine = Engine(model, tok, cfg)
                tokens, logits = run_batch(engine, {r: prompts[r] for r in group}, stagger)
                for rid in group:
                    ref, ref_logits = refs[rid]
                    results.append(compare(model, prompts[rid][0], ref, ref_logits, tokens[rid], logits, rid))
            rows.append(summarize(results, prefill=label, budget=budget, layout=name))
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip-smollm", action="store_true", help="only the tiny model's tables")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    t0 = time.perf_counter()
    model, pool = tiny_model(), tiny_pool()
    refs = {rid: reference(model, p, n) for rid, (p, n) in pool.items()}
    for name, table in (("day-32-tiny.csv", tiny_table), ("day-32-tolerance.csv", tolerance_table)):
        rows = table(model, pool, refs=refs)
        write_csv(rows, HERE / name)
        for row in rows:
            print("  ", row)
    if not args.skip_smollm:
        from nanoserve.models import load_model
        from nanoserve.tokenizer import Tokenizer
        from nanoserve.weights import fetch_default_model

        model_dir = fetch_default_model()
        smol, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
        write_csv(smol_table(smol, tok), HERE / "day-32-smollm.csv")
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

"""Day 24: one decode step for many paged rows against the same rows decoded one by one.

Sixteen prompts of different lengths (random ids above 256, lengths uniform in `--prompt`) are
prefilled once into one `BatchedPagedKVCache` pool, each with its own block table from a
`BlockAllocator`, and each gets its greedy first token. Then, for 1, 2, 4, 8 and 16 rows (the
first that many sequences), the decode step that feeds every row its newest token is run
two ways, both reading the pool as the engine does on day 24 (`attention="gather"`: a padded
copy of every row's window, masked past the row's length):

* `batched`: `plan_decode` over all the rows, one forward;
* `one by one`: `plan_decode` over each row alone, one forward per row.

Every way must give each row the same logits (within `TOL`, fp32) and the same greedy token;
the script asserts it. Counted per row count: the rows' shortest and longest context, the
window width W the plan pads every row to, the K/V the rows own and the step reads (all
layers), and what gather copies (rows x W positions). Timed: the step, `--repeats` times with
the ways taking turns, fastest kept. Re-running a decode step writes the same K/V to the same
slots, so every repeat reads the same pool.

    python days/day24/decodebench.py          # SmolLM2-135M -> day-24-decode.csv
    python days/day24/decodebench.py --tiny --out /tmp/decode.csv
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from nanocourse import tiny_llama, write_csv
from nanoserve.bench import cpu_line
from nanoserve.blocks import BlockAllocator
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.models import load_model
from nanoserve.plan import plan_decode, plan_prefill
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Sequence
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV_DECODE = HERE / "day-24-decode.csv"
BLOCK_SIZE = 16
TOL = 1e-3  # fp32 logits; batching changes only the rounding of the matmuls (~1e-5 seen)
ROWS = (1, 2, 4, 8, 16)
WAYS = ("batched", "one by one")


def prompts(n: int, lengths=(32, 256), vocab: int = 49152, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    low = 256 if vocab > 1024 else 0
    return [[rng.randrange(low, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def decoding_rows(model, prompt_ids, block_size: int = BLOCK_SIZE, extra_blocks: int = 4):
    """Prefill every prompt into one pool and append its greedy first token, so each sequence
    is one decode step from its next token. Returns (seqs, allocator, cache)."""
    need = sum(-(-(len(p) + 1) // block_size) for p in prompt_ids) + extra_blocks
    alloc = BlockAllocator(need, block_size, enable_prefix_caching=False)
    seqs = []
    for i, p in enumerate(prompt_ids):
        seq = Sequence(f"r{i}", p, SamplingParams(), block_size)
        alloc.allocate_prompt(seq.block_table, seq.token_ids)
        seqs.append(seq)
    cache = BatchedPagedKVCache(model.cfg, need * block_size, dtype=model.dtype, attention="gather")
    with torch.inference_mode():
        for seq in seqs:  # one prompt a forward: the day is about decode, not about prefill
            plan = plan_prefill([(seq, 0, len(seq.token_ids))], block_size)
            first = model(plan.input_ids, plan.positions, cache.view(plan), logits_at=plan.logits_at)
            seq.num_computed = len(seq.token_ids)
            seq.token_ids.append(int(first[0].argmax()))
            alloc.append_slots(seq.block_table, len(seq.token_ids))
    return seqs, alloc, cache


def decode(model, cache, seqs, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, float]:
    """One decode step over seqs: logits (B, vocab) and the seconds of the forward."""
    plan = plan_decode(seqs, block_size)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(plan.input_ids, plan.positions, cache.view(plan), logits_at=plan.logits_at)
    return logits, time.perf_counter() - t0


def one_by_one(model, cache, seqs, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, float]:
    runs = [decode(model, cache, [s], block_size) for s in seqs]
    return torch.cat([r[0] for r in runs]), sum(r[1] for r in runs)


def run_way(way: str, model, cache, seqs, block_size: int = BLOCK_SIZE):
    if way == "one by one":
        return one_by_one(model, cache, seqs, block_size)
    return decode(model, cache, seqs, block_size)


def counts(cfg, seqs, block_size: int = BLOCK_SIZE) -> dict:
    """What a decode step over seqs reads, by arithmetic alone."""
    ctx = [len(s.token_ids) for s in seqs]
    width = max(len(s.block_table.blocks) for s in seqs) * block_size
    per_token = cfg.kv_bytes_per_token(torch.float32)
    return {
        "rows": len(seqs),
        "ctx_min": min(ctx),
        "ctx_max": max(ctx),
        "window": width,
        "kv_mb": round(sum(ctx) * per_token / 1e6, 3),
        "gather_mb": round(len(seqs) * width * per_token / 1e6, 3),
    }


def table(model, seqs, cache, rows=ROWS, repeats: int = 3, block_size: int = BLOCK_SIZE):
    out = []
    for n in rows:
        part = seqs[:n]
        best, logits = {}, {}
        for _ in range(repeats):
            for way in WAYS:
                logits[way], seconds = run_way(way, model, cache, part, block_size)
                best[way] = min(best.get(way, seconds), seconds)
        ref = logits["one by one"]
        for way in WAYS:
            diff = (logits[way] - ref).abs().max().item()
            if diff > TOL or logits[way].argmax(-1).tolist() != ref.argmax(-1).tolist():
                raise AssertionError(f"{n} rows, {way}: logits differ from the rows alone by {diff:.2e}")
        for way in WAYS:
            out.append(
                {
                    **counts(model.cfg, part, block_size),
                    "way": way,
                    "same_token": n,
                    "step_ms": round(1e3 * best[way], 1),
                    "ms_per_token": round(1e3 * best[way] / n, 1),
                    "tok_s": round(n / best[way], 1),
                    "x_batched": round(best[way] / best["batched"], 2),
                    "cpu": cpu_line(),
                }
            )
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="the tiny random-weight Llama instead")
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--prompt", type=int, nargs=2, default=(32, 256), help="prompt lengths, low high")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(CSV_DECODE))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    model = tiny_llama(0) if args.tiny else load_model(resolve_model_dir(args.model))
    ids = prompts(max(args.rows), tuple(args.prompt), model.cfg.vocab_size, args.seed)
    t0 = time.perf_counter()
    seqs, _, cache = decoding_rows(model, ids)
    print(f"prefilled {len(seqs)} prompts ({sum(map(len, ids))} tokens) in {time.perf_counter() - t0:.1f} s")
    rows = table(model, seqs, cache, args.rows, args.repeats)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")


if __name__ == "__main__":
    main()

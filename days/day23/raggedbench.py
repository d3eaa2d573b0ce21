"""Day 23: prompts of different lengths prefilled three ways, packed, one at a time, padded.

Every way runs the package's own prefill forward (`plan.plan_prefill` over sequences whose
block tables come from a `BlockAllocator`, the model writing and reading a
`BatchedPagedKVCache`), so the ways differ only in what they hand it:

* `packed`: every prompt's tokens end to end in one plan, one forward (the engine's prefill
  step);
* `one at a time`: one plan and one forward per prompt;
* `padded`: every prompt right-padded with token 0 to the longest, all rows in one plan, one
  forward. The pads sit after each prompt's last token, so the causal mask keeps them out of
  every real token's attention; they are computed all the same, through every linear and every
  attention row. `logits_at` points at each row's last real token.

All three must give the same logits at each prompt's last token (within `TOL`, fp32) and the
same greedy next token; the script asserts it. Counted per way: real and computed tokens, the
padding's share, the forwards run, and the attention scores computed per head and layer (a
row of n queries over its n keys is n * n scores, the masked half included, as SDPA computes
them). Timed: the forward(s) of each way, `--repeats` times taking turns, fastest kept.

Three workloads of `--prompts` prompts (random token ids above 256), the linears plain (as on
day 23; day 59 packs them), one thread:

    python days/day23/raggedbench.py           # SmolLM2-135M -> day-23-ragged.csv
    python days/day23/raggedbench.py --tiny --out /tmp/ragged.csv
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
from nanoserve.plan import plan_prefill
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Sequence
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV_RAGGED = HERE / "day-23-ragged.csv"
BLOCK_SIZE = 16
PAD_ID = 0
TOL = 1e-3  # fp32 logits: the ways differ only in how matmuls are batched (~1e-5 seen)
WAYS = ("packed", "one at a time", "padded")
# (name, lengths of prompt 0, lengths of the others): `--prompts` prompts in each
WORKLOADS = {
    "similar": ((96, 128), (96, 128)),
    "spread": ((16, 128), (16, 128)),
    "one long": ((128, 128), (16, 32)),
}


def workload(name: str, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of random ids (above the first 256 of a real vocabulary), lengths as named."""
    first, rest = WORKLOADS[name]
    rng = random.Random(f"{name}-{seed}")
    low = 256 if vocab > 1024 else 0
    lengths = [rng.randint(*first)] + [rng.randint(*rest) for _ in range(n - 1)]
    return [[rng.randrange(low, vocab) for _ in range(k)] for k in lengths]


def sequences(prompts, block_size: int = BLOCK_SIZE, pad_to: int | None = None):
    """A Sequence per prompt (padded with PAD_ID to pad_to tokens if given), each with blocks
    for all its tokens from one allocator sized to fit them, and that allocator."""
    padded = [p + [PAD_ID] * ((pad_to or 0) - len(p)) for p in prompts]
    alloc = BlockAllocator(
        sum(-(-len(p) // block_size) for p in padded), block_size, enable_prefix_caching=False
    )
    seqs = []
    for i, p in enumerate(padded):
        seq = Sequence(f"p{i}", p, SamplingParams(), block_size)
        alloc.allocate_prompt(seq.block_table, seq.token_ids)
        seqs.append(seq)
    return seqs, alloc


def plans(way: str, prompts, block_size: int = BLOCK_SIZE):
    """The prefill plan(s) of one way, and the slots they need."""
    if way == "one at a time":
        seqs, alloc = sequences(prompts, block_size)
        return [
            plan_prefill([(s, 0, len(s.token_ids))], block_size) for s in seqs
        ], alloc.num_blocks * block_size
    longest = max(map(len, prompts)) if way == "padded" else None
    seqs, alloc = sequences(prompts, block_size, pad_to=longest)
    plan = plan_prefill([(s, 0, len(s.token_ids)) for s in seqs], block_size)
    if way == "padded":  # sample from each row's last real token, not from its last pad
        plan.logits_at = torch.tensor(
            [start + len(p) - 1 for (start, _, _), p in zip(plan.row_spans, prompts)]
        )
    return [plan], alloc.num_blocks * block_size


def prefill(model, way: str, prompts, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, float]:
    """Logits at every prompt's last token, (B, vocab), and the seconds the forward(s) took."""
    step_plans, num_slots = plans(way, prompts, block_size)
    cache = BatchedPagedKVCache(model.cfg, num_slots, dtype=model.dtype, attention="gather")  # day 18's read
    cache.ensure_pools()  # allocated before the clock starts: every way pays the same
    out, seconds = [], 0.0
    with torch.inference_mode():
        for plan in step_plans:
            t0 = time.perf_counter()
            out.append(model(plan.input_ids, plan.positions, cache.view(plan), logits_at=plan.logits_at))
            seconds += time.perf_counter() - t0
    return torch.cat(out), seconds


def counts(way: str, prompts) -> dict:
    """What a way computes, by arithmetic alone."""
    lens = [len(p) for p in prompts]
    width = max(lens) if way == "padded" else None
    rows = [width or n for n in lens]
    return {
        "prompts": len(lens),
        "real_tokens": sum(lens),
        "computed_tokens": sum(rows),
        "padding_pct": round(100 * (sum(rows) - sum(lens)) / sum(rows), 1),
        "forwards": len(lens) if way == "one at a time" else 1,
        "scores": sum(n * n for n in rows),
    }


def table(model, named: dict[str, list[list[int]]], repeats: int = 2) -> list[dict]:
    """One row per workload and way; every way checked against packed."""
    rows = []
    for name, prompts in named.items():
        best, logits = {}, {}
        for _ in range(repeats):  # the ways take turns; each keeps its fastest
            for way in WAYS:
                logits[way], seconds = prefill(model, way, prompts)
                best[way] = min(best.get(way, seconds), seconds)
        ref = logits["packed"]
        for way in WAYS:
            diff = (logits[way] - ref).abs().max().item()
            if diff > TOL or logits[way].argmax(-1).tolist() != ref.argmax(-1).tolist():
                raise AssertionError(f"{name}, {way}: logits differ from packed by {diff:.2e}")
            rows.append(
                {
                    "workload": name,
                    "way": way,
                    **counts(way, prompts),
                    "same_next_token": len(prompts),
                    "max_diff": f"{diff:.1e}",
                    "ms": round(1e3 * best[way], 1),
                    "tok_s": round(sum(map(len, prompts)) / best[way], 1),
                    "x_packed": round(best[way] / best["packed"], 2),
                }
            )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="the tiny random-weight Llama instead")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(CSV_RAGGED))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    model = tiny_llama(0) if args.tiny else load_model(resolve_model_dir(args.model))
    named = {name: workload(name, args.prompts, model.cfg.vocab_size, args.seed) for name in WORKLOADS}
    rows = table(model, named, args.repeats)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out, cpu=True)}")


if __name__ == "__main__":
    main()

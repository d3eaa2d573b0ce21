"""Day 11: the contiguous K/V cache against re-running the whole sequence for every token.

Two measurements on the default model (SmolLM2-135M, real weights):

* equality: for each chat prompt, greedy tokens from `nanoserve.generate.greedy_tokens`
  (prefill once, then one position a step on a `ContiguousKVCache`) against a loop with no
  cache at all (`NoCache`: every step runs the prompt and everything generated so far), and the
  largest |logit difference| between the two at any step, written as a bound. Deterministic.
* speed, as the text grows: at each length L, one step of the no-cache loop (a forward over all
  L tokens, logits for the last one) against one decode step on a cache already holding L - 1
  positions (a forward over one token that attends over L). The step times are the fastest of a
  few rounds over all the lengths, on whatever CPU runs this; the token and byte counts next to
  them are facts.

    python days/day11/cachebench.py                              # -> day-11-equal.csv, day-11-cachebench.csv
    python days/day11/cachebench.py --lengths 64 128 256 512 1024 2048 --repeats 5 --out-bench /tmp/b.csv
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.bench import cpu_line
from nanoserve.contiguous import ContiguousKVCache, NoCache
from nanoserve.generate import greedy_tokens
from nanoserve.models import Llama, load_model
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV_EQUAL = HERE / "day-11-equal.csv"
CSV_BENCH = HERE / "day-11-cachebench.csv"
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in two sentences.",
]
NEW_TOKENS = 16  # per prompt: the no-cache loop re-runs up to 56 tokens a step, and the notebook stays short
LENGTHS = [64, 128, 256, 512, 1024]
LOGIT_BOUND = 1e-3  # the same forward in fp32; only the matmul shapes differ (L rows or 1)


# --- the loop without a cache ---------------------------------------------------------------


def no_cache_step(model: Llama, ids: list[int]) -> torch.Tensor:
    """Logits (V,) for the token after `ids`: the whole sequence runs again, nothing is kept."""
    positions = torch.arange(len(ids), device=model.device)
    cache = NoCache()
    cache.begin(positions)
    last = torch.tensor([len(ids) - 1], device=model.device)
    return model(torch.tensor(ids, device=model.device), positions, cache, logits_at=last)[0]


def no_cache_greedy(model: Llama, prompt: list[int], n: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(token, logits) for n greedy steps, each one a forward over everything so far."""
    ids = list(prompt)
    for _ in range(n):
        logits = no_cache_step(model, ids)
        token = int(logits.argmax())
        yield token, logits
        ids.append(token)


def cached_logits(
    model: Llama, prompt: list[int], tokens: list[int], cache_cls=ContiguousKVCache
) -> list[torch.Tensor]:
    """The logits a cached greedy run saw at each step: prefill the prompt, then feed `tokens`
    one at a time. (The same steps as `decode_loop`, kept here so the logits can be compared;
    `cache_cls` lets a notebook swap in a cache built wrong.)"""
    cache = cache_cls(model.cfg, len(prompt) + len(tokens), dtype=model.dtype, device=model.device)
    positions = torch.arange(len(prompt), device=model.device)
    ids = torch.tensor(prompt, device=model.device)
    last = torch.tensor([len(prompt) - 1], device=model.device)
    out = []
    for token in tokens:
        cache.begin(positions)
        out.append(model(ids, positions, cache, logits_at=last)[0])
        ids = torch.tensor([token], device=model.device)
        positions = torch.tensor([cache.length], device=model.device)
        last = torch.zeros(1, dtype=torch.long, device=model.device)
    return out


def equal_row(model: Llama, tok: Tokenizer, prompt: str, n: int = NEW_TOKENS) -> dict:
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    cached = greedy_tokens(model, ids, n)  # EOS not obeyed: n tokens on both sides
    plain = list(no_cache_greedy(model, ids, n))
    dlogit = max(
        (a - b).abs().max().item() for a, b in zip(cached_logits(model, ids, cached), (lg for _, lg in plain))
    )
    return {
        "prompt": prompt,
        "prompt_tokens": len(ids),
        "new_tokens": n,
        "identical": "yes" if cached == [t for t, _ in plain] else "no",
        "max_abs_dlogit": "<1e-3" if dlogit < LOGIT_BOUND else f"{dlogit:.1e}",
        "tokens_forwarded_cached": len(ids) + n - 1,
        "tokens_forwarded_no_cache": sum(len(ids) + i for i in range(n)),
    }


# --- step time as the text grows -------------------------------------------------------------


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_step_seconds(model: Llama, ids: list[int], steps: int = 3) -> float:
    """Fastest of `steps` decode steps on a cache prefilled with ids[:-1] (lengths L .. L+steps-1)."""
    n = len(ids) - 1
    cache = ContiguousKVCache(model.cfg, n + steps, dtype=model.dtype, device=model.device)
    positions = torch.arange(n, device=model.device)
    cache.begin(positions)
    model(torch.tensor(ids[:n], device=model.device), positions, cache, logits_at=positions[-1:])
    best, token = float("inf"), torch.tensor(ids[n:], device=model.device)
    zero = torch.zeros(1, dtype=torch.long, device=model.device)
    for _ in range(steps):
        positions = torch.tensor([cache.length], device=model.device)
        t0 = time.perf_counter()
        cache.begin(positions)
        model(token, positions, cache, logits_at=zero)
        best = min(best, time.perf_counter() - t0)
    return best


def bench(model: Llama, lengths=LENGTHS, repeats: int = 3, seed: int = 0) -> list[dict]:
    """One row per length. The lengths are measured round-robin, `repeats` rounds, and each keeps
    its fastest time: on a shared machine a burst of someone else's work lands on one round of
    every length instead of on all the rounds of one."""
    g = torch.Generator().manual_seed(seed)
    seqs = {n: torch.randint(100, model.cfg.vocab_size, (n,), generator=g).tolist() for n in lengths}
    no_cache_step(model, seqs[lengths[0]][:16])  # warm-up: first calls pick kernels
    plain = dict.fromkeys(lengths, float("inf"))
    cached = dict.fromkeys(lengths, float("inf"))
    for _ in range(repeats):
        for n, ids in seqs.items():  # ordinary tokens: SmolLM2's first ids are special
            plain[n] = min(plain[n], _seconds(lambda ids=ids: no_cache_step(model, ids)))
            cached[n] = min(cached[n], decode_step_seconds(model, ids))
    kv = model.cfg.kv_bytes_per_token(model.dtype)
    return [
        {
            "length": n,
            "no_cache_tokens_per_step": n,
            "cached_tokens_per_step": 1,
            "kv_cache_mb": round(n * kv / 1e6, 2),
            "no_cache_ms": round(1e3 * plain[n], 1),
            "cached_ms": round(1e3 * cached[n], 1),
            "speedup": round(plain[n] / cached[n], 1),
        }
        for n in lengths
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="greedy tokens per prompt")
    p.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="sequence lengths to time")
    p.add_argument("--repeats", type=int, default=5, help="rounds over the lengths (fastest kept)")
    p.add_argument("--out-equal", default=str(CSV_EQUAL), help="CSV of the token comparison")
    p.add_argument("--out-bench", default=str(CSV_BENCH), help="CSV of the step times")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(cpu_line())
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    equal = [equal_row(model, tok, prompt, args.new_tokens) for prompt in PROMPTS]
    for r in equal:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(equal, args.out_equal)}")
    rows = bench(model, args.lengths, args.repeats)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out_bench, cpu=True)}")
    same = sum(r["identical"] == "yes" for r in equal)
    speed = " ".join(f"L{r['length']}={r['speedup']}x" for r in rows)
    print(f"cachebench identical={same}/{len(equal)} {speed}")


if __name__ == "__main__":
    main()

"""Day 8: greedy generation without a cache, and what re-running the whole sequence costs.

Without a cache, every new token means one forward over the whole sequence so far: the prompt
and everything generated. `greedy_no_cache` is that loop (`nanoserve.contiguous.NoCache` keeps
no K/V between calls). It writes two tables:

* `day-08-greedy.csv`: for each chat prompt, the no-cache greedy continuation against
  `nanoserve.generate.greedy_tokens` (prefill once, then one token a step on a contiguous
  cache): whether the ids are identical, and if not, whether the first difference is a near-tie
  (the top two logits within `TIE` of each other), and the text (newlines written as " / ").
  Also the tokens each way had to run through the model, and the seconds each took (measured).
* `day-08-steps.csv`: the cost of one step at a sequence length L, measured: a no-cache step is
  a forward over L tokens, a cached step one token that attends over L cached positions. The
  deterministic columns are the tokens run and the FLOPs of each (matmuls 2 x params per
  token run, attention 2 x 2 x heads x head_dim per query-key pair, causal, and the LM head for
  the one row whose logits are taken); the timings are the fastest of `repeats` calls, and
  `attention_ms` times the no-cache step's attention alone (every layer, random Q/K/V).

    python days/day08/nocache.py                       # both CSVs at the default sizes
    python days/day08/nocache.py --length 64 --length 1024 --repeats 5 --out-dir /tmp/d8
    python days/day08/nocache.py --max-tokens 64 --prompt "Tell me a story." --out-dir /tmp/d8
    python days/day08/nocache.py --threads 1           # steadier timings on a busy machine
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from nanocourse import best_of, write_csv
from nanoserve.contiguous import ContiguousKVCache, NoCache, causal_attention
from nanoserve.generate import greedy_tokens
from nanoserve.models import Llama, load_model
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 24  # per prompt, as on Day 7
LENGTHS = (32, 64, 128, 192, 256, 320, 384, 448, 512)  # sequence lengths for the step table
REPEATS = 3  # timed calls per length; the fastest is kept
TIE = 1e-4  # a top-1/top-2 logit gap below this is a near-tie (as in tests/test_engine.py)
PROMPTS = [  # Day 7's five prompts
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in two sentences.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning, my friend' into Spanish.",
]


def full_logits(model: Llama, seq: list[int]) -> torch.Tensor:
    """One forward over the whole of `seq` with no cache; the logits (V,) after its last token."""
    cache = NoCache()
    positions = torch.arange(len(seq), device=model.device)
    cache.begin(positions)
    last = torch.tensor([len(seq) - 1], device=model.device)
    return model(torch.tensor(seq, device=model.device), positions, cache, logits_at=last)[0]


@dataclass
class NoCacheRun:
    tokens: list[int]
    step_lengths: list[int] = field(default_factory=list)  # the sequence length each step ran over
    step_seconds: list[float] = field(default_factory=list)


def greedy_no_cache(model: Llama, prompt_ids: list[int], max_tokens: int, eos_ids=frozenset()) -> NoCacheRun:
    """Greedy decoding that re-runs the whole sequence for every token, timing each step."""
    seq, run = list(prompt_ids), NoCacheRun([])
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        token = int(full_logits(model, seq).argmax())
        run.step_seconds.append(time.perf_counter() - t0)
        run.step_lengths.append(len(seq))
        run.tokens.append(token)
        seq.append(token)
        if token in eos_ids:
            break
    return run


def top2_gap(model: Llama, seq: list[int]) -> float:
    top = full_logits(model, seq).topk(2).values
    return (top[0] - top[1]).item()


def compare(model: Llama, prompt_ids: list[int], ref: list[int], got: list[int]) -> str:
    """'identical', 'near-tie at k (gap g)', or raise: a difference that is not a near-tie."""
    if got == ref:
        return "identical"
    k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    gap = top2_gap(model, prompt_ids + ref[:k])
    if gap >= TIE:
        raise AssertionError(
            f"the tokens differ at step {k}, where the top-2 gap is {gap:.2e}: a real difference"
        )
    return f"near-tie at {k} (gap {gap:.1e})"


def greedy_rows(model: Llama, tok: Tokenizer, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> list[dict]:
    rows = []
    for prompt in prompts:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        run = greedy_no_cache(model, ids, max_tokens, tok.eos_ids)
        t0 = time.perf_counter()
        cached = greedy_tokens(model, ids, max_tokens, eos_ids=tok.eos_ids)
        cached_s = time.perf_counter() - t0
        n = len(run.tokens)
        rows.append(
            {
                "prompt": prompt,
                "prompt_tokens": len(ids),
                "new_tokens": n,
                "text": tok.decode(run.tokens).replace("\n", " / "),  # one line per row
                "finish": "eos" if run.tokens[-1] in tok.eos_ids else "length",
                "vs_cached": compare(model, ids, cached, run.tokens),
                "tokens_run_nocache": sum(run.step_lengths),  # n * prompt + n (n - 1) / 2
                "tokens_run_cached": len(ids) + n - 1,  # the prompt once, then one a step
                "nocache_s": f"{sum(run.step_seconds):.2f}",
                "cached_s": f"{cached_s:.2f}",
            }
        )
    return rows


def step_flop_parts(model: Llama, length: int, cached: bool) -> dict[str, int]:
    """FLOPs of one step at sequence length `length`, by kind: the blocks' weight matmuls,
    causal attention (scores and values, every layer), and the LM head for one row."""
    cfg = model.cfg
    per_token = 2 * sum(p.numel() for b in model.blocks for p in b.parameters() if p.dim() == 2)
    pair = 2 * 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers  # per query-key pair
    head = 2 * cfg.vocab_size * cfg.hidden_size
    if cached:  # one query over the cached positions and itself
        return {"matmul": per_token, "attention": pair * (length + 1), "head": head}
    return {"matmul": per_token * length, "attention": pair * length * (length + 1) // 2, "head": head}


def step_flops(model: Llama, length: int, cached: bool) -> int:
    return sum(step_flop_parts(model, length, cached).values())


def _fastest(fn, repeats: int) -> float:
    fn()  # warm-up
    return best_of(fn, repeats)


def step_rows(model: Llama, lengths=LENGTHS, repeats: int = REPEATS, seed: int = 0) -> list[dict]:
    """Time one no-cache step over L tokens, one cached decode step at position L, and the
    no-cache step's causal attention on its own."""
    gen = torch.Generator().manual_seed(seed)
    cfg, rows = model.cfg, []
    for length in lengths:
        seq = torch.randint(model.cfg.vocab_size, (length + 1,), generator=gen).tolist()
        nocache_s = _fastest(lambda seq=seq, n=length: full_logits(model, seq[:n]), repeats)
        cache = ContiguousKVCache(model.cfg, length + 1, dtype=model.dtype, device=model.device)
        positions = torch.arange(length, device=model.device)
        cache.begin(positions)
        model(torch.tensor(seq[:length], device=model.device), positions, cache, logits_at=positions[-1:])
        one, pos = (
            torch.tensor(seq[length:], device=model.device),
            torch.tensor([length], device=model.device),
        )

        def decode_step(cache=cache, one=one, pos=pos, n=length):
            cache.length = n  # rewind: every repeat writes position n again
            cache.begin(pos)
            model(one, pos, cache)

        cached_s = _fastest(decode_step, repeats)
        # attention alone: the no-cache step's causal attention, all layers
        q = torch.randn(length, cfg.num_heads, cfg.head_dim, generator=gen)
        k, v = (torch.randn(cfg.num_kv_heads, length, cfg.head_dim, generator=gen) for _ in range(2))

        def attention_only(q=q, k=k, v=v, pos=positions):
            for _ in range(cfg.num_layers):
                causal_attention(q, k, v, pos)

        attention_s = _fastest(attention_only, repeats)
        rows.append(
            {
                "length": length,
                "tokens_run_nocache": length,
                "tokens_run_cached": 1,
                "gflop_nocache": f"{step_flops(model, length, cached=False) / 1e9:.2f}",
                "gflop_cached": f"{step_flops(model, length, cached=True) / 1e9:.3f}",
                "nocache_ms": f"{1e3 * nocache_s:.1f}",
                "cached_ms": f"{1e3 * cached_s:.1f}",
                "attention_ms": f"{1e3 * attention_s:.1f}",
            }
        )
    return rows


def fit_quadratic(lengths, seconds) -> tuple[float, float, float]:
    """Least-squares t = a + b L + c L^2 over the measured steps; returns (a, b, c) in seconds."""
    L = np.asarray(lengths, dtype=float)
    A = np.stack([np.ones_like(L), L, L * L], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(A, np.asarray(seconds, dtype=float), rcond=None)
    return float(a), float(b), float(c)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="greedy tokens per prompt")
    p.add_argument("--prompt", action="append", help="a user message (repeat; default: Day 7's five)")
    p.add_argument("--length", type=int, action="append", help="sequence length to time (repeat)")
    p.add_argument("--repeats", type=int, default=REPEATS, help="timed calls per length")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--out-dir", default=str(HERE), help="folder for the CSVs")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    out = Path(args.out_dir)
    rows = greedy_rows(model, tok, args.prompt or PROMPTS, args.max_tokens)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, out / 'day-08-greedy.csv', cpu=True)}")
    steps = step_rows(model, tuple(args.length or LENGTHS), args.repeats)
    for r in steps:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(steps, out / 'day-08-steps.csv', cpu=True)}")
    a, b, c = fit_quadratic([r["length"] for r in steps], [float(r["nocache_ms"]) / 1e3 for r in steps])
    print(f"nocache step fit: {1e3 * a:.1f} ms + {1e6 * b:.1f} us x L + {1e9 * c:.2f} ns x L^2")


if __name__ == "__main__":
    main()

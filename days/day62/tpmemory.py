"""Day 62's benchmark: SmolLM2-135M in one process against the same model split over 3 ranks.

Both sides run the same command, `python -m nanoserve generate PROMPT --max-tokens N
--ignore-eos --threads 1 --weights dtype` (the fp32 conversion on both sides), through
`nanoserve.bench.tp_generate`: once as a single process and once as 3 ranks started by
`nanoserve.tp.spawn` with torchrun's variables (gloo on the CPU). The runs alternate, `reps`
times each, and the best decode rate of each side is kept, since the machine is shared.

One row per rank (the single process is rank 0 of 1):

* `weight_mb`, `kv_pool_mb`, `kv_tokens`: what the rank holds, as rank 0 prints it for every
  rank under tensor parallelism; for the single process the same two sums are taken here on an
  engine built with the command's own config (`build_engine`, one row, one thread);
* `decode_tok_s`: rank 0's decode rate, the best of the reps (a timing: not compared);
* `text_equal`: whether every rep's text, on either side, equals the single process's first one.

    python days/day62/tpmemory.py                          # writes day-62-memory.csv here
    python days/day62/tpmemory.py --reps 1 --tokens 8 --out /tmp/m.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nanocourse import engine_config, write_csv
from nanoserve.bench import cpu_line, tp_generate
from nanoserve.engine import build_engine
from nanoserve.models import model_weight_bytes
from nanoserve.tp import pool_bytes

HERE = Path(__file__).resolve().parent
PROMPT = "What is the capital of France?"


def one_process_share() -> dict:
    """Weights and KV pool of the engine `generate` builds in one process (max_batch 1, 1 thread)."""
    engine = build_engine(engine_config(62, max_batch=1, threads=1))
    slots = engine.pool.num_slots
    return {
        "weight_mb": round(model_weight_bytes(engine.model) / 1e6, 1),
        "kv_pool_mb": round(pool_bytes(engine.model, slots) / 1e6, 1),
        "kv_tokens": slots,
    }


def measure(ranks: int = 3, tokens: int = 24, reps: int = 3, prompt: str = PROMPT) -> list[dict]:
    # --weights dtype: both sides run the converted fp32 model (a single process on a CPU would
    # otherwise serve the GGUF's own blocks, day 60's default, which a rank cannot split)
    args = [prompt, "--max-tokens", str(tokens), "--ignore-eos", "--threads", "1", "--weights", "dtype"]
    texts: dict[int, list[str]] = {1: [], ranks: []}
    rates: dict[int, list[float]] = {1: [], ranks: []}
    shares = []
    for _ in range(reps):  # alternate, so both sides see the same neighbours
        for n in (1, ranks):
            text, got, rate = tp_generate(n, args)
            texts[n].append(text)
            rates[n].append(rate["decode_tok_s"])
            shares = got if n == ranks else shares
            print(f"  {n} rank{'s' if n > 1 else ' '}: {rate['decode_tok_s']:.1f} tok/s")
    reference = texts[1][0]
    equal = {n: all(t == reference for t in texts[n]) for n in texts}
    torch.set_num_threads(1)
    rows = [{"ranks": 1, "rank": 0} | one_process_share()]
    rows[0] |= {"decode_tok_s": max(rates[1]), "text_equal": equal[1]}
    for sh in shares:
        rows.append({"ranks": ranks} | sh | {"decode_tok_s": max(rates[ranks]), "text_equal": equal[ranks]})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "day-62-memory.csv"))
    args = p.parse_args()
    print(cpu_line(), "(each rank: 1 thread)")
    rows = measure(args.ranks, args.tokens, args.reps)
    for r in rows:
        print(r)
    one, many = rows[0], rows[1:]
    print(
        f"RESULT tp {args.ranks} ranks: weights {max(r['weight_mb'] for r in many)} MB a rank "
        f"(one process {one['weight_mb']}), KV {max(r['kv_pool_mb'] for r in many)} MB a rank "
        f"(one process {one['kv_pool_mb']}), decode {many[0]['decode_tok_s'] / one['decode_tok_s']:.2f}x, "
        f"text equal {all(r['text_equal'] for r in rows)}"
    )
    write_csv(rows, args.out, cpu=True)


if __name__ == "__main__":
    main()

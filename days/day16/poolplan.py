"""Day 16: what a KV memory budget buys, for SmolLM2-135M in fp32 and bf16 (arithmetic only).

`nanoserve.pool.plan_pool` prices one block, K and V of every layer for `block_size` tokens,
and divides the budget by it after setting one slot aside for the sink. This script writes
two tables from the model's shape alone (its `config.json`; no weights are loaded):

* `day-16-block.csv`: the price of a token and of a block, factor by factor
  (2 x layers x kv_heads x head_dim x dtype bytes x block_size), next to the plan's own
  `bytes_per_slot` and `bytes_per_block`, for each dtype and a few block sizes.
* `day-16-budgets.csv`: for each budget and dtype, the plan (`num_blocks`, tokens, the bytes
  the pools take, sink included) and how many requests fit at once when each holds a context
  of L tokens (`num_blocks // ceil(L / block_size)`), at L = 512, 2048 and the model's full
  context. `fits_full_context` says whether an engine with `max_model_len` = the model's
  context would start on that budget (`Engine` refuses a pool smaller than one such request).

Every number here is a fact: nothing is timed.

    python days/day16/poolplan.py                          # -> day-16-block.csv, day-16-budgets.csv
    python days/day16/poolplan.py --budgets 1GiB 40GiB --contexts 4096 --out-budgets /tmp/b.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.models import LlamaConfig
from nanoserve.pool import dtype_name, parse_bytes, plan_pool
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV_BLOCK = HERE / "day-16-block.csv"
CSV_BUDGETS = HERE / "day-16-budgets.csv"
BUDGETS = ("64MiB", "256MiB", "512MiB", "2GiB", "8GiB")
DTYPES = (torch.float32, torch.bfloat16)
CONTEXTS = (512, 2048)  # the model's full context is added as the last one
BLOCK_SIZES = (8, 16, 32)
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def bytes_per_block(cfg: LlamaConfig, dtype: torch.dtype, block_size: int = 16) -> int:
    """By hand: K and V (2), every layer, every K/V head, head_dim numbers, for block_size tokens."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype] * block_size


def blocks_per_request(context: int, block_size: int = 16) -> int:
    """Blocks one sequence of `context` tokens holds: its last block may be partly empty."""
    return -(-context // block_size)


def block_table(cfg: LlamaConfig, dtypes=DTYPES, block_sizes=BLOCK_SIZES) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for bs in block_sizes:
            plan = plan_pool(cfg, dtype, block_size=bs, budget_bytes="512MiB")
            by_hand = bytes_per_block(cfg, dtype, bs)
            assert by_hand == plan.bytes_per_block and by_hand // bs == plan.bytes_per_slot
            rows.append(
                {
                    "dtype": dtype_name(dtype),
                    "layers": cfg.num_layers,
                    "kv_heads": cfg.num_kv_heads,
                    "head_dim": cfg.head_dim,
                    "dtype_bytes": DTYPE_BYTES[dtype],
                    "block_size": bs,
                    "bytes_per_token": plan.bytes_per_slot,
                    "bytes_per_block": plan.bytes_per_block,
                }
            )
    return rows


def budget_row(cfg: LlamaConfig, budget: str, dtype: torch.dtype, contexts, block_size: int = 16) -> dict:
    plan = plan_pool(cfg, dtype, block_size=block_size, budget_bytes=budget)
    row = {
        "budget": budget,
        "dtype": plan.dtype,
        "budget_bytes": plan.budget_bytes,
        "num_blocks": plan.num_blocks,
        "tokens": plan.max_tokens,
        "pool_mb": f"{plan.pool_bytes / 1e6:.1f}",
        "unused_bytes": plan.budget_bytes - plan.pool_bytes,
    }
    for c in contexts:
        row[f"requests_{c}"] = plan.num_blocks // blocks_per_request(c, block_size)
    row["fits_full_context"] = "yes" if plan.num_slots >= cfg.max_position_embeddings else "no"
    return row


def budget_table(cfg: LlamaConfig, budgets=BUDGETS, dtypes=DTYPES, contexts=CONTEXTS) -> list[dict]:
    contexts = tuple(contexts) + (cfg.max_position_embeddings,)
    return [budget_row(cfg, b, d, contexts) for d in dtypes for b in budgets]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--budgets", nargs="+", default=list(BUDGETS), help="KV budgets, e.g. 512MiB 2GB 1e9")
    p.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="context lengths")
    p.add_argument("--out-block", default=str(CSV_BLOCK), help="CSV of the price of a block")
    p.add_argument("--out-budgets", default=str(CSV_BUDGETS), help="CSV of what each budget buys")
    args = p.parse_args(argv)
    for b in args.budgets:
        parse_bytes(b)  # a bad size is refused with its sentence before anything is written
    cfg = LlamaConfig.from_dir(resolve_model_dir(args.model))
    blocks = block_table(cfg)
    budgets = budget_table(cfg, args.budgets, DTYPES, args.contexts)
    for name, rows, out in (("block", blocks, args.out_block), ("budgets", budgets, args.out_budgets)):
        print(name)
        for r in rows:
            print("  ", ", ".join(f"{k}={v}" for k, v in r.items()))
        print(f"wrote {write_csv(rows, out)}")


if __name__ == "__main__":
    main()

"""Day 5: what grouped-query attention saves the KV cache, priced for a model's shape.

Every token a sequence holds keeps one key and one value vector per K/V head per layer, so a
token's cache costs 2 x layers x kv_heads x head_dim x bytes per element, whatever the query
heads do. For the model's shape (layers, query heads, head size) the CSV prices three layouts
that differ only in how many K/V heads the query heads share: one K/V head per query head
(multi-head attention, MHA), the model's own grouping (GQA), and one K/V head for all of them
(multi-query attention, MQA), in fp32 and bf16. Columns: bytes per token for one layer and for
the whole model (`LlamaConfig.kv_bytes_per_token`), the cache of one sequence at the full
context in MB (10^6 bytes), how many tokens fit in one GiB, and the size against MHA's.
Every number is arithmetic on the config, the same on any machine.

    python days/day05/kvbytes.py                         # SmolLM2-135M -> day-05-kvbytes.csv
    python days/day05/kvbytes.py --kv-heads 9 --kv-heads 3 --kv-heads 1 --context 2048 --out /tmp/k.csv
    python days/day05/kvbytes.py --model DIR --out /tmp/k.csv   # another Llama directory
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from nanocourse import write_csv
from nanoserve.models import LlamaConfig
from nanoserve.weights import DTYPE_NAMES, resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV = HERE / "day-05-kvbytes.csv"
GIB = 2**30
DTYPES = (torch.float32, torch.bfloat16)


def layout(cfg: LlamaConfig, kv_heads: int) -> str:
    if kv_heads == cfg.num_heads:
        return "MHA"
    return "MQA" if kv_heads == 1 else "GQA"


def kv_row(cfg: LlamaConfig, kv_heads: int, dtype: torch.dtype, context: int) -> dict:
    if cfg.num_heads % kv_heads:
        raise ValueError(f"{cfg.num_heads} query heads cannot be split into {kv_heads} equal groups")
    shaped = dataclasses.replace(cfg, num_kv_heads=kv_heads)
    per_token = shaped.kv_bytes_per_token(dtype)
    mha = dataclasses.replace(cfg, num_kv_heads=cfg.num_heads).kv_bytes_per_token(dtype)
    return {
        "layout": layout(cfg, kv_heads),
        "kv_heads": kv_heads,
        "query_heads_per_kv": cfg.num_heads // kv_heads,
        "dtype": DTYPE_NAMES[dtype],
        "bytes_per_token_layer": per_token // cfg.num_layers,
        "bytes_per_token": per_token,
        f"mb_at_{context}": f"{per_token * context / 1e6:.1f}",
        "tokens_per_gib": GIB // per_token,
        "vs_mha": f"{per_token / mha:.3f}",
    }


def kv_rows(cfg: LlamaConfig, kv_heads=None, dtypes=DTYPES, context: int | None = None) -> list[dict]:
    """One row per (dtype, K/V head count); default head counts: MHA, the model's own, MQA."""
    kv_heads = kv_heads or sorted({cfg.num_heads, cfg.num_kv_heads, 1}, reverse=True)
    context = context or cfg.max_position_embeddings
    return [kv_row(cfg, h, dtype, context) for dtype in dtypes for h in kv_heads]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--kv-heads", type=int, action="append", help="K/V head counts to price (repeat)")
    p.add_argument("--context", type=int, help="tokens of one sequence (default: the model's context)")
    p.add_argument("--out", default=str(CSV), help="CSV to write")
    args = p.parse_args(argv)
    cfg = LlamaConfig.from_dir(resolve_model_dir(args.model))
    rows = kv_rows(cfg, args.kv_heads, context=args.context)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out)}")
    own = next(r for r in rows if r["kv_heads"] == cfg.num_kv_heads and r["dtype"] == "float32")
    print(
        f"kvbytes layers={cfg.num_layers} heads={cfg.num_heads} kv_heads={cfg.num_kv_heads} "
        f"fp32_bytes_per_token={own['bytes_per_token']} vs_mha={own['vs_mha']}"
    )


if __name__ == "__main__":
    main()

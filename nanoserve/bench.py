"""Benchmarks that compare nanoserve with a peer in the same run (`python -m nanoserve.bench`).

    decode    batch-1 greedy decode, nanoserve against transformers' `generate` on the same
              weights, dtype and thread count; prints both rates and their ratio, and the
              bandwidth roofline (weight bytes per token against a measured read bandwidth).

Machines are shared and noisy, so no absolute number here is a promise; the ratio, measured
in one run, is the figure to quote. Each benchmark ends with one machine-readable line.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

DECODE_PROMPT = "Explain, step by step, how a paged KV cache lets an inference server batch many requests."


def read_bandwidth_gbs(mbytes: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth as torch sees it: the best of a few sums over a large fp32 tensor."""
    x = torch.ones(mbytes * 2**20 // 4)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def decode_rate(run, n_tokens: int) -> tuple[float, list[int]]:
    """Decode tokens/s of `run(n) -> tokens`, prefill removed: (n-1) / (t(n) - t(1))."""
    run(2)  # warm-up: first calls allocate and pick kernels
    t1 = min(_timed(lambda: run(1)) for _ in range(2))
    tokens: list[int] = []
    tn = _timed(lambda: tokens.extend(run(n_tokens)))
    return (n_tokens - 1) / max(tn - t1, 1e-9), tokens


def bench_decode(model_dir: Path, dtype: torch.dtype, n_tokens: int) -> dict:
    import transformers

    from nanoserve.generate import greedy_tokens
    from nanoserve.model import load_model
    from nanoserve.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": DECODE_PROMPT}])
    ours = load_model(model_dir, dtype=dtype)
    ours_rate, ours_tokens = decode_rate(lambda n: greedy_tokens(ours, prompt, n), n_tokens)
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    ours = None  # free its memory before loading the peer

    hf = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor([prompt])

    def hf_run(n: int) -> list[int]:
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=min(tok.eos_ids),
            )
        return out[0, len(prompt) :].tolist()

    hf_rate, hf_tokens = decode_rate(hf_run, n_tokens)
    same = next((i for i, (a, b) in enumerate(zip(ours_tokens, hf_tokens)) if a != b), None)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "tokens": n_tokens,
        "nanoserve_tok_s": round(ours_rate, 1),
        "transformers_tok_s": round(hf_rate, 1),
        "ratio": round(ours_rate / hf_rate, 2),
        "weight_mb": round(weight_bytes / 1e6, 1),
        "first_token_difference": "none" if same is None else same,
    }


def cmd_decode(args) -> None:
    from nanoserve.weights import resolve_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model)
    dtypes = {
        "float32": [torch.float32],
        "bfloat16": [torch.bfloat16],
        "both": [torch.float32, torch.bfloat16],
    }
    bandwidth = read_bandwidth_gbs()
    print(f"model {model_dir.name}, {torch.get_num_threads()} threads, read bandwidth {bandwidth:.1f} GB/s")
    rows = []
    for dtype in dtypes[args.dtype]:
        row = bench_decode(model_dir, dtype, args.tokens)
        row["roofline_tok_s"] = round(bandwidth * 1e9 / (row["weight_mb"] * 1e6), 1)
        rows.append(row)
        print(
            f"{row['dtype']:>9}: nanoserve {row['nanoserve_tok_s']:6.1f} tok/s   transformers "
            f"{row['transformers_tok_s']:6.1f} tok/s   ratio {row['ratio']:.2f}x   roofline "
            f"{row['roofline_tok_s']:.1f} tok/s ({row['weight_mb']:.0f} MB a token)   "
            f"greedy tokens differ at: {row['first_token_difference']}"
        )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    print(
        "RESULT decode "
        + " ".join(
            f"{r['dtype']}={r['nanoserve_tok_s']}/{r['transformers_tok_s']}={r['ratio']}x" for r in rows
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="bench", required=True)
    p = sub.add_parser("decode", help="batch-1 decode against transformers' generate")
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--csv", default=None, help="also write the rows to this CSV")
    args = parser.parse_args(argv)
    from nanoserve.errors import NanoserveError

    try:
        {"decode": cmd_decode}[args.bench](args)
    except NanoserveError as e:
        print(f"nanoserve: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

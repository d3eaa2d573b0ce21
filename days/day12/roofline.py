"""Day 12: batch-1 decode against the memory-bandwidth roofline, fp32 and bf16, 1 and 2 threads.

One decode step at batch 1 multiplies a single row by every weight matrix of the model, so it
has to read every weight once: the bytes per token are the model's weight bytes (the tied
embedding once, since the head reads it whole and the lookup reads one row of it). A CPU that
reads memory at B bytes a second can therefore not decode faster than B / bytes tokens a second.
For each (dtype, threads) this script measures:

* B, torch's read bandwidth (`nanoserve.bench.read_bandwidth_gbs`: the best of a few sums over
  a 512 MB fp32 tensor), at that thread count,
* the decode rate of the eager greedy loop with prefill removed (`nanoserve.bench.decode_rate`:
  (n - 1) / (t(n) - t(1))), and the fraction of the roofline it reaches.

A second table times `nanoserve.models.linear` against plain `F.linear` on the model's own
matrices, to check the two claims in `linear`'s docstring: the per-thread slabs in fp32 (one row
and eight rows), and bf16 on a CPU without bf16 matrix instructions (the GEMM rate, and where
widening to fp32 starts to pay, `BF16_UPCAST_ROWS`).

The counts (bytes, FLOPs, rows, threads, tokens) are facts; every time is this machine's, and
the script prints the CPU's capabilities first so two runs can be compared.

    python days/day12/roofline.py                        # -> day-12-roofline.csv, day-12-linear.csv
    python days/day12/roofline.py --tokens 256 --threads 1 2 4 --out-roofline /tmp/r.csv
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nanocourse import write_csv
from nanoserve.bench import DECODE_PROMPT, cpu_line, decode_rate, read_bandwidth_gbs
from nanoserve.generate import greedy_tokens
from nanoserve.models import Llama, load_model
from nanoserve.models import llama as nm
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV_ROOFLINE = HERE / "day-12-roofline.csv"
CSV_LINEAR = HERE / "day-12-linear.csv"
TOKENS = 128
THREADS = [1, 2]
DTYPES = ["float32", "bfloat16"]
UPCAST_ROWS = (1, 2, 4, 8, 16, 64, 256)


# --- what a token reads -----------------------------------------------------------------------


def weight_bytes(model: Llama) -> int:
    """Bytes of every distinct weight tensor: `parameters()` yields the tied head once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def matrices(model: Llama) -> list[torch.Tensor]:
    """Every weight matrix a decode step multiplies by, in forward order (the head last)."""
    return [w for b in model.blocks for w in (b.qkv, b.o, b.gate_up, b.down)] + [model.head]


# --- decode against the roofline --------------------------------------------------------------


def roofline(
    model_dir, dtypes=DTYPES, threads=THREADS, tokens: int = TOKENS, models=None, repeats: int = 1
) -> list[dict]:
    """One row per (dtype, threads). `models` may hold already loaded models by dtype name. The
    configurations are measured round-robin, `repeats` rounds, and each keeps its best bandwidth
    and its best decode rate: a shared machine only ever slows a measurement down."""
    tok = Tokenizer.from_dir(model_dir)
    prompt = tok.encode_chat([{"role": "user", "content": DECODE_PROMPT}])
    models = {d: (models or {}).get(d) or load_model(model_dir, dtype=getattr(torch, d)) for d in dtypes}
    configs = [(d, t) for d in dtypes for t in threads]
    bandwidth, rate = dict.fromkeys(configs, 0.0), dict.fromkeys(configs, 0.0)
    before = torch.get_num_threads()
    for _ in range(repeats):
        for d, t in configs:
            torch.set_num_threads(t)
            bandwidth[d, t] = max(bandwidth[d, t], read_bandwidth_gbs())
            got, _ = decode_rate(lambda n, m=models[d]: greedy_tokens(m, prompt, n), tokens)
            rate[d, t] = max(rate[d, t], got)
    torch.set_num_threads(before)
    rows = []
    for d, t in configs:
        nbytes = weight_bytes(models[d])
        roof = bandwidth[d, t] * 1e9 / nbytes
        rows.append(
            {
                "dtype": d,
                "threads": t,
                "weight_mb": round(nbytes / 1e6, 1),
                "tokens": tokens,
                "bandwidth_gb_s": round(bandwidth[d, t], 1),
                "roofline_tok_s": round(roof, 1),
                "tok_s": round(rate[d, t], 1),
                "fraction": round(rate[d, t] / roof, 2),
                "achieved_gb_s": round(rate[d, t] * nbytes / 1e9, 1),
            }
        )
    return rows


# --- the claims in linear's docstring ---------------------------------------------------------


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _all_products(fn, xs, ws):
    return [fn(x, w) for x, w in zip(xs, ws)]


def linear_rows(
    model: Llama, threads: int = 2, repeats: int = 5, sweep=UPCAST_ROWS, seed: int = 0
) -> list[dict]:
    """`linear` against `F.linear` on the model's own weights (all of them far larger than a CPU
    cache, so every pass streams them from memory):

    * "all matrices": the 121 matrices of a decode step at 1 and 8 rows, fp32 through `F.linear`
      and through the slabs, bf16 through `F.linear` and through the package's `linear` (which
      widens to fp32 from `BF16_UPCAST_ROWS` rows on);
    * "gate/up matrices": the 30 gate/up matrices at every row count of `sweep`, fp32 through
      the package, bf16 through `F.linear`, and bf16 widened to fp32: where the widening pays.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(seed)
    w32 = [w.float() for w in matrices(model)]
    w16 = [w.to(torch.bfloat16) for w in w32]
    paths = {
        "fp32 F.linear": (F.linear, w32, torch.float32),
        "fp32 slabs (linear)": (nm.linear, w32, torch.float32),
        "bf16 F.linear": (F.linear, w16, torch.bfloat16),
        "bf16 linear": (nm.linear, w16, torch.bfloat16),
        "bf16 widened to fp32": (_widened, w16, torch.bfloat16),
    }
    gate_up = slice(2, 4 * model.cfg.num_layers, 4)  # every block's third matrix
    plan = [("all matrices", slice(None), m, name) for m in (1, 8) for name in list(paths)[:4]]
    sweep_paths = ["fp32 slabs (linear)", "bf16 F.linear", "bf16 widened to fp32"]
    plan += [("gate/up matrices", gate_up, m, name) for m in sweep for name in sweep_paths]
    runs = []  # (check, rows, path, dtype, weights, the pass to time)
    for check, which, m, name in plan:
        fn, ws, dtype = paths[name]
        xs = [torch.randn(m, w.shape[1], generator=g).to(dtype) for w in ws[which]]
        runs.append((check, m, name, dtype, ws[which], functools.partial(_all_products, fn, xs, ws[which])))
    for *_, run in runs:
        run()  # warm-up
    best = [float("inf")] * len(runs)
    for _ in range(repeats):  # round-robin, fastest kept, as in `roofline`
        for i, (*_, run) in enumerate(runs):
            # three back to back: the first call after another path's may pay for the allocator
            # handing back fresh pages (the widened path allocates fp32 copies on every call)
            best[i] = min(best[i], *(_seconds(run) for _ in range(3)))
    rows = []
    for (check, m, name, dtype, ws, _), seconds in zip(runs, best):
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        flops = sum(2 * m * w.numel() for w in ws)
        dt = str(dtype).removeprefix("torch.")
        rows.append(_linear_row(check, dt, m, threads, name, nbytes, flops, 1e3 * seconds))
    torch.set_num_threads(before)
    return rows


def _widened(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What `linear` does with bf16 from `BF16_UPCAST_ROWS` rows on: an fp32 product, rounded back."""
    return nm.linear(x.float(), w.float()).to(torch.bfloat16)


def _linear_row(check, dtype, m, threads, path, nbytes, flops, ms) -> dict:
    return {
        "check": check,
        "dtype": dtype,
        "rows": m,
        "threads": threads,
        "path": path,
        "weight_mb": round(nbytes / 1e6, 1),
        "mflop": round(flops / 1e6, 1),
        "ms": round(ms, 2),
        "gb_s": round(nbytes / ms / 1e6, 1),
        "gflop_s": round(flops / ms / 1e6, 1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=TOKENS, help="decode tokens per configuration")
    p.add_argument("--threads", type=int, nargs="+", default=THREADS, help="thread counts to run")
    p.add_argument("--dtypes", nargs="+", default=DTYPES, choices=DTYPES)
    p.add_argument("--repeats", type=int, default=3, help="decode-rate measurements per configuration")
    p.add_argument("--out-roofline", default=str(CSV_ROOFLINE), help="CSV of the decode rates")
    p.add_argument("--out-linear", default=str(CSV_LINEAR), help="CSV of the linear checks")
    p.add_argument("--skip", choices=["linear", "roofline"], help="run only the other table")
    args = p.parse_args(argv)
    print(cpu_line())
    model_dir = resolve_model_dir(args.model)
    model = load_model(model_dir)
    if args.skip != "linear":
        lin = linear_rows(model, threads=max(args.threads))
        for r in lin:
            print(", ".join(f"{k}={v}" for k, v in r.items()))
        print(f"wrote {write_csv(lin, args.out_linear, cpu=True)}")
    if args.skip == "roofline":
        return
    rows = roofline(model_dir, args.dtypes, args.threads, args.tokens, {"float32": model}, args.repeats)
    for r in rows:
        print(
            f"{r['dtype']:>9} {r['threads']} threads: {r['tok_s']:6.1f} tok/s of a roofline "
            f"{r['roofline_tok_s']:6.1f} tok/s ({r['bandwidth_gb_s']} GB/s / {r['weight_mb']} MB) = "
            f"{r['fraction']:.2f}, {r['achieved_gb_s']} GB/s achieved"
        )
    print(f"wrote {write_csv(rows, args.out_roofline, cpu=True)}")
    print("roofline " + " ".join(f"{r['dtype']}/{r['threads']}t={r['fraction']}" for r in rows))


if __name__ == "__main__":
    main()

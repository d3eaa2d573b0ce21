"""Day 60's benchmark: batch-1 decode from the GGUF's own Q4_1 blocks, against fp32 and llama.cpp.

Two tables, one CSV each:

* `day-60-decode.csv`: greedy batch-1 decode of `nanoserve.bench.DECODE_PROMPT` (chat template,
  `--tokens` tokens past the prompt, EOS ignored) for three variants of the engine of the day
  (the decode step as torch ops; day 61 builds the fused one), which take turns `--reps` times;
  each keeps its best rate (`nanoserve.bench.decode_rate`: prefill taken out): fp32 (Day 12's
  plain linears), the default GGUF's Q4_1 blocks with fp32 activations, and the same blocks with
  int8 activations. Each row has the bytes of weights a token reads, the roofline those bytes
  allow at the read bandwidth measured in the same run (`read_bandwidth_gbs`), and where its
  tokens part from the fp32 model's. With `--llama-server BIN` / `--llama-bench BIN`, llama.cpp's
  rates on the same file and prompt are rows too (`llama_server_decode`, `llama_bench_decode`),
  with llama-server's tokens.
* `day-60-france.csv`: "What is the capital of France?" (chat template, `--france-tokens`
  greedy tokens): the tokens and text of the fp32 model, q4_1/fp32, q4_1/int8 and, with
  `--llama-server`, llama-server; where each parts from the fp32 model and from llama-server.

The notebook reads both CSVs; it never starts llama.cpp itself.

    LD_LIBRARY_PATH=BIN_DIR python days/day60/ggufbench.py --llama-server BIN_DIR/llama-server \\
        --llama-bench BIN_DIR/llama-bench
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from nanocourse import engine_config, write_csv
from nanoserve.bench import (
    DECODE_PROMPT,
    agreement,
    cpu_line,
    decode_turns,
    engine_tokens_of,
    llama_bench_decode,
    llama_server_decode,
    read_bandwidth_gbs,
)
from nanoserve.engine import Engine
from nanoserve.models import LlamaConfig, load_gguf_model, load_model, model_weight_bytes
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_gguf, fetch_default_model

HERE = Path(__file__).resolve().parent
FRANCE = "What is the capital of France?"
# (name, weights, decode step): the engine's batch-1 variants, in the order they take turns; the
# step is day 60's, torch ops (day 61's benchmark adds the fused step to the same comparison)
VARIANTS = [
    ("fp32", "fp32", "ops"),
    ("q4_1/fp32", "q4_1/fp32", "ops"),
    ("q4_1/int8", "q4_1/int8", "ops"),
]


def models(model_dir: Path, gguf: Path) -> dict:
    """The three weight sets: the fp32 conversion (plain linears, Day 12's) and the GGUF's own
    blocks with fp32 and with int8 activations."""
    cfg = LlamaConfig.from_dir(model_dir)
    return {
        "fp32": load_model(model_dir),
        "q4_1/fp32": load_gguf_model(gguf, cfg, "q4_1", "fp32"),
        "q4_1/int8": load_gguf_model(gguf, cfg, "q4_1", "int8"),
    }


def engine(model, tok, step: str = "ops") -> Engine:
    """A batch-1 engine of day 60, its decode step torch ops and its linears plain (the fp32
    model runs as loaded: day 59's packing would pack it in place)."""
    assert step == "ops", "the fused step is day 61's (days/day61/fusedbench.py)"
    return Engine(model, tok, engine_config(60, max_batch=1, linear="plain"))


same = agreement  # "equal" or "differ at N" (the name the notebook uses)


def decode_table(ms, tok, n_tokens, reps, bandwidth, llama_server=None, llama_bench=None, threads=2):
    prompt = tok.encode_chat([{"role": "user", "content": DECODE_PROMPT}])
    engines = {(name, step): engine(ms[w], tok, step) for name, w, step in VARIANTS}
    best, tokens = decode_turns(engines, prompt, n_tokens, reps)  # the variants take turns
    reference = tokens[("fp32", "ops")]
    rows = []
    for name, w, step in VARIANTS:
        mb = model_weight_bytes(ms[w]) / 1e6
        rows.append(
            {
                "variant": name,
                "step": step,
                "weight_mb": round(mb, 1),
                "tokens": n_tokens,
                "tok_s": round(best[(name, step)], 1),
                "roofline_tok_s": round(bandwidth * 1e3 / mb, 1),
                "read_gbs": round(bandwidth, 1),
                "threads": threads,
                "vs_fp32": same(tokens[(name, step)], reference),
            }
        )
    q4 = rows[1]["weight_mb"]  # llama.cpp reads the same file's blocks
    peer_tokens = None
    if llama_server:
        rate, peer_tokens = llama_server_decode(llama_server, fetch_default_gguf(), prompt, n_tokens, threads)
        rows.append(
            {
                "variant": "llama-server",
                "step": "llama.cpp",
                "weight_mb": q4,
                "tokens": n_tokens,
                "tok_s": round(rate, 1),
                "roofline_tok_s": rows[1]["roofline_tok_s"],
                "read_gbs": round(bandwidth, 1),
                "threads": threads,
                "vs_fp32": same(peer_tokens, reference),
            }
        )
    if llama_bench:
        rate = llama_bench_decode(llama_bench, fetch_default_gguf(), n_tokens, threads)
        rows.append(
            {
                "variant": "llama-bench",
                "step": "llama.cpp",
                "weight_mb": q4,
                "tokens": n_tokens,
                "tok_s": round(rate, 1),
                "roofline_tok_s": rows[1]["roofline_tok_s"],
                "read_gbs": round(bandwidth, 1),
                "threads": threads,
                "vs_fp32": "n/a (empty context)",
            }
        )
    for r in rows:
        key = (r["variant"], r["step"])
        r["vs_llama_server"] = (
            "n/a" if peer_tokens is None or key not in tokens else same(tokens[key], peer_tokens)
        )
        if r["variant"] == "llama-server":
            r["vs_llama_server"] = "equal"
        r["vs_q4_1"] = round(r["tok_s"] / rows[1]["tok_s"], 2)
    return rows


def france_tokens(ms, tok, n_tokens) -> dict:
    """The engine's greedy tokens for the France prompt, per weight set."""
    prompt = tok.encode_chat([{"role": "user", "content": FRANCE}])
    out = {
        w: engine_tokens_of(engine(ms[w], tok), prompt, n_tokens) for w in ("fp32", "q4_1/fp32", "q4_1/int8")
    }
    return out


def france_table(ms, tok, n_tokens, llama_server=None, threads=2) -> list[dict]:
    got = france_tokens(ms, tok, n_tokens)
    if llama_server:
        prompt = tok.encode_chat([{"role": "user", "content": FRANCE}])
        _, got["llama-server"] = llama_server_decode(
            llama_server, fetch_default_gguf(), prompt, n_tokens, threads
        )
    rows = []
    for name, toks in got.items():
        rows.append(
            {
                "variant": name,
                "tokens": " ".join(map(str, toks)),
                "text": tok.decode(toks).replace("\n", "\\n"),
                "vs_fp32": same(toks, got["fp32"]),
                "vs_llama_server": same(toks, got["llama-server"]) if "llama-server" in got else "n/a",
            }
        )
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens a decode run generates")
    ap.add_argument("--france-tokens", type=int, default=12)
    ap.add_argument("--reps", type=int, default=3, help="turns each variant takes; its best is kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary (optional)")
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (optional)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    t0 = time.perf_counter()
    model_dir, gguf = fetch_default_model(), fetch_default_gguf()
    tok = Tokenizer.from_dir(model_dir)
    ms = models(model_dir, gguf)
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s")
    tables = {
        "day-60-france.csv": france_table(ms, tok, args.france_tokens, args.llama_server, args.threads),
        "day-60-decode.csv": decode_table(
            ms, tok, args.tokens, args.reps, bandwidth, args.llama_server, args.llama_bench, args.threads
        ),
    }
    for name, rows in tables.items():
        write_csv(rows, HERE / name, cpu=name == "day-60-decode.csv")
        print(name)
        for row in rows:
            print("  ", row)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

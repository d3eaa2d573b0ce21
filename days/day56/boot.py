"""Day 56's benchmark: what the warm list costs at boot and what it saves a request.

Each configuration builds the default model with `build_engine` (the day's wiring: pool planned
and allocated, warm list trimmed and recorded before the engine is handed back) and sends one
chat request of a fixed number of tokens. Per boot the table gives the graphs the warm-up
recorded and the memory they hold, then what the request met: graphs recorded while it waited
(`cold_captures`) and decode steps that ran with no graph at all (`eager_steps`), each next to
the count the width buckets predict. Recording lazily, every width the request grows into is
recorded once; after a warm list, nothing is recorded and a width past the list runs eagerly.

    python days/day56/boot.py                        # writes day-56-boot.csv next to this file
    python days/day56/boot.py --tokens 200 --widths 64 128 256 512
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nanocourse import engine_config, write_csv
from nanoserve.buckets import bucket_up, width_buckets
from nanoserve.engine import build_engine
from nanoserve.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
QUESTION = [{"role": "user", "content": "Tell me about lighthouses."}]


def predicted(
    prompt_len: int, generated: int, warm_width: int | None, max_model_len: int, multiple=32
) -> tuple[int, int]:
    """(recordings, eager steps) for one request decoding at contexts prompt_len + 1 ...
    prompt_len + generated - 1. With no warm list (warm_width None) each width bucket those
    contexts reach is recorded once and nothing runs eagerly; with a list up to warm_width,
    nothing is recorded and every step whose bucket is wider than the list runs eagerly."""
    widths = width_buckets(max_model_len, multiple)
    buckets = [bucket_up(n, widths) for n in range(prompt_len + 1, prompt_len + generated)]
    if warm_width is None:
        return len(set(buckets)), 0
    return 0, sum(w > warm_width for w in buckets)


def boot_row(model_dir, max_batch: int, warm_width: int | None, tokens: int, max_model_len: int) -> dict:
    """Build (and warm, unless warm_width is None), then run one request; one table row."""
    config = engine_config(
        56,  # the engine as of day 56: prefill-first, gather attention, plain linears, ops step
        model=str(model_dir) if model_dir else None,
        max_batch=max_batch,
        max_model_len=max_model_len,
        bucket_decode=True,
        persist_inputs=True,
        capture_decode=True,
        warm=warm_width is not None,
        warm_max_width=warm_width,
    )
    t0 = time.perf_counter()
    engine = build_engine(config)
    boot_s = time.perf_counter() - t0
    report = engine.warm_report
    t1 = time.perf_counter()
    rid = engine.add_request(QUESTION, SamplingParams(max_tokens=tokens, ignore_eos=True))
    first, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                tokens += out.new_token_ids
                first = first if first is not None else time.perf_counter() - t1
    total = time.perf_counter() - t1
    prompt_len = len(engine.encode_prompt(QUESTION))
    cold, eager = predicted(prompt_len, len(tokens), warm_width, engine.max_model_len)
    return {
        "config": "lazy" if warm_width is None else f"warm to {warm_width}",
        "max_batch": max_batch,
        "warm_max_width": warm_width if warm_width is not None else 0,
        "graphs": report.graphs if report else 0,
        "warm_mb": round(report.bytes / 1e6, 1) if report else 0.0,
        "prompt_tokens": prompt_len,
        "generated": len(tokens),
        "cold_captures": engine.runner.cold_captures,
        "predicted_cold": cold,
        "eager_steps": engine.runner.eager_steps,
        "predicted_eager": eager,
        "tokens": tokens,
        "boot_s": round(boot_s, 2),
        "warm_s": round(report.seconds, 2) if report else 0.0,
        "first_token_ms": round(1000 * first, 1),
        "request_s": round(total, 2),
    }


def boot_table(model_dir=None, max_batch=4, widths=(None, 64, 128), tokens=40, max_model_len=1024):
    """One row per boot; `same_tokens` says whether its request got the first boot's tokens."""
    rows = [boot_row(model_dir, max_batch, w, tokens, max_model_len) for w in widths]
    first = rows[0]["tokens"]
    for row in rows:
        row["same_tokens"] = "yes" if row.pop("tokens") == first else "no"
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--widths", type=int, nargs="+", default=[64, 128], help="warm_max_width values")
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", type=Path, default=HERE / "day-56-boot.csv")
    args = p.parse_args()
    rows = boot_table(args.model, args.max_batch, [None, *args.widths], args.tokens, args.max_model_len)
    for row in rows:
        print(row)
    write_csv(rows, args.out, cpu=True)


if __name__ == "__main__":
    main()

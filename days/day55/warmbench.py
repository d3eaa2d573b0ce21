"""Day 55's benchmark: graphs recorded lazily against a list recorded at startup (CPU, no weights).

Three tables, one CSV each:

* `day-55-warmbench.csv`: a tiny random-weight Llama generates 8, 32, 64 and 128 tokens for two
  requests that share one 16-token prompt (width buckets of 32), first with lazy recording and
  then after `Engine.warm_decode`. The graphs recorded mid-run must equal `lazy_captures` in the
  first case and be 0 in the second, with the same tokens.
* `day-55-pricing.csv`: the same arithmetic at serving size (256 rows, 8192 tokens, buckets of
  128, an assumed 50 ms per recording). A recorded graph lives as long as the process, so besides
  what the first request of a length waits (`stall_s`) it gives what lazy recording pays over a
  process lifetime in which requests of that length arrive at every row count up to 8
  (`lazy_rows8_s`) or at all nine (`lazy_all_rows_s`), next to the startup cost of three lists.
* `day-55-budget.csv`: a memory budget turned into the widest shape it allows, for fp32 scores
  of 32 heads over 256 rows, and how many of the 576 shapes that keeps.

    python days/day55/warmbench.py            # writes the three CSVs next to this file
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_config, tiny_llama, write_csv
from nanoserve.buckets import row_buckets
from nanoserve.engine import Engine
from nanoserve.models import Llama
from nanoserve.sampling import SamplingParams
from nanoserve.warmup import lazy_captures, stall_seconds, warm_shapes, warmup_seconds, width_ceiling

HERE = Path(__file__).resolve().parent
TINY = tiny_config(max_position_embeddings=512)


def tiny_model(init: int = 0) -> Llama:
    return tiny_llama(init, 0.05, TINY.max_position_embeddings)


def run(model, generated: int, warm: bool, prompt_len=16, rows=2, width_multiple=32):
    """(cold captures, warm graphs, warm seconds, tokens) for `rows` requests off one prompt."""
    per_block = TINY.kv_bytes_per_token(torch.float32) * 16
    config = engine_config(
        55,  # the engine as of day 55: prefill-first, gather attention, plain linears, ops step
        max_batch=rows,
        max_model_len=max(64, prompt_len + generated),  # never fewer than two width buckets
        kv_budget=per_block * 64,
        width_multiple=width_multiple,
        bucket_decode=True,
        persist_inputs=True,
        capture_decode=True,
    )
    eng = Engine(model, None, config)
    report = eng.warm_decode() if warm else None
    prompt = list(range(1, prompt_len + 1))
    outs = eng.generate(
        [prompt] * rows, SamplingParams(max_tokens=generated, ignore_eos=True), use_tqdm=False
    )
    tokens = [o.token_ids for o in outs]
    return (
        eng.runner.cold_captures,
        (report.graphs if report else 0),
        (report.seconds if report else 0.0),
        tokens,
    )


def cold_table(lengths=(8, 32, 64, 128)) -> list[dict]:
    model = tiny_model()
    rows = []
    for n in lengths:
        cold_lazy, _, _, lazy_tokens = run(model, n, warm=False)
        cold_warm, graphs, seconds, warm_tokens = run(model, n, warm=True)
        assert lazy_tokens == warm_tokens, "warming changed the tokens"
        rows.append(
            {
                "generated": n,
                "cold_lazy": cold_lazy,
                "predicted": lazy_captures(n, 32, prompt_len=16),
                "cold_warmed": cold_warm,
                "warm_graphs": graphs,
                "warm_ms": round(seconds * 1000, 1),
            }
        )
    return rows


def pricing_table(per_graph=0.05) -> list[dict]:
    """Seconds of recording for one request length at a time. Lazy recording pays each (rows,
    width) shape once per process, in front of the first request that reaches it; warming pays
    every shape of its list once, at startup. So the like-for-like lazy figures are lifetime
    sums: the widths one request crosses, times the row buckets its traffic arrives at."""
    serving = dict(max_batch=256, max_model_len=8192, width_multiple=128)
    full = warmup_seconds(warm_shapes(**serving), per_graph)
    rows8 = warmup_seconds(warm_shapes(**serving, max_rows=8), per_graph)
    rows8_ctx = warmup_seconds(warm_shapes(**serving, max_rows=8, max_width=2048), per_graph)
    rows_upto8 = len([r for r in row_buckets(serving["max_batch"]) if r <= 8])  # 1, 2, 4, 8
    all_rows = len(row_buckets(serving["max_batch"]))  # 9
    out = []
    for n in (128, 512, 2048, 8192):
        widths = lazy_captures(n, 128)  # width buckets one request of n tokens crosses
        out.append(
            {
                "generated": n,
                "lazy_graphs": widths,
                "stall_s": f"{stall_seconds(n, 128, per_graph):.2f}",
                "lazy_rows8_s": f"{widths * rows_upto8 * per_graph:.2f}",
                "lazy_all_rows_s": f"{widths * all_rows * per_graph:.2f}",
                "warm_full_s": f"{full:.2f}",
                "warm_rows8_s": f"{rows8:.2f}",
                "warm_rows8_ctx2048_s": f"{rows8_ctx:.2f}",
            }
        )
    return out


def budget_table() -> list[dict]:
    out = []
    for mb in (64, 268, 1000):
        ceiling = width_ceiling(mb * 1_000_000, rows=256, heads=32)
        fits = len(warm_shapes(256, 8192, 128, max_width=ceiling))
        out.append(
            {"budget_mb": mb, "widest_capture": min(ceiling, 8192), "shapes_that_fit": fits, "of": 576}
        )
    return out


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    t0 = time.perf_counter()
    tables = {
        "day-55-warmbench.csv": cold_table(),
        "day-55-pricing.csv": pricing_table(),
        "day-55-budget.csv": budget_table(),
    }
    for name, rows in tables.items():
        write_csv(rows, HERE / name, cpu=name == "day-55-warmbench.csv")  # the other two are arithmetic
        print(name)
        for row in rows:
            print("  ", row)
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

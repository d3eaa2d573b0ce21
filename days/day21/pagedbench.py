"""Day 21: the paged engine against Day 11's contiguous cache, memory and speed, same requests.

The requests: a seeded spread of prompt lengths and token budgets (`workload`). Memory is
traced over the engine's run of the whole batch, step by step, four ways of holding the
running sequences' K/V:

* `K/V written`: the positions whose K/V is actually in the cache, the floor;
* `contiguous, max length`: Day 11's `ContiguousKVCache` per running request, reserved at the
  deployment's max length (a server cannot know where a request will stop);
* `contiguous, prompt + max_tokens`: the same, sized the way `generate.decode_loop` sizes it,
  for the request's own budget;
* `paged blocks`: the blocks the engine's allocator holds (`num_used`), whole blocks.

Speed: generated tokens a second for the same requests three ways, greedy, with end-of-sequence
ignored so every request runs its whole budget: the contiguous cache at max length one request
at a time (prefill then one token a step, as Day 11), the engine one request at a time
(`max_batch=1`: paging without batching), and the engine with every request in one batch.
`decode_tok_s` counts only the steps that decode (the engine: steps with no prompt work; the
contiguous loop: every step after the prefill). All three must give the same tokens.

The memory columns are counts (bytes of fp32 K/V), the speed columns this machine's, shared
with other jobs: each variant runs `--repeats` times, taking turns, and keeps its fastest.

    python days/day21/pagedbench.py           # SmolLM2-135M -> day-21-paged.csv, day-21-trace.csv
    python days/day21/pagedbench.py --tiny --requests 8 --out /tmp/t.csv
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from nanocourse import engine_config, tiny_llama, write_csv
from nanoserve.bench import cpu_line
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.engine import Engine
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from nanoserve.weights import resolve_model_dir

HERE = Path(__file__).resolve().parent
CSV_PAGED = HERE / "day-21-paged.csv"
CSV_TRACE = HERE / "day-21-trace.csv"
BLOCK_SIZE = 16
REAL = {"requests": 16, "prompt": (16, 256), "new": (16, 128), "max_len": 2048}
TINY = {"requests": 8, "prompt": (8, 64), "new": (8, 48), "max_len": 256}


def workload(n: int, prompt=(16, 256), new=(16, 128), vocab: int = 49152, seed: int = 0):
    """n (prompt ids, max_tokens), lengths uniform in the given ranges, ids avoiding the first
    256 (special and byte tokens of a real vocabulary, when there is one)."""
    rng = random.Random(seed)
    low = 256 if vocab > 1024 else 0
    return [
        ([rng.randrange(low, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*new))
        for _ in range(n)
    ]


def paged_engine(model, max_batch: int, max_len: int, reqs, block_size: int = BLOCK_SIZE) -> Engine:
    """The engine, its pool a little larger than every request at once needs (no preemption)."""
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * block_size
    need = sum(-(-(len(p) + n) // block_size) for p, n in reqs)
    blocks = int(1.1 * max(need, -(-max_len // block_size))) + max_batch + 1
    config = engine_config(
        21,
        max_batch=max_batch,
        max_model_len=max_len,
        block_size=block_size,
        kv_budget=blocks * per_block + per_block // block_size,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,  # the prompts share nothing; keep the run about paging
    )
    return Engine(model, None, config)


def run_engine(eng: Engine, reqs, trace: list | None = None) -> dict:
    """Every request to the end: tokens by request, seconds in all and in decode-only steps,
    and (with `trace`) after each step, for each running sequence, (computed, prompt, budget)
    and the allocator's used blocks."""
    ids = {
        eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)): i for i, (p, n) in enumerate(reqs)
    }
    out = {i: [] for i in range(len(reqs))}
    total = decode_s = 0.0
    decode_tokens = 0
    while eng.has_unfinished():
        decode_before = eng.step_kinds["decode"]
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        total += dt
        if eng.step_kinds["decode"] > decode_before:
            decode_s += dt
            decode_tokens += sum(len(o.new_token_ids) for o in outs)
        for o in outs:
            out[ids[o.request_id]] += o.new_token_ids
        if trace is not None:
            running = [(s.num_computed, len(s.prompt_ids), s.max_tokens) for s in eng.scheduler.running]
            trace.append((running, eng.allocator.num_used))
    tokens = [out[i] for i in range(len(reqs))]
    return {"tokens": tokens, "seconds": total, "decode_s": decode_s, "decode_tokens": decode_tokens}


@torch.inference_mode()
def run_contiguous(model, reqs, max_len: int) -> dict:
    """Day 11's loop, one request after another, each on a cache reserved at max_len."""
    tokens, total, decode_s, decode_tokens = [], 0.0, 0.0, 0
    for prompt, n in reqs:
        t0 = time.perf_counter()
        cache = ContiguousKVCache(model.cfg, max_len, dtype=model.dtype)
        ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
        got = []
        for step in range(n):
            t1 = time.perf_counter()
            cache.begin(positions)
            logits = model(ids, positions, cache, logits_at=positions[-1:] - positions[0])  # (1, V)
            got.append(int(logits.argmax()))
            ids, positions = torch.tensor(got[-1:]), torch.tensor([cache.length])
            if step > 0:
                decode_s += time.perf_counter() - t1
                decode_tokens += 1
        total += time.perf_counter() - t0
        tokens.append(got)
    return {"tokens": tokens, "seconds": total, "decode_s": decode_s, "decode_tokens": decode_tokens}


def memory_rows(trace, cfg, max_len: int, block_size: int = BLOCK_SIZE) -> list[dict]:
    """Peak and mean MB over the traced steps, for the four ways of holding the batch's K/V."""
    per_token = cfg.kv_bytes_per_token(torch.float32)
    ways = {
        "K/V written": lambda run, used: sum(c for c, _, _ in run) * per_token,
        "contiguous, max length": lambda run, used: len(run) * max_len * per_token,
        "contiguous, prompt + max_tokens": lambda run, used: sum(p + b for _, p, b in run) * per_token,
        "paged blocks": lambda run, used: used * block_size * per_token,
    }
    series = {name: [f(run, used) for run, used in trace] for name, f in ways.items()}
    written = series["K/V written"]
    rows = []
    for name, values in series.items():
        rows.append(
            {
                "variant": name,
                "kv_peak_mb": round(max(values) / 1e6, 3),
                "kv_mean_mb": round(sum(values) / len(values) / 1e6, 3),
                "mean_vs_written": round(sum(values) / sum(written), 2),
            }
        )
    return rows, series


def trace_rows(series: dict) -> list[dict]:
    """One row per engine step of the batched run: MB held each way after the step."""
    names = list(series)
    return [
        {"step": i + 1, **{name: round(series[name][i] / 1e6, 3) for name in names}}
        for i in range(len(series[names[0]]))
    ]


def table(model, reqs, max_len: int, repeats: int = 1) -> tuple[list[dict], dict]:
    """The day's table: memory over the batched run, and the speed of the three ways."""
    n = len(reqs)
    paged_engine(model, n, max_len, reqs)  # day 21's engine keeps the linears plain, as every way below
    best = {}
    trace: list = []
    for r in range(repeats):  # the variants take turns; each keeps its fastest run
        runs = {
            "contiguous, one at a time": lambda: run_contiguous(model, reqs, max_len),
            "paged, one at a time": lambda: run_engine(paged_engine(model, 1, max_len, reqs), reqs),
            "paged, one batch": lambda tr=trace if r == 0 else None: run_engine(
                paged_engine(model, n, max_len, reqs), reqs, tr
            ),
        }
        for name, fn in runs.items():
            got = fn()
            if name in best and got["tokens"] != best[name]["tokens"]:
                raise AssertionError(f"{name}: another run gave other tokens")
            if name not in best or got["seconds"] < best[name]["seconds"]:
                best[name] = got
    reference = best["contiguous, one at a time"]["tokens"]
    for name, got in best.items():
        if got["tokens"] != reference:
            bad = next(i for i, (a, b) in enumerate(zip(got["tokens"], reference)) if a != b)
            raise AssertionError(f"{name}: request {bad}'s tokens differ from the contiguous loop's")
    memory, series = memory_rows(trace, model.cfg, max_len)
    generated = sum(len(t) for t in reference)
    rows = []
    for m in memory:
        rows.append({"variant": m["variant"], "rows": n, **{k: m[k] for k in m if k != "variant"}})
    speed_rows = {"contiguous, one at a time": 1, "paged, one at a time": 1, "paged, one batch": n}
    per_token = model.cfg.kv_bytes_per_token(torch.float32)
    for name, rows_at_once in speed_rows.items():
        got = best[name]
        row = {
            "variant": name,
            "rows": rows_at_once,
            "kv_peak_mb": "",
            "kv_mean_mb": "",
            "mean_vs_written": "",
        }
        if name == "contiguous, one at a time":  # one reservation at a time, the whole run
            row["kv_peak_mb"] = row["kv_mean_mb"] = round(max_len * per_token / 1e6, 3)
        row |= {
            "tokens": generated,
            "seconds": round(got["seconds"], 2),
            "tok_s": round(generated / got["seconds"], 1),
            "decode_tok_s": round(got["decode_tokens"] / got["decode_s"], 1),
        }
        rows.append(row)
    for row in rows:
        for k in ("tokens", "seconds", "tok_s", "decode_tok_s"):
            row.setdefault(k, "")
    return rows, series


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model directory (default: the converted SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="the tiny random-weight Llama instead")
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadiest on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(CSV_PAGED))
    p.add_argument("--out-trace", default=str(CSV_TRACE), help="the memory of every step, MB")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(cpu_line())
    size = TINY if args.tiny else REAL
    model = tiny_llama(0) if args.tiny else load_model(resolve_model_dir(args.model))
    n = args.requests or size["requests"]
    reqs = workload(n, size["prompt"], size["new"], model.cfg.vocab_size, args.seed)
    rows, series = table(model, reqs, size["max_len"], args.repeats)
    for r in rows:
        print(", ".join(f"{k}={v}" for k, v in r.items()))
    print(f"wrote {write_csv(rows, args.out, cpu=True)}")
    print(f"wrote {write_csv(trace_rows(series), args.out_trace)}")


if __name__ == "__main__":
    main()

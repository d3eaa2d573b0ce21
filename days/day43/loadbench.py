"""Day 43: a load generator's numbers, defined by hand on one stream and measured under load.

`create_app(engine)` is served by uvicorn on a free port of 127.0.0.1, in a thread of this
process (`course.ServerThread`), in front of the tiny random-weight Llama with SmolLM2's
tokenizer (`tokenizer`); prompts are token ids (`loadgen.token_workload`). Two things are measured.

* One stream, timed by this script's own client (`timed_stream`): the time it was sent, each
  chunk's arrival and the tokens it carried, the end of the stream. From those timestamps
  `by_hand` works out time to first token, inter-token latency, time per output token and
  throughput, and `as_result` hands the same timestamps to `loadgen.summarize` to get its
  figures (`day-43-stream.csv`: the chunks; `day-43-definitions.csv`: each figure both ways).
* The load: `loadgen.run_load` with the same seeded requests at several concurrencies, against
  the server at `max_batch` 8, then at 4 clients against a second in-process server that runs
  one request at a time (`max_batch` 1), and, with `--url`, against any other server that
  speaks OpenAI's streaming completions (`day-43-load.csv`). A server that is not nanoserve
  gets the same requests; `--model` names the model it serves. These are closed loops: a client
  sends its next request only when its last one is answered.
* Open loop: `loadgen.run_open_loop` sends `--open-requests` requests at Poisson times, at each
  rate of `--rates` (requests/s, seeded gaps), to the `max_batch` 8 server whether or not it
  keeps up, and `loadgen.goodput` counts those that met the objective `--slo-ttft-ms` /
  `--slo-tpot-ms` (`day-43-open.csv`).

The engine is the one of day 43 (`engine_config(43, ...)`: the prefill-first schedule, the
gather read of the KV pool, plain linears, a decode step of torch ops).

    python days/day43/loadbench.py                                  # writes the four CSVs
    python days/day43/loadbench.py --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct
    python days/day43/loadbench.py --rates 10 40 160 --open-requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

from nanocourse import ServerThread, cpu_line, engine_config, tiny_llama, write_csv
from nanoserve import loadgen
from nanoserve.engine import Engine
from nanoserve.serve import create_app
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

HERE = Path(__file__).resolve().parent
MODEL = "tiny-llama"
CONCURRENCIES = (1, 2, 4, 8)
RATES = (4.0, 16.0, 64.0, 256.0)  # open loop: requests per second
SLO_TTFT_MS, SLO_TPOT_MS = 250.0, 25.0  # the objective goodput counts against


def tokenizer():
    """SmolLM2's tokenizer: the tiny model's ids (0-255) decode through it to text, so the
    server streams a chunk whenever a whole character is out (a tokenizer-less engine has no
    text to stream and sends every token id in its last chunk)."""
    return Tokenizer.from_dir(fetch_default_model())


def make_engine(model, tok, rows: int = 8, blocks: int = 128) -> Engine:
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    budget = blocks * per_block + per_block // 16  # + the sink slot
    config = engine_config(43, max_batch=rows, max_model_len=256, kv_budget=budget)
    engine = Engine(model, tok, config)
    engine.model_name = MODEL
    return engine


def workload(n: int = 16, seed: int = 0) -> list[loadgen.LoadRequest]:
    """n completions of 8-48 random ids asking 8-32 tokens (ids 17-255: the tiny vocab)."""
    return loadgen.token_workload(n, prompt_len=(8, 48), output_len=(8, 32), vocab=256, seed=seed)


def timed_stream(url: str, req: loadgen.LoadRequest, model: str = MODEL) -> dict:
    """One streaming completion, timed on this side: sent, each chunk with tokens, the end."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    chunks, usage, finish = [], None, None
    with httpx.Client(timeout=60) as client:
        sent = time.perf_counter()
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    n = len(choice.get("token_ids") or [])
                    if n:
                        chunks.append((now, n))
                    finish = choice.get("finish_reason") or finish
        end = time.perf_counter()
    return {
        "asked": req.max_tokens,
        "sent": sent,
        "chunks": chunks,
        "end": end,
        "usage": usage,
        "finish": finish,
    }


def by_hand(s: dict) -> dict:
    """The four figures, from the timestamps alone (seconds).

    TTFT: first token's arrival - sent. ITL: each later chunk's gap, split evenly over the tokens
    it carried. TPOT: (end - first token) / (tokens - 1), the decode time per token after the
    first. Throughput: tokens / (end - sent)."""
    (t_first, _), rest = s["chunks"][0], s["chunks"][1:]
    tokens = sum(n for _, n in s["chunks"])
    itls, prev = [], t_first
    for t, n in rest:
        itls += [(t - prev) / n] * n
        prev = t
    return {
        "tokens": tokens,
        "ttft": t_first - s["sent"],
        "itls": itls,
        "tpot": (s["end"] - t_first) / (tokens - 1),
        "e2e": s["end"] - s["sent"],
        "tok_s": tokens / (s["end"] - s["sent"]),
    }


def as_result(s: dict) -> loadgen.RequestResult:
    """The same stream as loadgen's record of it, for `loadgen.summarize`."""
    h = by_hand(s)
    return loadgen.RequestResult(
        asked=s["asked"], tokens=h["tokens"], ttft=h["ttft"], itls=h["itls"], e2e=h["e2e"],
        finish_reason=s["finish"], usage_tokens=s["usage"],
    )  # fmt: skip


def rank_percentile(xs: list[float], q: float) -> float:
    """Linear between closest ranks, written out again."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    i = int(k)
    j = min(i + 1, len(xs) - 1)
    return xs[i] + (xs[j] - xs[i]) * (k - i)


def definitions_table(s: dict) -> list[dict]:
    h = by_hand(s)
    ours = {
        "ttft_p50_ms": round(1000 * h["ttft"], 1),
        "itl_p50_ms": round(1000 * rank_percentile(h["itls"], 50), 1),
        "itl_p99_ms": round(1000 * rank_percentile(h["itls"], 99), 1),
        "tpot_p50_ms": round(1000 * h["tpot"], 1),
        "output_tok_s": round(h["tok_s"], 1),
        "output_tokens": h["tokens"],
        "incomplete": 0 if as_result(s).complete else 1,
    }
    theirs = loadgen.summarize(loadgen.LoadReport([as_result(s)], h["e2e"], 1))
    return [{"figure": k, "by_hand": v, "summarize": theirs[k], "equal": "yes" if v == theirs[k] else "no"}
            for k, v in ours.items()]  # fmt: skip


def stream_table(s: dict) -> list[dict]:
    return [
        {"chunk": i, "tokens": n, "t_ms": round(1000 * (t - s["sent"]), 2)}
        for i, (t, n) in enumerate(s["chunks"])
    ]


def load(url: str, reqs, concurrency: int, model: str = MODEL) -> loadgen.LoadReport:
    """`loadgen.run_load` on an event loop of its own thread (so a notebook's loop is not in the way)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(
            asyncio.run, loadgen.run_load(url, reqs, concurrency=concurrency, model=model)
        ).result()


def measure(url: str, server: str, concurrency: int, reqs, model: str = MODEL) -> dict:
    return {"server": server, **loadgen.summarize(load(url, reqs, concurrency, model))}


def open_load(url: str, reqs, rate: float, seed: int = 0, model: str = MODEL) -> loadgen.LoadReport:
    """`loadgen.run_open_loop` (Poisson arrivals at `rate` per second) on an event loop of its own."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(
            asyncio.run, loadgen.run_open_loop(url, reqs, rate=rate, seed=seed, model=model)
        ).result()


def open_row(report: loadgen.LoadReport, ttft_ms: float = SLO_TTFT_MS, tpot_ms: float = SLO_TPOT_MS) -> dict:
    """One rate's row: what arrived and what came back, the latencies, and the goodput."""
    s = loadgen.summarize(report)
    keep = ("request_rate", "requests", "incomplete", "output_tokens", "seconds", "req_s", "output_tok_s",
            "concurrency", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")  # fmt: skip
    row = {k: s[k] for k in keep}
    row["peak_in_flight"] = row.pop("concurrency")
    return row | loadgen.goodput(report, ttft_ms=ttft_ms, tpot_ms=tpot_ms)


def open_table(url: str, reqs, rates=RATES, seed: int = 0, **slo) -> list[dict]:
    return [open_row(open_load(url, reqs, rate, seed), **slo) for rate in rates]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="a second server to load with the same client (OpenAI completions)")
    p.add_argument("--model", default=MODEL, help="the model name the --url server serves")
    p.add_argument("--rates", type=float, nargs="+", default=list(RATES), help="open loop: requests/s")
    p.add_argument("--open-requests", type=int, default=48, help="open loop: requests per rate")
    p.add_argument("--slo-ttft-ms", type=float, default=SLO_TTFT_MS)
    p.add_argument("--slo-tpot-ms", type=float, default=SLO_TPOT_MS)
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    reqs = workload(args.requests, args.seed)
    open_reqs = workload(args.open_requests, args.seed + 1)
    model, tok = tiny_llama(0), tokenizer()
    rows = []
    with ServerThread(create_app(make_engine(model, tok))) as url:
        stream = timed_stream(url, reqs[0])
        for c in CONCURRENCIES:
            rows.append(measure(url, "max_batch 8", c, reqs))
        slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}
        opened = open_table(url, open_reqs, args.rates, args.seed, **slo)
    with ServerThread(create_app(make_engine(model, tok, rows=1))) as url:
        rows.append(measure(url, "max_batch 1", 4, reqs))
    if args.url:
        rows.append(measure(args.url.rstrip("/"), args.url, 4, reqs, args.model))
    cpu = {"cpu": cpu_line()}  # the machine the timings were taken on
    write_csv([r | cpu for r in stream_table(stream)], args.out / "day-43-stream.csv")
    write_csv([r | cpu for r in definitions_table(stream)], args.out / "day-43-definitions.csv")
    write_csv([r | cpu for r in rows], args.out / "day-43-load.csv")
    write_csv([r | cpu for r in opened], args.out / "day-43-open.csv")
    for r in rows:
        print(
            f"{r['server']:>12} x{r['concurrency']}: {r['output_tok_s']:.1f} tok/s, "
            f"TTFT p50 {r['ttft_p50_ms']:.1f} ms, ITL p50 {r['itl_p50_ms']:.1f} ms, "
            f"TPOT p50 {r['tpot_p50_ms']:.1f} ms, incomplete {r['incomplete']}"
        )
    for r in opened:
        print(
            f"open loop {r['request_rate']:>5} req/s: served {r['req_s']} req/s, peak in flight "
            f"{r['peak_in_flight']}, TTFT p50 {r['ttft_p50_ms']} ms p99 {r['ttft_p99_ms']} ms, "
            f"TPOT p50 {r['tpot_p50_ms']} ms, goodput {r['goodput_req_s']} req/s ({r['good']} good)"
        )


if __name__ == "__main__":
    main()

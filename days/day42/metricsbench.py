"""Day 42: what `/metrics` says after a short load, read with prometheus_client's own parser.

`create_app(engine)` is served by uvicorn on a free port of 127.0.0.1, in a thread of this
process (`nanocourse.ServerThread`). The engine is the tiny random-weight Llama with no tokenizer,
so prompts are token ids. A seeded list of completions (`ignore_eos`, so each returns exactly
`max_tokens` tokens) goes to it through httpx, a few at a time; `/metrics` is scraped before and
after, and parsed with `prometheus_client.parser.text_string_to_metric_families`.

Four tables, next to this file:

* `day-42-names.csv`: every metric family the server exposes after the load, its type and how
  many samples it carries;
* `day-42-counts.csv`: what the counters and the histograms' `_count` say, beside what the
  client sent and got back (they must be equal);
* `day-42-requests.csv`: each request, its status code, the tokens it got, and its round trip
  (this run's clock);
* `day-42-buckets.csv`: the TTFT and inter-token histograms, bucket by bucket: the cumulative
  count Prometheus sends (`le` = "at most this many seconds") and the count inside each bucket
  (this run's clock: not deterministic).

    python days/day42/metricsbench.py                   # 16 requests, 4 at a time
    python days/day42/metricsbench.py --requests 64 --concurrency 8
"""

from __future__ import annotations

import argparse
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from nanocourse import ServerThread, engine_config, tiny_llama, write_csv
from nanoserve.bench import cpu_line
from nanoserve.engine import Engine
from nanoserve.serve import create_app

HERE = Path(__file__).resolve().parent
MODEL = "tiny-llama"
HISTOGRAMS = ["nanoserve_time_to_first_token_seconds", "nanoserve_inter_token_latency_seconds"]


def make_engine(model, rows: int = 4, blocks: int = 96) -> Engine:
    per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
    budget = blocks * per_block + per_block // 16  # + the sink slot
    config = engine_config(42, max_batch=rows, max_model_len=256, kv_budget=budget)
    engine = Engine(model, None, config)
    engine.model_name = MODEL
    return engine


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt ids, max_tokens): prompts of 4-40 ids, 4-24 tokens asked (seeded)."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 256) for _ in range(rng.randint(4, 40))], rng.randint(4, 24)) for _ in range(n)
    ]


def send_load(url: str, reqs, concurrency: int = 4) -> list[dict]:
    """Each request through httpx, `concurrency` at a time; one row per request."""

    def one(i):
        prompt, m = reqs[i]
        body = {"model": MODEL, "prompt": prompt, "max_tokens": m, "ignore_eos": True, "temperature": 0}
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        ms = 1000 * (time.perf_counter() - t0)
        j = r.json()
        return {
            "request": i,
            "prompt_tokens": len(prompt),
            "max_tokens": m,
            "status": r.status_code,
            "completion_tokens": j["usage"]["completion_tokens"] if r.status_code == 200 else "",
            "finish_reason": j["choices"][0]["finish_reason"] if r.status_code == 200 else "",
            "ms": round(ms, 1),
        }

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(reqs))))


def scrape(url: str) -> dict:
    """/metrics, parsed: family name -> prometheus_client Metric."""
    return {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}


def value(families: dict, sample: str, **labels) -> float:
    """One sample's value (0 when the family has no such sample yet)."""
    family = sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    if family not in families:
        return 0.0
    for s in families[family].samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return 0.0


def names_table(families: dict) -> list[dict]:
    """Each family but the `*_created` gauges (prometheus_client's creation timestamps), by type."""
    return [
        {"name": f.name, "type": f.type, "samples": sum(not s.name.endswith("_created") for s in f.samples)}
        for f in sorted(families.values(), key=lambda f: (f.type, f.name))
        if not f.name.endswith("_created")
    ]


def counts_table(families: dict, sent: list[dict]) -> list[dict]:
    """The server's counts beside the client's: requests, tokens, and the histograms' _count."""
    got = [r for r in sent if r["status"] == 200]
    generated = sum(r["completion_tokens"] for r in got)
    v = lambda sample, **labels: value(families, sample, **labels)
    pairs = [
        ("nanoserve_requests_total{finish_reason=length}",
         v("nanoserve_requests_total", finish_reason="length"),
         "responses with finish_reason length", sum(r["finish_reason"] == "length" for r in got)),
        ("nanoserve_generation_tokens_total", v("nanoserve_generation_tokens_total"),
         "completion_tokens summed", generated),
        ("nanoserve_prompt_tokens_total", v("nanoserve_prompt_tokens_total"),
         "prompt ids sent", sum(r["prompt_tokens"] for r in got)),
        ("nanoserve_time_to_first_token_seconds_count", v("nanoserve_time_to_first_token_seconds_count"),
         "requests answered", len(got)),
        ("nanoserve_inter_token_latency_seconds_count", v("nanoserve_inter_token_latency_seconds_count"),
         "tokens after each first", generated - len(got)),
        ("nanoserve_e2e_request_latency_seconds_count", v("nanoserve_e2e_request_latency_seconds_count"),
         "requests answered", len(got)),
        ("nanoserve_kv_blocks_used", v("nanoserve_kv_blocks_used"), "blocks held when idle", 0),
    ]  # fmt: skip
    return [
        {
            "metric": m,
            "from_metrics": int(a),
            "from_client": desc,
            "client_count": b,
            "equal": "yes" if a == b else "no",
        }
        for m, a, desc, b in pairs
    ]


def buckets(families: dict, name: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of one histogram, in order, +Inf last."""
    out = [(float(s.labels["le"]), s.value) for s in families[name].samples if s.name == name + "_bucket"]
    return sorted(out)


def per_bucket(cumulative: list[tuple[float, float]]) -> list[float]:
    """Prometheus buckets are cumulative (`le`: at most); the count inside each is the difference."""
    counts, prev = [], 0.0
    for _, c in cumulative:
        counts.append(c - prev)
        prev = c
    return counts


def buckets_table(families: dict) -> list[dict]:
    rows = []
    for name in HISTOGRAMS:
        cum = buckets(families, name)
        for (le, c), inside in zip(cum, per_bucket(cum)):
            rows.append(
                {
                    "metric": name,
                    "le": "+Inf" if math.isinf(le) else le,
                    "cumulative": int(c),
                    "in_bucket": int(inside),
                }
            )
    return rows


def run(n: int = 16, concurrency: int = 4, seed: int = 0):
    engine = make_engine(tiny_llama(0))
    with ServerThread(create_app(engine)) as url:
        before = scrape(url)
        sent = send_load(url, workload(n, seed), concurrency)
        after = scrape(url)
    return before, sent, after


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    _, sent, after = run(args.requests, args.concurrency, args.seed)
    tables = {
        "day-42-names.csv": names_table(after),
        "day-42-counts.csv": counts_table(after, sent),
        # the buckets and the round trips are this machine's clock
        "day-42-buckets.csv": [r | {"cpu": cpu_line()} for r in buckets_table(after)],
        "day-42-requests.csv": [r | {"cpu": cpu_line()} for r in sent],
    }
    for file, rows in tables.items():
        write_csv(rows, args.out / file)
        print(f"wrote {args.out / file} ({len(rows)} rows)")
    for r in tables["day-42-counts.csv"]:
        print(
            f"{r['metric']:>48} {r['from_metrics']:>5}  {r['from_client']}: {r['client_count']}  {r['equal']}"
        )


if __name__ == "__main__":
    main()

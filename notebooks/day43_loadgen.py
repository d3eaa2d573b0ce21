# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Day 43 — A load generator: what a client sees
#
# Yesterday the server counted its own latencies. A user does not see those: a user sees the
# moment the request left, the moment the first word appeared, and how fast the rest followed,
# all through HTTP, JSON and whatever else shares the machine. A serving benchmark is therefore a
# client: it sends many streaming requests at once and times every chunk as it arrives. Four
# figures come out of those timestamps, and every serving system quotes the same four:
#
# * **TTFT**, time to first token: from sending the request to the first chunk carrying a token;
# * **ITL**, inter-token latency: the gap before each later chunk, one sample per token in it;
# * **TPOT**, time per output token: the time after the first token, divided by the tokens after
#   it, so that e2e = TTFT + (tokens - 1) x TPOT;
# * **throughput**: output tokens over the wall time of the whole run.
#
# `nanoserve.loadgen` is that client. Today we define the four by hand on one stream, check
# that the module computes the same, and then load two servers with it.
#
# 1. a server in-process, and one stream timed chunk by chunk,
# 2. the four figures by hand, equal to `loadgen.summarize`'s,
# 3. 16 requests from 4 clients against the server, then the same client against a second
#    server that runs one request at a time,
# 4. a TPOT that counts the first token's wait, caught,
# 5. an open loop: requests that arrive at Poisson times whether or not the server keeps up,
#    below and above what it serves, and the goodput under a latency objective,
# 6. the day's script (`days/day43/loadbench.py`): the concurrency sweep, the rates, the diagram.
#
# The server's engine is the one of day 43 (`engine_config(43, ...)` in the script's
# `make_engine`): the prefill-first schedule, the gather read of the KV pool, the model's own
# linears, a decode step of torch ops.

# %%
import contextlib
import csv
import io
import math
import random
import statistics
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, ServerThread, diagram_path, tiny_llama
from nanoserve import loadgen
from nanoserve.bench import cpu_line
from nanoserve.serve import create_app

sys.path.insert(0, str(REPO / "days" / "day43"))
import loadbench  # the day's script: the notebook uses its engine, workload and client

torch.set_num_threads(1)
print(cpu_line())
DAY = REPO / "days" / "day43"

# %% [markdown]
# ## 1. One stream, timed by hand
#
# The tiny random-weight Llama, with SmolLM2's tokenizer so that its ids (0-255) decode to text
# and the server has something to stream: it sends a chunk as soon as a whole character is out.
# Many of the tiny vocabulary's ids are single bytes of longer UTF-8 characters, so a chunk can
# carry more than one token. The workload is `loadgen.token_workload`'s: prompts of random ids,
# `ignore_eos`, so every request returns exactly what it asked. `loadbench.timed_stream` is a
# plain httpx client that writes down three things: when it sent, when each chunk with tokens
# arrived (and how many), when the stream ended.

# %%
model, tok = tiny_llama(0), loadbench.tokenizer()
server = ServerThread(create_app(loadbench.make_engine(model, tok)))
with contextlib.redirect_stderr(io.StringIO()):
    url = server.__enter__()
reqs = loadbench.workload(16, seed=0)
print(f"{len(reqs)} requests, prompts {[len(r.prompt) for r in reqs]}")
print(f"max_tokens {[r.max_tokens for r in reqs]} (sum {sum(r.max_tokens for r in reqs)})")
stream = loadbench.timed_stream(url, reqs[0])
print("request 0 asked", reqs[0].max_tokens, "| usage says", stream["usage"], "| finish", stream["finish"])
print("tokens per chunk:", [n for _, n in stream["chunks"]])
assert sum(n for _, n in stream["chunks"]) == stream["usage"] == reqs[0].max_tokens

# %%
# NBVAL_IGNORE_OUTPUT
arrivals = [f"{1000 * (t - stream['sent']):.1f} ms" for t, _ in stream["chunks"]]
print("chunk arrivals since sending:", ", ".join(arrivals))
print(f"stream ended {1000 * (stream['end'] - stream['sent']):.1f} ms after sending")

# %% [markdown]
# ## 2. The four figures by hand
#
# Written out on the timestamps above, in a few lines each. TTFT is the first chunk's arrival.
# Each later chunk's gap becomes one ITL sample per token it carried (a chunk of 5 tokens after
# a gap of 15 ms is five samples of 3 ms): the client cannot know when inside the gap each token
# was made. TPOT divides everything after the first chunk by the tokens after the first, so TTFT
# plus (tokens - 1) TPOT is the whole request. Throughput, for one stream, is its tokens over its
# time. Then the same timestamps go to `loadgen.summarize` inside a `RequestResult`, and every
# figure must agree to the printed digit.

# %%
t_first = stream["chunks"][0][0]
ttft = t_first - stream["sent"]
gaps, prev = [], t_first
for t, n in stream["chunks"][1:]:
    gaps += [(t - prev) / n] * n
    prev = t
tokens = sum(n for _, n in stream["chunks"])
tpot = (stream["end"] - t_first) / (tokens - 1)
tok_s = tokens / (stream["end"] - stream["sent"])
assert len(gaps) == tokens - stream["chunks"][0][1]  # the first chunk's tokens have no gap
assert math.isclose(ttft + (tokens - 1) * tpot, stream["end"] - stream["sent"], abs_tol=1e-12)

h = loadbench.by_hand(stream)
assert (h["ttft"], h["itls"], h["tpot"], h["tok_s"]) == (ttft, gaps, tpot, tok_s)  # the script's by_hand
theirs = loadgen.summarize(loadgen.LoadReport([loadbench.as_result(stream)], h["e2e"], 1))
mine = {
    "ttft_p50_ms": round(1000 * ttft, 1),
    "itl_p50_ms": round(1000 * statistics.median(gaps), 1),
    "tpot_p50_ms": round(1000 * tpot, 1),
    "output_tok_s": round(tok_s, 1),
    "output_tokens": tokens,
}
for k, v in mine.items():
    assert v == theirs[k], (k, v, theirs[k])
print("by hand = loadgen.summarize for", list(mine), "| incomplete:", theirs["incomplete"])
print(f"ITL samples: {len(gaps)} (tokens {tokens} minus the {stream['chunks'][0][1]} of the first chunk)")

# %%
# NBVAL_IGNORE_OUTPUT
print(f"TTFT {1000 * ttft:.1f} ms | ITL p50 {1000 * statistics.median(gaps):.1f} ms | "
      f"TPOT {1000 * tpot:.1f} ms | {tok_s:.1f} tok/s")

# %% [markdown]
# ## 3. Under load, and the same client against a second server
#
# `loadgen.run_load` runs N clients on one event loop; each takes the next request when its
# previous one finishes, so at most N are in flight. 16 requests, 4 clients, against this
# server (`max_batch` 8: all four in flight are decoded in one batch). Then the same call,
# same requests, against a second server: a fresh in-process one built with `max_batch` 1,
# which admits one request at a time and queues the rest. The client only knows a URL and a
# model name; any server that streams OpenAI completions can go there, which is what the
# script's `--url` is for. The tokens must match on both: same greedy model, same requests.

# %%
report_a = loadbench.load(url, reqs, 4)
second = ServerThread(create_app(loadbench.make_engine(model, tok, rows=1)))
with contextlib.redirect_stderr(io.StringIO()):
    url_b = second.__enter__()
report_b = loadbench.load(url_b, reqs, 4)
second.__exit__(None, None, None)
server.__exit__(None, None, None)
sum_a, sum_b = loadgen.summarize(report_a), loadgen.summarize(report_b)
for name, s in (("max_batch 8", sum_a), ("max_batch 1", sum_b)):
    print(f"{name}: requests {s['requests']}, concurrency {s['concurrency']}, incomplete {s['incomplete']}, "
          f"output tokens {s['output_tokens']}")
assert sum_a["incomplete"] == sum_b["incomplete"] == 0
assert sum_a["output_tokens"] == sum_b["output_tokens"] == sum(r.max_tokens for r in reqs) == 375

# %%
# NBVAL_IGNORE_OUTPUT
for name, s in (("max_batch 8", sum_a), ("max_batch 1", sum_b)):
    print(f"{name}: {s['output_tok_s']:.1f} tok/s, TTFT p50 {s['ttft_p50_ms']:.1f} ms / "
          f"p99 {s['ttft_p99_ms']:.1f} ms, ITL p50 {s['itl_p50_ms']:.1f} ms, "
          f"TPOT p50 {s['tpot_p50_ms']:.1f} ms")

# %% [markdown]
# ## 4. A TPOT that counts the first token's wait
#
# The tempting shortcut is e2e / tokens: "time per output token" read literally. It folds the
# wait for the first token, the queue and the prefill, into every token. The check is the
# identity the right definition is built on: TTFT + (tokens - 1) x TPOT = e2e, for every
# request. First on a stream made up with round numbers (sent at 0, first token at 500 ms after
# a queue, then 9 tokens 20 ms apart, the end 4 ms after the last), then on the second
# server's requests, where three of every four clients wait in its queue.

# %%
def tpot_right(r):
    return r.tpot  # loadgen's: (e2e - ttft) / (tokens - 1)


def tpot_wrong(r):
    return r.e2e / r.output_tokens  # BUG: the first token's wait is spread over every token


def check_tpot(results, tpot):
    """e2e = TTFT + (tokens - 1) x TPOT, for every request."""
    for i, r in enumerate(results):
        off = r.ttft + (r.output_tokens - 1) * tpot(r) - r.e2e
        assert abs(off) < 1e-9, f"request {i}: TTFT + (n - 1) TPOT misses e2e by {1000 * off:.1f} ms"


made_up = loadgen.RequestResult(asked=10, tokens=10, ttft=0.5, itls=[0.02] * 9, e2e=0.684,
                                finish_reason="length", usage_tokens=10)  # fmt: skip
print(f"made up: right TPOT {1000 * tpot_right(made_up):.1f} ms per token, "
      f"wrong {1000 * tpot_wrong(made_up):.1f} ms per token")
check_tpot([made_up], tpot_right)
try:
    check_tpot([made_up], tpot_wrong)
except AssertionError as e:
    print("caught:", e)
else:
    raise AssertionError("the check passed on a TPOT that counts the first token's wait")
check_tpot(report_b.results, tpot_right)
try:
    check_tpot(report_b.results, tpot_wrong)
except AssertionError as e:
    print("on the second server: caught", str(e).split(":")[0])
else:
    raise AssertionError("the check passed on the measured requests")

# %%
# NBVAL_IGNORE_OUTPUT
right = [tpot_right(r) for r in report_b.results]
wrong = [tpot_wrong(r) for r in report_b.results]
print(f"second server, 16 requests: TPOT p50 right {1000 * statistics.median(right):.1f} ms, "
      f"wrong {1000 * statistics.median(wrong):.1f} ms "
      f"({statistics.median(wrong) / statistics.median(right):.1f} x)")

# %% [markdown]
# ## 5. An open loop, and goodput
#
# Every load so far was a closed loop: a client sends its next request only when its last one
# is answered, so a slow server slows its clients down and the queue can never hold more than
# the number of clients. Users of a public endpoint do not wait for each other. An open loop
# sends requests at times fixed in advance, whatever the server is doing: a Poisson process at
# `rate` requests a second, whose gaps are independent draws from an exponential distribution
# of mean 1 / rate. Below what the server sustains, each request finds it mostly free; above
# it, the requests arrive faster than they leave, the queue grows for as long as they keep
# coming, and so does every later request's TTFT.
#
# First the arrival times by hand, a running sum of seeded exponential gaps, equal to
# `loadgen.poisson_arrivals`; then their mean gap over many draws; then a rate that is not a
# rate, refused.

# %%
def arrivals_by_hand(n, rate, seed):
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)  # one exponential gap
        out.append(t)
    return out


assert arrivals_by_hand(16, 8.0, 0) == loadgen.poisson_arrivals(16, 8.0, seed=0)
print("16 arrivals at 8 req/s, seed 0 (s):", [round(t, 3) for t in loadgen.poisson_arrivals(16, 8.0)])
many = loadgen.poisson_arrivals(10_000, 8.0, seed=0)
gaps_many = [b - a for a, b in zip([0.0] + many, many)]
print(f"10,000 gaps at 8 req/s: mean {statistics.fmean(gaps_many):.4f} s (1 / rate = 0.125), "
      f"sd {statistics.pstdev(gaps_many):.4f} s (an exponential's sd is its mean)")
assert abs(statistics.fmean(gaps_many) - 1 / 8) < 0.005
assert loadgen.poisson_arrivals(16, 8.0, seed=0) == loadgen.poisson_arrivals(16, 8.0, seed=0)
try:
    loadgen.poisson_arrivals(16, -8.0)
except ValueError as e:
    print("rate -8 ->", e)
else:
    raise AssertionError("a negative rate was accepted")

# %% [markdown]
# The same 16 requests, sent open-loop to a fresh `max_batch` 8 server at two rates: 8 a second,
# below what it sustains (eight closed-loop clients got 99.8 a second out of it in the script's
# run, section 6), and 256 a second, which hands it all 16 in well under a tenth of a second.
# Goodput counts the requests that came back whole and met a service-level objective;
# DistServe's definition, which vLLM's benchmark takes as `--goodput ttft:X tpot:Y`. The
# objective here, stated before the run: TTFT at most 250 ms and TPOT at most 25 ms
# (`loadbench.SLO_TTFT_MS`, `SLO_TPOT_MS`). The count by hand must equal `loadgen.goodput`'s.

# %%
def good_by_hand(report, ttft_ms, tpot_ms):
    return sum(r.complete and 1000 * r.ttft <= ttft_ms and 1000 * (r.tpot or 0.0) <= tpot_ms
               for r in report.results)  # fmt: skip


third = ServerThread(create_app(loadbench.make_engine(model, tok)))
with contextlib.redirect_stderr(io.StringIO()):
    url_c = third.__enter__()
opened = {rate: loadbench.open_load(url_c, reqs, rate, seed=0) for rate in (8.0, 256.0)}
third.__exit__(None, None, None)
slo = {"ttft_ms": loadbench.SLO_TTFT_MS, "tpot_ms": loadbench.SLO_TPOT_MS}
for rate, rep in opened.items():
    s, g = loadgen.summarize(rep), loadgen.goodput(rep, **slo)
    assert g["good"] == good_by_hand(rep, **slo)
    sent = [r.sent_at for r in rep.results]
    want = loadgen.poisson_arrivals(16, rate, seed=0)
    assert all(abs(a - b) < 0.25 for a, b in zip(sent, want))  # sent on schedule, not on answers
    print(f"rate {rate:>5}: requests {s['requests']}, incomplete {s['incomplete']}, "
          f"output tokens {s['output_tokens']}; goodput by hand = loadgen.goodput")
    assert s["incomplete"] == 0 and s["output_tokens"] == 375

# %%
# NBVAL_IGNORE_OUTPUT
for rate, rep in opened.items():
    s, g = loadgen.summarize(rep), loadgen.goodput(rep, **slo)
    print(f"rate {rate:>5} req/s: peak in flight {s['concurrency']}, TTFT p50 {s['ttft_p50_ms']} ms / p99 "
          f"{s['ttft_p99_ms']} ms, TPOT p50 {s['tpot_p50_ms']} ms, {g['good']} of 16 met the objective, "
          f"goodput {g['goodput_req_s']} req/s")

# %% [markdown]
# ## 6. The day's script: the concurrency sweep and the rates
#
# `days/day43/loadbench.py` does all of this in one run: the timed stream (`day-43-stream.csv`),
# each figure by hand beside `summarize`'s (`day-43-definitions.csv`), and the same 16 requests
# at 1, 2, 4 and 8 clients against the `max_batch` 8 server, then 4 clients against the
# `max_batch` 1 one (`day-43-load.csv`); then 48 other requests open-loop at 4, 16, 64 and 256 a
# second against the `max_batch` 8 server, with the goodput under the objective above
# (`day-43-open.csv`). The deterministic columns must equal this notebook's runs; the timings
# are that run's clock, taken on a 2-core machine with nothing else busy on it.

# %%
with open(DAY / "day-43-load.csv") as f:
    sweep = list(csv.DictReader(f))
with open(DAY / "day-43-definitions.csv") as f:
    defs = list(csv.DictReader(f))
with open(DAY / "day-43-stream.csv") as f:
    committed_chunks = [int(r["tokens"]) for r in csv.DictReader(f)]
assert all(r["equal"] == "yes" for r in defs) and committed_chunks == [n for _, n in stream["chunks"]]
for r in sweep:
    print(f"{r['server']:>12}  clients {r['concurrency']}  requests {r['requests']}  "
          f"incomplete {r['incomplete']}  output tokens {r['output_tokens']}")
facts = ["requests", "concurrency", "incomplete", "output_tokens"]
row4 = {r["server"]: r for r in sweep if r["concurrency"] == "4"}
assert [row4["max_batch 8"][k] for k in facts] == [str(sum_a[k]) for k in facts]
assert [row4["max_batch 1"][k] for k in facts] == [str(sum_b[k]) for k in facts]
with open(DAY / "day-43-open.csv") as f:
    rates = list(csv.DictReader(f))
open_reqs = loadbench.workload(48, seed=1)
for r in rates:
    print(f"open loop {r['request_rate']:>6} req/s  requests {r['requests']}  incomplete {r['incomplete']}  "
          f"output tokens {r['output_tokens']}  objective TTFT <= {r['slo_ttft_ms']} ms, "
          f"TPOT <= {r['slo_tpot_ms']} ms")
    assert (r["requests"], r["incomplete"]) == ("48", "0")
    assert int(r["output_tokens"]) == sum(q.max_tokens for q in open_reqs)

# %%
# NBVAL_IGNORE_OUTPUT
for r in sweep:
    print(f"{r['server']:>12} x{r['concurrency']}: {float(r['output_tok_s']):.1f} tok/s, "
          f"TTFT p50 {r['ttft_p50_ms']} ms, ITL p50 {r['itl_p50_ms']} ms, TPOT p50 {r['tpot_p50_ms']} ms")
capacity = float(next(r for r in sweep if r["server"] == "max_batch 8" and r["concurrency"] == "8")["req_s"])
print(f"closed loop, 8 clients: {capacity} req/s served")
for r in rates:
    print(f"open loop {float(r['request_rate']):>5.0f} req/s: served {r['req_s']} req/s, peak in flight "
          f"{r['peak_in_flight']}, TTFT p50 {r['ttft_p50_ms']} ms / p99 {r['ttft_p99_ms']} ms, TPOT p50 "
          f"{r['tpot_p50_ms']} ms, goodput {r['goodput_req_s']} req/s ({r['good']} of 48)")

# %%
fig, axes = plt.subplots(1, 4, figsize=(21, 4.8))
fig.suptitle("Day 43 — a load generator's four figures (tiny Llama behind HTTP, CPU, shared)", fontsize=13)
ax = axes[0]
ts = [1000 * (t - stream["sent"]) for t, _ in stream["chunks"]]
ax.vlines(ts, 0, [n for _, n in stream["chunks"]], color="tab:blue", lw=3, label="a chunk (height: tokens)")
ax.axvspan(0, ts[0], color="#fde0c5", label=f"TTFT {ts[0]:.0f} ms")
end_ms = 1000 * (stream["end"] - stream["sent"])
ax.axvspan(ts[0], end_ms, color="#d9ead3", label=f"(n - 1) x TPOT, TPOT {1000 * tpot:.1f} ms")
ax.set_xlabel("ms since the request was sent")
ax.set_ylabel("tokens in the chunk")
ax.set_title(f"one stream: {tokens} tokens in {len(ts)} chunks")
ax.legend(fontsize=8, loc="upper left")
ax.set_ylim(0, max(n for _, n in stream["chunks"]) + 2.5)

ax = axes[1]
s8 = [r for r in sweep if r["server"] == "max_batch 8"]
cs = [int(r["concurrency"]) for r in s8]
ax.plot(cs, [float(r["output_tok_s"]) for r in s8], "o-", color="tab:green", label="throughput (tok/s)")
ax.set_xscale("log", base=2)
ax.set_xticks(cs, [str(c) for c in cs])
ax.set_xlabel("concurrent clients (max_batch 8 server)")
ax.set_ylabel("output tok/s")
ax2 = ax.twinx()
ax2.plot(cs, [float(r["ttft_p50_ms"]) for r in s8], "s--", color="tab:orange", label="TTFT p50 (ms)")
ax2.plot(cs, [float(r["tpot_p50_ms"]) for r in s8], "^:", color="tab:purple", label="TPOT p50 (ms)")
ax2.set_ylabel("ms")
lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
ax.legend(lines, [ln.get_label() for ln in lines], fontsize=8, loc="upper left")
ax.set_title("the sweep (days/day43/day-43-load.csv)")

ax = axes[2]
order = sorted(range(len(report_b.results)), key=lambda i: report_b.results[i].ttft)
x = range(len(order))
ax.bar([i - 0.2 for i in x], [1000 * right[i] for i in order], 0.4, label="TPOT (e2e - TTFT) / (n - 1)")
ax.bar([i + 0.2 for i in x], [1000 * wrong[i] for i in order], 0.4, color="tab:red", label="e2e / n (wrong)")
ax.set_xlabel("second server's 16 requests, by TTFT (queue wait) ascending")
ax.set_ylabel("ms per token")
ax.set_title("max_batch 1, 4 clients: the wait leaks into e2e / n")
ax.legend(fontsize=8)

ax = axes[3]
rs = [float(r["request_rate"]) for r in rates]
ax.plot(rs, [float(r["ttft_p50_ms"]) for r in rates], "s--", color="tab:orange", label="TTFT p50 (ms)")
ax.plot(rs, [float(r["ttft_p99_ms"]) for r in rates], "v-", color="tab:red", label="TTFT p99 (ms)")
ax.axhline(loadbench.SLO_TTFT_MS, color="grey", lw=0.8, ls=":", label="objective: TTFT 250 ms")
ax.axvline(capacity, color="tab:green", lw=1, label=f"closed loop x8 served {capacity:.1f} req/s")
ax.set_xscale("log", base=2)
ax.set_xticks(rs, [f"{x:g}" for x in rs])
ax.set_xlabel("open loop: arrivals per second (Poisson, 48 requests)")
ax.set_ylabel("ms")
ax2 = ax.twinx()
ax2.bar(rs, [int(r["good"]) for r in rates], width=[x * 0.25 for x in rs], alpha=0.25, color="tab:blue",
        label="requests within the objective (of 48)")  # fmt: skip
ax2.set_ylabel("requests within the objective")
ax2.set_ylim(0, 52)
lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
ax.legend(lines, [ln.get_label() for ln in lines], fontsize=7, loc="upper center",
          bbox_to_anchor=(0.5, -0.16), ncol=2)  # fmt: skip
ax.set_title("open loop (days/day43/day-43-open.csv)")
fig.tight_layout()
path = diagram_path("day43-loadgen.png")
fig.savefig(path, dpi=110)
plt.close(fig)
display(Image(filename=str(path)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM**'s serving benchmark, `vllm bench serve` (earlier the script
#   `benchmarks/benchmark_serving.py`), is the same kind of client: asyncio tasks streaming
#   from the OpenAI routes, TTFT at the first chunk, ITL per chunk after it, and TPOT reported
#   as "time per output token (excl. 1st token)", the definition used here. It paces requests
#   rather than running a fixed set of clients: `--request-rate` draws the gaps between
#   arrivals from a Poisson process, or a gamma process when `--burstiness` is not 1, and
#   `--max-concurrency` caps how many are in flight, which is all `run_load`'s `concurrency`
#   does. `run_open_loop` is `--request-rate` with a burstiness of 1 and no cap, and
#   `loadgen.goodput` is its `--goodput ttft:X tpot:Y` (it also accepts an `e2el` bound).
# * **SGLang** ships `python -m sglang.bench_serving`, which reports the same figures and, with
#   `--backend` (`vllm`, `lmdeploy`, `trt`, its own `sglang`), loads servers other than its own,
#   as the script's `--url` does.
# * **TGI**'s `text-generation-benchmark` sits below the HTTP router: it talks to the model
#   shards over gRPC and reports prefill and decode latency and throughput per batch size. It
#   measures the engine, not what an HTTP client sees, which is the difference between
#   yesterday's server-side histograms and today's numbers.
# * **llama.cpp**'s `llama-server` accepts `return_tokens` on its `/completion` route, and
#   loadgen's `stream_one` counts a chunk's tokens from the `tokens` list such a server sends,
#   so the same client can load it.
# * The **OpenAI API** has `stream_options.include_usage`: one extra chunk at the end, with
#   empty `choices` and the server's `usage`. loadgen trusts that count over the tokens it
#   counted in chunks, and a request whose usage is short of `max_tokens` is incomplete.
#
# ## Try it
#
# 1. **Bursty arrivals.** vLLM's `--burstiness` draws the gaps from a gamma distribution of
#    shape k and mean 1 / rate instead of an exponential (k = 1). Write
#    `gamma_arrivals(n, rate, k, seed)` with `random.Random(seed).gammavariate(k, 1 / (rate * k))`
#    gaps. The check: over 10,000 arrivals at 8 a second, the mean gap is within 2% of 0.125 s for
#    k = 0.25 and k = 4, and the gaps' sd over their mean is close to 1 / sqrt(k) (2 and 0.5),
#    against section 5's exponential, whose ratio is 1.
# 2. **ITL per chunk or per token.** Recompute section 2's ITL as one sample per chunk (the raw
#    gap) instead of one per token. The check: the median moves, and the sum of the per-token
#    samples still equals the last chunk's arrival minus the first's.
# 3. **A server that loses tokens.** Copy one `RequestResult` of `report_a` with
#    `dataclasses.replace`, its `usage_tokens` one short of `asked`. The check: its `complete` is
#    False, and `summarize` on a report holding it counts 1 in `incomplete`.

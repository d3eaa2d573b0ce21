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
# # Day 42 — `/metrics`: what the server says about itself
#
# A server that answers requests is not yet a server somebody can run. The operator needs to
# know, without reading logs, how long the first token takes, how fast tokens follow each
# other, how many requests ended and why, and how full the KV pool is. Every serving system
# answers that the same way: a `GET /metrics` route that returns the Prometheus text format, a
# scraper that reads it every few seconds, and dashboards drawn from what it stored.
#
# nanoserve's `/metrics` (`nanoserve/metrics.py`) keeps its own registry. The engine loop
# updates three histograms (time to first token, inter-token latency, end-to-end latency) and
# three counters (prompt tokens, generated tokens, requests by finish reason) as outputs leave
# a step; a collector reads the engine's state (running, waiting, KV blocks, graphs) when a
# scrape arrives. Today we read it the way a scraper does, and check that it tells the truth.
#
# 1. a server in-process and its first scrape, before any request,
# 2. a short load: 16 completions, 4 at a time, through httpx,
# 3. the names and their types, parsed with prometheus_client's own parser,
# 4. every counter against what the notebook sent and got back (asserts),
# 5. the two latency histograms: cumulative buckets, the count in each, a quantile by hand,
# 6. a parser that takes cumulative buckets for per-bucket counts, caught,
# 7. the day's script (`days/day42/metricsbench.py`) and its tables, and the diagram.

# %%
import contextlib
import io
import itertools
import math
import sys

import httpx
import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, ServerThread, as_text, diagram_path, read_csv, tiny_llama
from nanoserve.bench import cpu_line
from nanoserve.serve import create_app

sys.path.insert(0, str(REPO / "days" / "day42"))
import metricsbench  # the day's script: the notebook uses its engine, load and tables

torch.set_num_threads(1)
print(cpu_line())
DAY = REPO / "days" / "day42"

# %% [markdown]
# ## 1. The server, and a scrape before any request
#
# The tiny random-weight Llama with no tokenizer (prompts are token ids), on the engine of day 34
# (`metricsbench.make_engine` calls `engine_config(42, ...)`), served by uvicorn on a free port of
# 127.0.0.1 in a thread of this process. The first scrape is the raw text a
# Prometheus server would receive: a `# HELP` and a `# TYPE` line per family, then one line per
# sample. A histogram is many samples: one `_bucket` per upper bound `le`, plus `_count` and
# `_sum`.

# %%
engine = metricsbench.make_engine(tiny_llama(0))
app = create_app(engine)
server = ServerThread(app)
with contextlib.redirect_stderr(io.StringIO()):
    url = server.__enter__()
raw = httpx.get(url + "/metrics")
print("GET /metrics ->", raw.status_code, raw.headers["content-type"])
lines = raw.text.splitlines()
print(len(lines), "lines; the TTFT histogram's first ones:")
ttft_lines = [ln for ln in lines if "time_to_first_token" in ln and "created" not in ln]
print(*ttft_lines[:5], "...", *ttft_lines[-3:], sep="\n  ")
before = metricsbench.scrape(url)
print("requests counted before any request:", [s for s in before["nanoserve_requests"].samples])
assert raw.status_code == 200 and metricsbench.value(before, "nanoserve_generation_tokens_total") == 0

# %% [markdown]
# `nanoserve_requests` has a `finish_reason` label, and a labelled counter has no sample at all
# until some label value is first used: before the first request ends, the family is there
# with nothing in it. A query that divides by it sees "no data", not zero.
#
# ## 2. A short load
#
# 16 completions from the script's seeded list (prompts of 4-40 ids, 4-24 tokens asked, with
# `ignore_eos`, so each must return exactly what it asked), sent through httpx by 4 threads.

# %%
reqs = metricsbench.workload(16, seed=0)
sent = metricsbench.send_load(url, reqs, concurrency=4)
after = metricsbench.scrape(url)
print("status codes:", sorted({r["status"] for r in sent}), "| requests:", len(sent))
print("asked:", [m for _, m in reqs])
print("got:  ", [r["completion_tokens"] for r in sent])
assert all(r["status"] == 200 and r["completion_tokens"] == r["max_tokens"] for r in sent)

# %% [markdown]
# ## 3. The names and their types
#
# `text_string_to_metric_families` groups samples into families and strips the suffixes: the
# counter `nanoserve_requests` exposes the sample `nanoserve_requests_total`, the histogram's
# family holds its `_bucket`, `_count` and `_sum`. prometheus_client also writes a
# `*_created` gauge beside every counter and histogram (the time it was created); the table
# leaves those out.

# %%
names = metricsbench.names_table(after)
for r in names:
    print(f"{r['type']:>9}  {r['name']:<40} samples {r['samples']}")
created = [n for n in after if n.endswith("_created")]
print(len(created), "_created gauges left out, e.g.", created[0])
assert as_text(names) == read_csv(DAY / "day-42-names.csv")  # the journal's table
assert {r["type"] for r in names} == {"counter", "gauge", "histogram"}
assert all(r["samples"] == 12 + 1 + 2 for r in names if r["type"] == "histogram")  # bounds, +Inf, count, sum

# %% [markdown]
# ## 4. The counters against what was sent
#
# Each count on the server's side beside the same count on the client's side. Two are worth a
# second look: the inter-token histogram observes once per token after a request's first one
# (a step that handed a request two tokens would observe once, so this equality also says
# every step gave one token), and the KV blocks in use are back to 0 once the load is over.

# %%
counts = metricsbench.counts_table(after, sent)
for r in counts:
    print(f"{r['metric']:>48} = {r['from_metrics']:>4}   {r['from_client']}: {r['client_count']}")
assert all(r["equal"] == "yes" for r in counts)
assert as_text(counts) == read_csv(DAY / "day-42-counts.csv")
print("every count equals the client's")

# %% [markdown]
# ## 5. The two histograms
#
# A Prometheus bucket is cumulative: `_bucket{le="0.025"}` counts every observation of at most
# 25 ms, including those already counted under `le="0.01"`. The last bucket, `+Inf`, is
# `_count`. The number inside one bucket is the difference of two neighbours. A quantile comes
# from the cumulative counts the way PromQL's `histogram_quantile` does it: find the first
# bucket whose cumulative count reaches q × count, and interpolate linearly inside it. It is an
# estimate: the histogram only knows which bucket a value fell in.

# %%
def quantile(cumulative, q):
    """histogram_quantile by hand: linear inside the first bucket that reaches q * count."""
    total = cumulative[-1][1]
    rank, lower, below = q * total, 0.0, 0.0
    for le, c in cumulative:
        if c >= rank:
            if math.isinf(le):
                return lower  # past the last finite bound: the bound is all we know
            return lower + (le - lower) * (rank - below) / (c - below)
        lower, below = le, c
    return float("nan")


hist = {}
for name in metricsbench.HISTOGRAMS:
    cum = metricsbench.buckets(after, name)
    inside = metricsbench.per_bucket(cum)
    count = metricsbench.value(after, name + "_count")
    assert cum[-1][1] == count and sum(inside) == count  # +Inf is the count; the pieces add up
    assert all(a <= b for (_, a), (_, b) in zip(cum, cum[1:]))  # cumulative never falls
    hist[name] = (cum, inside, count, metricsbench.value(after, name + "_sum"))
    print(f"{name}: {int(count)} observations in {len(cum)} buckets, the pieces add up to the count")

# %%
# NBVAL_IGNORE_OUTPUT
for name, (cum, inside, count, total) in hist.items():
    print(name)
    print("  le (ms):   ", [("+Inf" if math.isinf(le) else f"{1000 * le:g}") for le, _ in cum])
    print("  cumulative:", [int(c) for _, c in cum])
    print("  in bucket: ", [int(c) for c in inside])
    print(f"  mean {1000 * total / count:.1f} ms, p50 ~ {1000 * quantile(cum, 0.5):.1f} ms, "
          f"p90 ~ {1000 * quantile(cum, 0.9):.1f} ms")
client_ms = sum(r["ms"] for r in sent)
server_ms = 1000 * metricsbench.value(after, "nanoserve_e2e_request_latency_seconds_sum")
print(f"end-to-end, summed: server {server_ms:.0f} ms, client round trips {client_ms:.0f} ms")
assert server_ms <= client_ms  # the server's clock starts after the client's and stops before it

# %% [markdown]
# ## 6. A parser that reads cumulative buckets as counts
#
# The easy mistake: take each `_bucket` value as the number of observations in that bucket.
# On the scrape above, the "counts" of such a parser add up to far more than `_count` (every
# observation is counted once per bucket at or above it), and its median lands in whatever
# bucket holds the middle of that inflated total, which is always too high. The check of
# section 5 (the pieces add up to `_count`) catches it.

# %%
def per_bucket_wrong(cumulative):
    return [c for _, c in cumulative]  # BUG: cumulative taken for per-bucket


cum, _, count, _ = hist["nanoserve_inter_token_latency_seconds"]
wrong = per_bucket_wrong(cum)
times = sum(wrong) / count  # this run's buckets: printed in the next cell
try:
    assert sum(wrong) == count, f"the bucket 'counts' add up to more than _count ({int(count)})"
except AssertionError as e:
    print("caught:", e)
else:
    raise AssertionError("the check passed on a parser that reads cumulative buckets as counts")

# %%
# NBVAL_IGNORE_OUTPUT
print(f"this run: the wrong parser sees {int(sum(wrong))} inter-token observations, {times:.1f} x the count;")
as_cumulative = list(zip([le for le, _ in cum], itertools.accumulate(wrong)))  # what it would re-sum
print(f"its median ~ {1000 * quantile(as_cumulative, 0.5):.1f} ms, "
      f"the right one ~ {1000 * quantile(cum, 0.5):.1f} ms")

# %% [markdown]
# ## 7. The day's script, and the shutdown
#
# `days/day42/metricsbench.py` does sections 1-4 in one run (its own server, the same 16
# requests) and writes four tables: the names (`day-42-names.csv`), the counts
# (`day-42-counts.csv`), the requests with their status codes (`day-42-requests.csv`) and the
# two histograms bucket by bucket (`day-42-buckets.csv`). The notebook checked its first two
# against its own scrape above; the buckets are this run's clock. The server stops here: the
# lifespan stops the engine loop, and the port closes.

# %%
committed = read_csv(DAY / "day-42-requests.csv")
facts = ["request", "prompt_tokens", "max_tokens", "status", "completion_tokens", "finish_reason"]
assert [[str(r[k]) for k in facts] for r in sent] == [[r[k] for k in facts] for r in committed]
print("the script's requests:", len(committed), "| status codes", sorted({r["status"] for r in committed}))
server.__exit__(None, None, None)
try:
    httpx.get(url + "/metrics", timeout=2)
except httpx.ConnectError:
    print("after shutdown: connection refused")

# %%
fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
fig.suptitle("Day 42 — /metrics after 16 completions, 4 at a time (tiny Llama, CPU)", fontsize=13)
for ax, name, title in zip(axes[:2], metricsbench.HISTOGRAMS, ["time to first token", "inter-token latency"]):
    cum, inside, count, _ = hist[name]
    labels = ["+Inf" if math.isinf(le) else f"{1000 * le:g}" for le, _ in cum]
    x = range(len(cum))
    ax.bar(x, [c for _, c in cum], color="#cfd8e3", label="cumulative (_bucket, as sent)")
    ax.bar(x, inside, 0.5, color="tab:blue", label="in the bucket (difference)")
    # (a legend hides a label that starts with "_")
    ax.axhline(count, color="k", ls=":", lw=1, label=f"the count (_count) = {int(count)}")
    ax.set_xticks(list(x), labels, rotation=60, fontsize=8)
    ax.set_xlabel("bucket upper bound le (ms)")
    ax.set_ylabel("observations")
    ax.set_title(title)
    ax.set_ylim(0, 1.45 * count)  # headroom: the legend sits above the bars
    ax.legend(fontsize=8, loc="upper center", ncol=2, frameon=False)
ax = axes[2]
cum, inside, count, _ = hist["nanoserve_inter_token_latency_seconds"]
ax.bar([0, 1], [sum(inside), sum(per_bucket_wrong(cum))], color=["tab:blue", "tab:red"])
ax.axhline(count, color="k", ls=":", lw=1)
for i, v in enumerate([sum(inside), sum(per_bucket_wrong(cum))]):
    ax.text(i, v, f"{int(v)}", ha="center", va="bottom")
ax.set_xticks([0, 1], ["differences\n(right)", "cumulative as counts\n(wrong)"])
ax.set_ylabel("inter-token observations the parser sees")
ax.set_title(f"the check: pieces must add up to _count ({int(count)})")
fig.tight_layout()
path = diagram_path("day42-metrics.png")
fig.savefig(path, dpi=110)
plt.close(fig)
display(Image(filename=str(path)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** serves `/metrics` from its OpenAI server: `vllm/entrypoints/openai/api_server.py`
#   mounts prometheus_client's `make_asgi_app()` on the FastAPI app. Its names carry a `vllm:`
#   prefix: the histograms `vllm:time_to_first_token_seconds`,
#   `vllm:time_per_output_token_seconds`, `vllm:inter_token_latency_seconds` (in newer
#   releases) and `vllm:e2e_request_latency_seconds`; the counters `vllm:prompt_tokens_total`,
#   `vllm:generation_tokens_total` and `vllm:request_success_total` (labelled by
#   `finished_reason`, as ours is by `finish_reason`); gauges like `vllm:num_requests_running`,
#   `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`. Every sample also carries a
#   `model_name` label. In the V1 engine the scheduler runs in the `EngineCore` process and
#   ships its per-step stats with its outputs; the front end (`AsyncLLM`) turns them into
#   samples, so a scrape never waits on the engine. Ours reads counts across threads of one
#   process instead.
# * **SGLang** exposes the same kind of surface only when `launch_server` is given
#   `--enable-metrics`, under an `sglang:` prefix (`sglang:time_to_first_token_seconds`,
#   `sglang:prompt_tokens_total`, `sglang:generation_tokens_total`, `sglang:token_usage`).
# * **TGI**'s router serves `/metrics` with `tgi_` names:
#   `tgi_request_duration` (end to end), `tgi_queue_size`, `tgi_batch_current_size`,
#   `tgi_request_count`, mostly histograms and gauges about batches.
# * **llama.cpp**'s `llama-server` answers `/metrics` only when started with `--metrics`, and
#   with counters and gauges rather than latency histograms: `llamacpp:prompt_tokens_total`,
#   `llamacpp:tokens_predicted_total`, `llamacpp:requests_processing`,
#   `llamacpp:requests_deferred`. A latency distribution has to come from the client side
#   there, which is what Day 43's load generator measures.
#
# ## Try it
#
# 1. **Break the token counter on purpose.** Before section 2, replace the loop's hook with one
#    that forgets the first token of each request: `m = app.state.metrics`, then
#    `def token(stream, now, n=1)` that observes TTFT or the gap as `Metrics.token` does but calls
#    `m.generation_tokens.inc(n)` only in the gap branch, and `m.token = token`. Rerun sections
#    2-4. The check: section 4's assert fails, and the row of `nanoserve_generation_tokens_total`
#    says 190 where the client counted 206, one token short for each of the 16 requests.
# 2. **A client that leaves.** Stream a completion with httpx and close the response after the
#    first chunk. The check: `nanoserve_requests_total{finish_reason="abort"}` appears with 1,
#    and the `length` count does not move.
# 3. **Quantiles from counts.** Use `quantile` on the TTFT histogram with q = 0.5 and compare it
#    with the median of the client's round trips in `sent`. The check: the server's estimate is
#    below the client's median (its clock starts later and stops earlier).

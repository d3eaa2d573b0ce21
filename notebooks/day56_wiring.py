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
# # Day 56 — Wiring: the warm-up moves into the boot path
#
# After Day 55 the warm-up was a method that somebody had to call, and nothing that starts a
# server called it: a server launched through `serve.py` still decoded as on Day 47, with
# buckets, persistent inputs and capture all off. Today the boot path does the calling.
# `build_engine` hands the three switches to the engine, allocates the KV pool, works out how
# far to trim the warm list, records it, and only then returns. `create_app` answers `/health`
# with 503 while that happens and with 200, the pool plan and the warm plan, once it is done.
# A warmed engine records nothing after that: a decode shape its list lacks runs eagerly.
#
# 1. `build_engine` with the switches on: its phases, the trim it picks, and the pools it
#    allocates before any request,
# 2. the gates after boot, and three requests that stay inside the list,
# 3. a server booted in-process: `/health` 503 while warming, 200 after, and the boot line,
# 4. a request through the `openai` client and what `/metrics` counted,
# 5. the day's benchmark (`days/day56/boot.py`): three boots and what one request met on each,
#    with `check_no_cold_captures` failing on the lazy one,
# 6. the diagram.

# %%
import contextlib
import csv
import dataclasses
import io
import sys
import threading
import time

import httpx
import matplotlib
import matplotlib.ticker
import openai
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display
from prometheus_client.parser import text_string_to_metric_families

from nanocourse import REPO, ServerThread, diagram_path, engine_config, read_csv, show
from nanoserve.buckets import bucket_up, width_buckets
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.cli import build_parser, decode_capture, resolve_weights
from nanoserve.engine import build_engine
from nanoserve.errors import GateError
from nanoserve.sampling import SamplingParams
from nanoserve.serve import create_app
from nanoserve.warmup import (
    check_all_warm,
    check_no_cold_captures,
    check_table_stable,
    check_warm_budget,
    check_warm_graphs_unbound,
    warm_budget_bytes,
    warm_shapes,
)
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day56"))
import boot  # the day's script: the notebook prints the table it writes

MODEL_DIR = fetch_default_model()
print("threads:", torch.get_num_threads())

# %% [markdown]
# ## 1. `build_engine` with the switches on
#
# One config carries everything: `bucket_decode`, `persist_inputs` and `capture_decode` switch
# days 52-54 on, and `warm` (on by default) makes `build_engine` record the warm list before it
# returns. The trim is decided in `Engine.warm_trim`, and the first thing it does is allocate
# the KV pool (`cache.ensure_pools()`): only with the pool resident is the free memory it
# probes the memory the graphs will really get. Its limits:
#
# * rows: the scheduler's `max_batch` (or `warm_max_rows` if smaller) — a batch never has more;
# * width: the smallest of the context the deployment serves (`max_model_len`), the operator's
#   `warm_max_width`, and `width_ceiling` of the free memory (the widest shape whose attention
#   scores fit).
#
# `on_phase` is how the server learns which stage it is in; here it just records.

# %%
phases = []
config = engine_config(
    56,  # the engine as of day 56: prefill-first, gather attention, plain linears
    model=str(MODEL_DIR),
    max_batch=4,
    max_model_len=1024,
    bucket_decode=True,
    persist_inputs=True,
    capture_decode=True,
    warm_max_width=96,
)
t0 = time.perf_counter()
with contextlib.redirect_stderr(io.StringIO()) as log:
    engine = build_engine(config, on_phase=lambda p: phases.append((p, time.perf_counter() - t0)))
built_s = time.perf_counter() - t0
report = engine.warm_report
print("phases:", [p for p, _ in phases])
print("stderr:", *log.getvalue().splitlines(), sep="\n  ")
print(f"trim: max_rows {report.max_rows}, max_width {report.max_width}")
print(f"width ceiling of the free memory above the trim: {report.width_ceiling > report.max_width}")
print("warm list, biggest first:", report.shapes)
print(f"graphs {report.graphs}, bytes held {report.bytes:,} (= sum of rows x 49152 x 4: the graphs' logits)")
print(f"built in {built_s:.1f} s, of which warming {report.seconds:.2f} s")
assert report.shapes == warm_shapes(4, 1024, 32, max_rows=4, max_width=96)
assert report.bytes == sum(r * 49152 * 4 for r, _ in report.shapes)
pools = engine.cache.k + engine.cache.v
print(f"K/V pools allocated before any request: {len(pools)} tensors, {engine.cache.allocated_bytes:,} bytes")
assert all(t is not None for t in pools) and engine.runner.lazy is False

# %% [markdown]
# ## 2. The gates after boot
#
# Day 55's gates, run on what `build_engine` handed back: each shape of the list has its graph,
# each graph froze `rows=()` (so it came from the warm-up, not from a request's step), the slot
# table is at the address the largest graph's window points into, and no shape needs more score
# memory than is free. Then three requests of 40 tokens: the longest context any decode step
# sees is printed below, and its width bucket is the widest shape in the list, so every step has
# a graph, nothing is recorded and nothing runs eagerly.

# %%
heads = engine.model.cfg.num_heads
check_all_warm(report.shapes, engine.runner.graphs)
check_warm_graphs_unbound(engine.runner.graphs)
address = engine.runner.graphs[report.shapes[0]].args[0].slot_window.data_ptr()  # where it reads
check_table_stable(engine.runner.slot_table, address)
check_warm_budget(report.shapes, warm_budget_bytes(engine.model.device), heads)
prompts = [[{"role": "user", "content": q}] for q in ("Hi!", "What is 2+2?", "Name a colour.")]
outs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
longest = max(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
print("longest decode context:", longest, "| graphs now:", len(engine.runner.graphs))
width = bucket_up(longest, width_buckets(engine.max_model_len, 32))
print(f"its width bucket: {width} (the list's widest: {report.max_width})")
runner = engine.runner
print("after three requests: cold captures", runner.cold_captures, "| eager steps", runner.eager_steps)
check_no_cold_captures(engine.runner.cold_captures)
assert width == report.max_width == 96 and engine.runner.eager_steps == 0
print("all gates pass")

# %% [markdown]
# ## 3. A server, booted in-process
#
# `create_app` takes either a built engine or a builder. With a builder the app starts
# listening at once and builds in a background thread, so a load balancer asking `/health`
# gets an answer (503, with the phase) instead of a refused connection; generation routes
# answer 503 too. The builder below pauses at the start of the warm-up until the cell has
# looked at `/health`, so the 503 is observed rather than raced. `ServerThread` is uvicorn on
# a background thread, on a free port of 127.0.0.1.

# %%
seen, release = [], threading.Event()


def builder(on_phase):
    def phase(p):
        on_phase(p)
        seen.append(p)
        if p == "warming":
            release.wait(60)

    return build_engine(dataclasses.replace(config, warm_max_width=64), on_phase=phase)


app = create_app(builder, address="127.0.0.1:PORT")
server = ServerThread(app)
boot_log = io.StringIO()
with contextlib.redirect_stderr(boot_log):
    url = server.__enter__()
    while seen[-1:] != ["warming"]:
        time.sleep(0.01)
    before = httpx.get(url + "/health")
    refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    t_release = time.perf_counter()
    release.set()
    while (after := httpx.get(url + "/health")).status_code != 200:
        time.sleep(0.01)
    ready_s = time.perf_counter() - t_release
print("before:", before.status_code, before.json())
print("a completion meanwhile:", refused.status_code, refused.json()["error"]["message"])
print("after: ", after.status_code, "| warm-up finished", f"{ready_s:.2f} s after release")
health = after.json()
print("pool:", {k: health["pool"][k] for k in ("num_blocks", "block_size", "num_slots", "dtype")})
print("warm:", {k: health["warm"][k] for k in ("graphs", "bytes", "max_rows", "max_width", "shapes")})
print("boot line:", [ln for ln in boot_log.getvalue().splitlines() if "listening" in ln][0])
assert before.status_code == 503 and before.json()["status"] == "warming" and refused.status_code == 503
assert health["warm"]["graphs"] == len(warm_shapes(4, 1024, 32, 4, 64)) == 6

# %% [markdown]
# ## 4. A request through the door
#
# The official `openai` client, pointed at the in-process server. Greedy, so the answer is the
# same every run; `/metrics` then counts it (Prometheus text, read back with prometheus_client's
# own parser).

# %%
client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
reply = client.chat.completions.create(
    model=health["model"],
    messages=[{"role": "user", "content": "Name three planets."}],
    max_tokens=32,
    temperature=0,
)
print(repr(reply.choices[0].message.content), reply.choices[0].finish_reason, reply.usage.completion_tokens)
families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
for name in ["nanoserve_requests", "nanoserve_generation_tokens", "nanoserve_kv_blocks_used",
             "nanoserve_warm_graphs", "nanoserve_cold_captures", "nanoserve_eager_decode_steps"]:
    for s in families[name].samples:
        if not s.name.endswith("_created"):
            print(f"{s.name}{s.labels or ''} = {s.value:g}")
server.__exit__(None, None, None)

# %% [markdown]
# ## 5. The benchmark: what the list costs at boot, what it saves a request
#
# `days/day56/boot.py` boots the default model three times: lazily (`warm=False`, which records
# as Day 54 did), with the list cut at width 64, and cut at width 128. Each boot gets one chat
# request of 40 tokens. The deterministic columns say what the warm-up recorded and what that
# holds, then what the request met: graphs recorded while it waited (`cold_captures`) and decode
# steps that ran with no graph (`eager_steps`), each beside the count worked out from the width
# buckets its contexts pass through. Lazily, each new width is recorded once; after a warm
# list, nothing is recorded and each step whose width the list lacks runs eagerly. The tokens
# match across the three boots, so the output cannot tell them apart; `check_no_cold_captures`
# can.

# %%
with contextlib.redirect_stderr(io.StringIO()):
    rows = boot.boot_table(MODEL_DIR)
facts = ["config", "graphs", "warm_mb", "prompt_tokens", "generated", "cold_captures", "predicted_cold",
         "eager_steps", "predicted_eager", "same_tokens"]
for r in rows:
    print("  ".join(f"{k}={r[k]}" for k in facts))
assert all(r["cold_captures"] == r["predicted_cold"] and r["same_tokens"] == "yes" for r in rows)
assert all(r["eager_steps"] == r["predicted_eager"] for r in rows)
with open(REPO / "days" / "day56" / "day-56-boot.csv") as f:  # the journal's table
    committed = list(csv.DictReader(f))
assert [[str(r[k]) for k in facts] for r in rows] == [[r[k] for k in facts] for r in committed]
try:  # the lazily booted engine is yesterday's server: the gate that guards the boot path fails
    check_no_cold_captures(rows[0]["cold_captures"])
except GateError as e:
    print("lazy boot -> GateError:", e)
else:
    raise AssertionError("the gate passed on a lazily booted engine")

# %%
print("the script's run:", committed[0]["cpu"])  # its timing columns, not this kernel's clock
for r in committed:
    print(f"{r['config']:>12}: boot {r['boot_s']} s (warming {r['warm_s']} s), "
          f"first token {r['first_token_ms']} ms, request {r['request_s']} s")

# %% [markdown]
# On this CPU a recorded graph is a `HostGraph`, whose replay repeats the step's work, so a warm
# list saves a request no compute, and the counts above are the thing to read. The script's
# timings (its run on an AVX-512 CPU at 2 threads, printed above from the CSV) differ for the
# request in one place, the first token: 275.7 ms after the lazy boot, 78.0 and 74.8 ms after
# the warmed ones, and the whole request's time differs by about as much. The reason is
# memory, not graphs. A cache allocates a layer's K and V pools when something first writes to
# that layer (`_ensure_pool`). In a warmed boot that happens inside `build_engine`: `Engine.warm_trim` calls
# `cache.ensure_pools()` before it probes free memory, so every pool exists before the first
# graph is recorded, and the warm-up's writes to the sink land in pools that are already there
# (section 1 printed their size). In the lazy boot nothing calls `ensure_pools`, so the first
# request's prefill allocates and zero-fills each layer's pools on its way through the model.
# A cache that nothing has written to holds no pool memory at all:

# %%
bare = BatchedPagedKVCache(engine.model.cfg, num_slots=16, attention="gather")  # the read of day 18
print("pool bytes before any write:", bare.allocated_bytes)
bare.ensure_pools()
print(f"after ensure_pools: {bare.allocated_bytes:,} bytes (17 slots with the sink, 30 layers, K and V)")
assert bare.allocated_bytes == 2 * 30 * 17 * engine.model.cfg.num_kv_heads * engine.model.cfg.head_dim * 4

# %% [markdown]
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9))
fig.suptitle("Day 56 — the warm-up in the boot path (SmolLM2-135M, CPU)", fontsize=14)

ax = axes[0, 0]
starts = dict((p, t) for p, t in phases)
recording = built_s - report.seconds  # the warm list's recording ends as build_engine returns
spans = [
    ("loading", starts["loading"], starts["warming"]),
    ("warming: the trim (pools, free-memory probe)", starts["warming"], recording),
    ("warming: the warm list recorded", recording, built_s),
]
for i, (name, a, b) in enumerate(spans):
    seconds = report.seconds if i == 2 else b - a  # the recording: the figure the cell printed
    color = ["#8da0cb", "#fdd0a2", "#fc8d62"][i]
    ax.barh(0.35, b - a, 0.5, left=a, color=color, label=f"{name} ({seconds:.2f} s)")
ax.axvline(built_s, color="k", ls="--", lw=1)
ax.text(built_s, 0.75, "door opens (/health 200) ", ha="right", va="center", fontsize=9)
ax.set_yticks([])
ax.set_xlabel("seconds since build_engine was called")
ax.set_title("build_engine's phases, as /health reports them")
ax.legend(loc="lower left", fontsize=9)  # under the bar
ax.set_ylim(-0.75, 0.85)

ax = axes[0, 1]
widths = [32, 64, 96, 128, 192, 256, 384, 512]
for mb, style in ((4, "o-"), (16, "s-"), (32, "^-")):
    shapes = [warm_shapes(mb, 8192, 32, mb, w) for w in widths]
    ax.plot(widths, [len(s) for s in shapes], style, label=f"max_batch {mb}: graphs")
ax.set_xlabel("warm_max_width (tokens)")
ax.set_ylabel("graphs in the warm list")
ax.set_title("the trim: rows from max_batch, width from a ceiling")
ax2 = ax.twinx()
ax2.plot(widths, [sum(r * 49152 * 4 for r, _ in warm_shapes(32, 8192, 32, 32, w)) / 1e6 for w in widths],
         "k:", label="max_batch 32: MB held (CPU)")
ax2.set_ylabel("MB held by the graphs' outputs")
lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
ax.legend(lines, [h.get_label() for h in lines], loc="upper left", fontsize=9)

ax = axes[1, 0]
x = range(len(rows))
bars = [
    ("cold_captures", "recorded in front of the request", "tab:red", -0.3),
    ("predicted_cold", "recordings predicted", "#f4a6a6", -0.1),
    ("eager_steps", "decode steps run eagerly", "tab:blue", 0.1),
    ("predicted_eager", "eager steps predicted", "#a6c8f4", 0.3),
]
for col, label, color, dx in bars:
    ax.bar([i + dx for i in x], [r[col] for r in rows], 0.2, label=label, color=color)
    for i, r in enumerate(rows):
        ax.text(i + dx, r[col] + 0.15, str(r[col]), ha="center", fontsize=9)
ax.set_xticks(list(x), [f"{r['config']}\n({r['graphs']} graphs)" for r in rows])
ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
ax.set_ylim(0, 1.35 * max(max(r["eager_steps"], r["cold_captures"]) for r in rows) + 1)
ax.set_ylabel("count")
ax.set_title(f"what one {rows[0]['generated']}-token request met on each boot")
ax.legend(fontsize=9, loc="upper left")

ax = axes[1, 1]
ax.bar([i - 0.2 for i in x], [float(r["boot_s"]) for r in committed], 0.4, label="boot (s)")
first_s = [float(r["first_token_ms"]) / 1000 for r in committed]
ax.bar([i + 0.2 for i in x], first_s, 0.4, label="first token (s)")
ax.set_xticks(list(x), [r["config"] for r in committed])
ax.set_ylabel("seconds (day-56-boot.csv's run)")
ax.set_title("what the boot pays, what the first request pays")
ax.legend()
fig.tight_layout()
path = diagram_path("day56-wiring.png")
fig.savefig(path, dpi=110)
plt.close(fig)
display(Image(filename=str(path)))

# %% [markdown]
# ## 7. Phase 5 in one table
#
# Day 56 closes phase 5 (days 48-56). The phase began by pricing a decode step (days 48 and 49)
# and then built, one day at a time, what a recorded step needs and the boot that records it.
# Each row below is a figure one of the phase's scripts wrote to its CSV: where the engine began
# on that measure, and where the day's piece took it. Nothing here is measured again.

# %%
def day_csv(day: int, name: str) -> list[dict]:
    return read_csv(REPO / "days" / f"day{day}" / name)


launch = day_csv(49, "day-49-launch.csv")[0]  # SmolLM2-135M at batch 1
graphs50 = {r["what_changed"]: r for r in day_csv(50, "day-50-replay.csv")}
window51 = next(r for r in day_csv(51, "day-51-window.csv") if (r["rows"], r["width"]) == ("64", "2048"))
pad52 = next(r for r in day_csv(52, "day-52-padwaste.csv") if r["width_multiple"] == "32")
every52 = next(r for r in day_csv(52, "day-52-padwaste.csv") if r["width_multiple"] == "1")
addr53 = {r["mode"]: r for r in day_csv(53, "day-53-addresses.csv") if r["generated"] == "96"}
cap54 = day_csv(54, "day-54-capturebench.csv")[-1]
warm55 = day_csv(55, "day-55-warmbench.csv")[-1]
boot56 = {r["config"]: r for r in day_csv(56, "day-56-boot.csv")}
serve56 = {r["server"]: r for r in day_csv(56, "day-56-serve.csv")}
warm56 = {r["server"]: r for r in day_csv(56, "day-56-serve-warm.csv")}
phase5 = [
    {"day": "48-49", "built": "the step's price", "measure": "SmolLM2 decode step, batch 1, ms",
     "began": f"{launch['step_ms']} ({launch['py_calls']} ops from Python)",
     "now": f"floor {launch['floor_ms']} (weights read once)", "csv": "day-49-launch.csv"},
    {"day": "50", "built": "the graph's contract", "measure": "replays equal to eager (tiny Llama)",
     "began": graphs50["every tensor new each step"]["replay_equals_eager"],
     "now": graphs50["every tensor copied in"]["replay_equals_eager"], "csv": "day-50-replay.csv"},
    {"day": "51", "built": "slot table", "measure": "new window bytes a step, 64 x 2048",
     "began": window51["gather_new_bytes"], "now": window51["read_new_bytes"], "csv": "day-51-window.csv"},
    {"day": "52", "built": "buckets", "measure": "decode shapes up to 8192 tokens",
     "began": every52["shapes_every"], "now": pad52["shapes_pow2"], "csv": "day-52-padwaste.csv"},
    {"day": "53", "built": "persistent inputs", "measure": "replays right, 96 tokens",
     "began": addr53["bucketed"]["replays_fresh"], "now": addr53["persistent"]["replays_fresh"],
     "csv": "day-53-addresses.csv"},
    {"day": "54", "built": "capture", "measure": f"{cap54['generated']} tokens: graphs, replays",
     "began": f"0, 0 (eager; {cap54['decode_steps']} steps)", "now": f"{cap54['graphs']}, {cap54['replays']}",
     "csv": "day-54-capturebench.csv"},
    {"day": "55", "built": "warm list", "measure": f"{warm55['generated']} tokens: recordings mid-run",
     "began": warm55["cold_lazy"], "now": warm55["cold_warmed"], "csv": "day-55-warmbench.csv"},
    {"day": "56", "built": "warm boot", "measure": "first token of the first request, ms",
     "began": boot56["lazy"]["first_token_ms"], "now": boot56["warm to 128"]["first_token_ms"],
     "csv": "day-56-boot.csv"},
    {"day": "56", "built": "served load", "measure": "output tok/s, 64 requests, fp32 model",
     "began": f"{serve56['eager']['output_tok_s']} (--no-capture)",
     "now": "{output_tok_s} ({warm_graphs} graphs warmed)".format(**serve56["captured+warm"]),
     "csv": "day-56-serve.csv"},
]
show(phase5)

# %% [markdown]
# The last row is `python -m nanoserve.bench serve`: it starts `nanoserve serve` twice, once
# with the default flags (the benchmark calls that server captured+warm) and once with
# `--no-capture`. Both serve the default model's fp32 conversion, because the benchmark passes
# `--weights dtype` unless told otherwise; from Day 60 on, a CPU server otherwise serves the
# GGUF's own int8 blocks, and for those `decode_capture` leaves capture off, which would make
# both servers the same eager one. Asked about the flags the benchmark used, with what each
# server reported on `/health` and what the fresh-server pair of `day-56-serve-warm.csv` met:

# %%
for name, flags in (("captured+warm", []), ("eager", ["--no-capture"])):
    args = build_parser().parse_args(["serve", "--max-batch", "16", "--weights", "dtype", *flags])
    weights, activations = resolve_weights(args)
    capture = decode_capture(args, weights is not None, on_cuda=False)
    print(f"{name:>13}: weights {weights or 'fp32'}, activations {activations}, capture {capture}, "
          f"warm graphs {serve56[name]['warm_graphs']}")
    assert weights is None and capture == (name == "captured+warm")
tok_s = {name: float(r["output_tok_s"]) for name, r in serve56.items()}
print(f"output tok/s {tok_s['captured+warm']} against {tok_s['eager']}: "
      f"{tok_s['captured+warm'] / tok_s['eager']:.2f} to 1, one run of each")
for name, r in warm56.items():
    print(f"{name:>13}: {r['warm_graphs']} graphs warmed, first request TTFT {r['first_ttft_ms']} ms, "
          f"stall {r['stall_ms']} ms, worst gap {r['itl_max_ms']} ms, {r['tokens']} tokens")
print("measured on", serve56["eager"]["cpu"])

# %% [markdown]
# Read down the last two columns. The pieces did what each day set out to do: replays that
# compute the step, a window and inputs that stay put, a closed set of shapes, and recordings
# moved out of the requests' way. In the last row the captured server had 40 graphs recorded
# before it took traffic and delivered 360.3 tok/s against 344.7 for the eager one, 1.05 to 1.
# That is one run of each, back to back on a 2-core AVX-512 EPYC at 2 threads (as the CSV's
# `cpu` column says), and one run cannot separate a difference that small from the noise
# between runs: the two servers are close, and that is all the row shows. It is what this CPU
# leads one to expect. A `HostGraph` replay repeats the step's work (Day 54's replayed and eager
# steps took about the same time), so capture here is plumbing that costs little, and the
# step's price issued once instead of op by op waits for a GPU. The fresh-server pair shows
# section 5's effect through the HTTP door: the warmed server's first token came after
# 106.6 ms, the lazy server's after 203.2 ms, since the lazy boot allocates its K/V pools and
# records its graphs during that first request. Neither stream stalled: no gap was longer than
# twice its median, on either server. The first row says how much there is to win: the gap
# between the step and its floor.
#
# ## In the real systems
#
# * **vLLM** orders its boot the same way and keeps the HTTP side shut until the end, but shuts
#   it differently. In `vllm/entrypoints/openai/api_server.py`, `setup_server` binds the port
#   first (a workaround against a race with Ray, the comment says), then `run_server_worker`
#   builds the engine inside `build_async_engine_client`, and only after that does
#   `build_and_serve` create the FastAPI app and start uvicorn with `serve_http`. While the
#   engine is being built the socket is bound but nothing answers on it, so a probe gets no
#   `/health` at all; ours listens from the start and answers 503 with the phase.
# * Inside the engine, vLLM's `Worker` (`vllm/v1/worker/gpu_worker.py`) sizes the KV cache by
#   profiling (`determine_available_memory` runs `profile_run` and subtracts the peak from
#   `gpu_memory_utilization` of the device), allocates it (`initialize_from_config`), and then
#   runs `compile_or_warm_up_model`, which captures the graphs and afterwards warms the sampler
#   with `_dummy_sampler_run`, placed after capture on purpose so that `torch.cuda.empty_cache`
#   during capture cannot release its buffers. Newer versions also estimate graph memory before
#   the real capture (`GPUModelRunner.profile_cudagraph_memory` captures the first two graphs
#   of each mode into a throwaway pool and extrapolates). Our order plans the pool from a
#   configured budget instead of a profile, allocates it in `warm_trim`, and then turns the
#   memory that is left into a width ceiling for the list.
# * A shape past the list runs eagerly in all three systems, as it now does in ours
#   (`runner.eager_steps`, and `nanoserve_eager_decode_steps` on `/metrics`): vLLM's
#   `CudagraphDispatcher.dispatch` returns `CUDAGraphMode.NONE` for a batch without a key, and
#   nano-vllm's `run_model` takes the eager branch for prefill, `enforce_eager` or more than 512
#   tokens. nano-vllm has no server; its whole warm-up (`warmup_model`, `allocate_kv_cache`,
#   `capture_cudagraph`) runs in `ModelRunner.__init__`, so an `LLM` object that exists is a
#   warm one, which is the promise our `build_engine` now makes.
#
# ## Try it
#
# 1. **Predict the eager steps of a trimmed list.** Build an engine from `config` with
#    `warm_max_width=64` and run section 2's three requests on it. Predict with
#    `boot.predicted(37, 40, 64, 1024)`: the longest prompt is 37 tokens, its contexts run from
#    38 to 76, and the steps past 64 need the missing width 96. The check:
#    `engine.runner.eager_steps` equals the second number (12), `cold_captures` stays 0, and the
#    tokens equal the 96-wide engine's.
# 2. **Break the boot's promise on purpose.** On that engine set `engine.runner.lazy = True`
#    (what a warmed engine no longer does) before the three requests. The checks: the run
#    records `(4, 96)` in front of the requests, `check_no_cold_captures(engine.runner.cold_captures)`
#    raises a `GateError` whose message starts "1 graphs were recorded mid-run", and
#    `check_warm_graphs_unbound(engine.runner.graphs)` names `(4, 96)` as recorded over real
#    rows.
# 3. **Watch the door stay shut on a failed boot.** In section 3's `builder`, raise
#    `RuntimeError("out of memory")` when the phase is `"warming"` instead of waiting. The
#    check: `/health` answers 503 with `{"status": "failed", "error": "RuntimeError: out of
#    memory"}`, `/v1/completions` still answers 503, and no boot line is printed.

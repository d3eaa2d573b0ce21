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
# Day 55 built the warm-up (`nanoserve.warmup`) and left it as a method a caller had to know
# about. A server started from `serve.py` ran the day-47 loop with buckets, persistent inputs
# and capture all off. Today `build_engine` threads the three switches and the warm list
# through, warms after the pool is planned and before it returns, and `create_app` opens the
# door only after that: `/health` says 503 until the warm list is recorded, then 200 with the
# pool plan and the warm plan side by side.
#
# 1. `build_engine` with the switches on: the phases it reports, and the trim it chooses,
# 2. the gates after boot,
# 3. a server booted in-process: `/health` 503 while warming, 200 after, and the boot line,
# 4. a request through the `openai` client and what `/metrics` counted,
# 5. the day's benchmark (`days/day56/boot.py`): boot cost against cold captures, and
#    `check_no_cold_captures` failing on the engine booted lazily,
# 6. the diagram.

# %%
import contextlib
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

from nanoserve.config import EngineConfig
from nanoserve.course import REPO, diagram_path
from nanoserve.engine import build_engine
from nanoserve.errors import GateError
from nanoserve.sampling import SamplingParams
from nanoserve.serve import ServerThread, create_app
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
# returns. The trim is decided in `Engine.warm_trim`, after the KV pool is allocated, because
# that is when the free memory it reads is the memory the graphs will actually get:
#
# * rows: the scheduler's `max_batch` (or `warm_max_rows` if smaller) — a batch never has more;
# * width: the smallest of the context the deployment serves (`max_model_len`), the operator's
#   `warm_max_width`, and `width_ceiling` of the free memory (the widest shape whose attention
#   scores fit).
#
# `on_phase` is how the server learns which stage it is in; here it just records.

# %%
phases = []
config = EngineConfig(
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

# %% [markdown]
# ## 2. The gates after boot
#
# Day 55's gates, now run on what `build_engine` returned: every shape of the list has its
# graph, every graph froze the empty row tuple (it came from a warm plan, not from a step that
# slipped past), the slot table is still where the graphs were recorded against, and no shape
# needs more score memory than the free memory holds. Then three requests run; the longest
# reaches a 96-token context, the top of the list, so the run records nothing in front of them.

# %%
heads = engine.model.cfg.num_heads
check_all_warm(report.shapes, engine.runner.graphs)
check_warm_graphs_unbound(engine.runner.graphs)
address = engine.runner.slot_table.address
check_table_stable(engine.runner.slot_table, address)
check_warm_budget(report.shapes, warm_budget_bytes(engine.model.device), heads)
prompts = [[{"role": "user", "content": q}] for q in ("Hi!", "What is 2+2?", "Name a colour.")]
outs = engine.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
longest = max(len(o.prompt_token_ids) + len(o.token_ids) - 1 for o in outs)
print("longest decode context:", longest, "| graphs now:", len(engine.runner.graphs))
print("cold captures after three requests:", engine.runner.cold_captures)
check_no_cold_captures(engine.runner.cold_captures)
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

    return build_engine(EngineConfig(**{**config.__dict__, "warm_max_width": 64}), on_phase=phase)


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
             "nanoserve_warm_graphs", "nanoserve_cold_captures"]:
    for s in families[name].samples:
        if not s.name.endswith("_created"):
            print(f"{s.name}{s.labels or ''} = {s.value:g}")
server.__exit__(None, None, None)

# %% [markdown]
# ## 5. The benchmark: what the list costs at boot, what it saves a request
#
# `days/day56/boot.py` boots the default model three ways — lazily (`warm=False`, yesterday's
# server), warm to width 64, warm to width 128 — and sends one chat request of 40 tokens to
# each. The deterministic columns: how many graphs the warm-up recorded and what they hold, and
# how many graphs the request still recorded in front of the client, next to the count
# predicted from the width buckets its contexts touch that the list lacks. The tokens are the
# same in all three (a recording is a step); the gate `check_no_cold_captures` is what tells
# the boots apart.

# %%
with contextlib.redirect_stderr(io.StringIO()):
    rows = boot.boot_table(MODEL_DIR)
facts = ["config", "graphs", "warm_mb", "prompt_tokens", "generated", "cold_captures", "predicted_cold",
         "same_tokens"]
for r in rows:
    print("  ".join(f"{k}={r[k]}" for k in facts))
assert all(r["cold_captures"] == r["predicted_cold"] and r["same_tokens"] == "yes" for r in rows)
try:  # the lazily booted engine is yesterday's server: the gate that guards the boot path fails
    check_no_cold_captures(rows[0]["cold_captures"])
except GateError as e:
    print("lazy boot -> GateError:", e)
else:
    raise AssertionError("the gate passed on a lazily booted engine")

# %%
# NBVAL_IGNORE_OUTPUT
for r in rows:
    print(f"{r['config']:>12}: boot {r['boot_s']:.2f} s (warming {r['warm_s']:.2f} s), "
          f"first token {r['first_token_ms']:.0f} ms, request {r['request_s']:.2f} s")

# %% [markdown]
# On this CPU a recorded graph is a `HostGraph`, whose replay does the step's work again, so
# warming saves a request no compute: the cold column is the thing to read. What the lazy boot
# does pay on its first request is the KV pool itself: the pools are allocated on the first
# write of each layer, which in a warmed process is the warm-up's throwaway write to the sink.

# %% [markdown]
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9))
fig.suptitle("Day 56 — the warm-up in the boot path (SmolLM2-135M, CPU)", fontsize=14)

ax = axes[0, 0]
starts = dict((p, t) for p, t in phases)
spans = [("loading", starts["loading"], starts["warming"]), ("warming", starts["warming"], built_s)]
for i, (name, a, b) in enumerate(spans):
    ax.barh(0, b - a, left=a, color=["#8da0cb", "#fc8d62"][i], label=f"{name} ({b - a:.2f} s)")
ax.axvline(built_s, color="k", ls="--", lw=1)
ax.text(built_s, 0.45, " door opens\n (/health 200)", va="center", fontsize=9)
ax.set_yticks([])
ax.set_xlabel("seconds since build_engine was called")
ax.set_title("build_engine's phases, as /health reports them")
ax.legend(loc="lower right")
ax.set_ylim(-0.6, 0.8)

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
ax.bar([i - 0.2 for i in x], [r["cold_captures"] for r in rows], 0.4, label="recorded mid-request")
ax.bar([i + 0.2 for i in x], [r["predicted_cold"] for r in rows], 0.4, label="predicted (widths missing)")
ax.set_xticks(list(x), [f"{r['config']}\n({r['graphs']} graphs)" for r in rows])
for i, r in enumerate(rows):
    ax.text(i - 0.2, r["cold_captures"] + 0.03, str(r["cold_captures"]), ha="center")
    ax.text(i + 0.2, r["predicted_cold"] + 0.03, str(r["predicted_cold"]), ha="center")
ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
ax.set_ylabel("graphs")
ax.set_title(f"cold captures of one {rows[0]['generated']}-token request")
ax.legend()

ax = axes[1, 1]
ax.bar([i - 0.2 for i in x], [r["boot_s"] for r in rows], 0.4, label="boot (s)")
ax.bar([i + 0.2 for i in x], [r["first_token_ms"] / 1000 for r in rows], 0.4, label="first token (s)")
ax.set_xticks(list(x), [r["config"] for r in rows])
ax.set_ylabel("seconds (this run)")
ax.set_title("what the boot pays, what the first request pays")
ax.legend()
fig.tight_layout()
path = diagram_path("day56-wiring.png")
fig.savefig(path, dpi=110)
plt.close(fig)
display(Image(filename=str(path)))

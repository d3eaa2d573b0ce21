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
# # Day 46 — Soak: nothing lost
#
# Each serving day so far tested one fault at a time: one bad body, one client that hangs up,
# one loop that dies. A server in use meets them all at once, and what goes wrong there is
# rarely a crash. It is a count that drifts: a request nobody answered, a KV block that an
# aborted request never gave back, a healthy stream whose tokens changed because a neighbour
# left in the middle of a step. A leaked block costs nothing the first time, and a server
# that leaks one per disconnect runs out of pool after a few thousand of them, long after
# the change that caused it.
#
# So today is a soak with books. Many clients run at once against one in-process server:
# healthy ones, ones that read a few events of a long stream and hang up, and ones that send a
# bad body. Afterwards every request must be accounted for on both sides (the clients' own
# tally against the server's `/metrics`), every block must be back (`/health` and the
# allocator's `check_invariants`), and the healthy clients' tokens must equal a clean run.
#
# 1. one client of each kind, by hand, with the blocks watched through `/health`,
# 2. a ledger and a block count of my own, against `/metrics` and `check_invariants`,
# 3. the soak: 24 clients at once, tabulated, with the books checked,
# 4. a planted leak (aborts that forget their blocks), caught by the same check,
# 5. the day's script (`days/day46/soak.py`, 96 clients in two rounds), read back,
# 6. the diagram.
#
# The engine is the one of day 46 (`engine_config(46, ...)` in `soak.make_engine`): the
# prefill-first schedule, the gather read of the KV pool, the model's own linears, torch ops a
# step, behind the engine loop `create_app` has started since day 35 (tomorrow takes that loop
# apart); today only the books at the end matter.

# %%
import csv
import sys
from collections import Counter

import httpx
import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, ServerThread, diagram_path, tiny_llama
from nanoserve.bench import cpu_line
from nanoserve.serve import create_app

sys.path.insert(0, str(REPO / "days" / "day46"))
import soak  # the day's script: the notebook runs its soak and reads its CSVs

torch.set_num_threads(1)
print(cpu_line())

# %% [markdown]
# ## 1. One client of each kind, by hand
#
# The engine is the course's tiny random-weight Llama (2 layers, vocabulary 256) with no
# tokenizer, so prompts are token ids; 4 rows, a 256-token context and a pool of 64 blocks of
# 16 tokens. `ServerThread` is uvicorn on a free loopback port. The hang-up client asks for 200
# tokens, reads three events and closes the connection; while it reads, its blocks are held,
# and once it is gone `/health` must say 0 again. The tiny model can write all 200 tokens before
# a busy machine's client has read three, so for this cell each step waits 5 ms first.

# %%
import time

engine = soak.make_engine(tiny_llama(0))
blocks = engine.allocator.num_blocks
plain_step = engine.step
engine.step = lambda: (time.sleep(0.005), plain_step())[1]  # the hang-up lands mid-answer
print("pool:", blocks, "blocks of", engine.allocator.block_size, "tokens | rows:", engine.config.max_batch)
with ServerThread(create_app(engine)) as url, httpx.Client(timeout=60) as http:
    print("idle:", {k: http.get(url + "/health").json()[k] for k in ("running", "waiting", "kv_blocks_used")})
    ok = http.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True})  # fmt: skip
    choice = ok.json()["choices"][0]
    print("healthy:", ok.status_code, choice["finish_reason"], choice["token_ids"])
    bad = http.post(url + "/v1/completions", json={"prompt": [5, 999], "max_tokens": 4})
    print("bad:", bad.status_code, bad.json()["error"]["message"])
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: {")
            if events == 3:
                held = http.get(url + "/health").json()
                break
    print(f"hang-up after {events} events: while reading, {held['running']} running, blocks held > 0:",
          held["kv_blocks_used"] > 0)  # fmt: skip
    after = soak.wait_idle(url)
    print("after it left:", {k: after[k] for k in ("running", "waiting", "kv_blocks_used")})
    ended = soak.ended_by_reason(url)
print("the server's count of ended requests, by finish reason:", dict(sorted(ended.items())))
assert ok.status_code == 200 and bad.status_code == 400 and held["kv_blocks_used"] > 0
assert after["kv_blocks_used"] == 0 and ended == {"length": 1, "abort": 1}
engine.step = plain_step

# %% [markdown]
# The bad body never reached the engine: it is in no count of ended requests, because it never
# started. That is the ledger's first rule: a request is *finished* (the server counts it under
# its finish reason, here `length`), *aborted* (counted under `abort`), or *refused* with a 4xx
# before the engine saw it (counted by nobody on the server's side but the client).
#
# ## 2. My own ledger and block count, against the package's
#
# The books in a few lines: tally the clients' outcomes; expect the server's `length` count to
# equal the finished ones and its `abort` count the aborted ones; count the blocks whose
# reference count is not zero. The package's side is `/metrics` and
# `BlockAllocator.check_invariants(tables)`, which with no live tables demands that every block
# be free, on the free list, and counted once. They must agree with each other on the engine
# from section 1.

# %%
def my_books(outcomes: list[str], ended: dict, allocator) -> dict:
    seen = Counter(outcomes)
    held = sum(allocator.ref_count(b) > 0 for b in range(allocator.num_blocks))
    return {"finished": (seen["finished"], ended.get("length", 0)),
            "aborted": (seen["aborted"], ended.get("abort", 0)),
            "refused": seen["refused"], "blocks held": held}  # fmt: skip


books = my_books(["finished", "refused", "aborted"], ended, engine.allocator)
print("mine (client, server):", books)
engine.allocator.check_invariants([])  # the package's check: raises if any block is unaccounted for
print("check_invariants([]) passes; num_free", engine.allocator.num_free, "of", blocks)
assert books["finished"] == (1, 1) and books["aborted"] == (1, 1) and books["blocks held"] == 0
assert engine.allocator.num_free == blocks

# %% [markdown]
# ## 3. The soak
#
# `soak.soak(24)` starts 24 client threads at once on a fresh server, over one shared httpx
# connection pool: 12 healthy (6 streaming, 6 not, 24 greedy tokens each), 6 that hang up after
# 3 events of a 200-token stream, and 6 bad bodies, one of each kind in `soak.BAD`. With 4 rows,
# most requests wait in the queue behind others, and the hang-ups leave while their
# neighbours are mid-decode. A watcher thread reads `/health` every 50 ms for the diagram.
# `check_nothing_lost` then checks the books: clients against `/metrics`, `/health` idle with
# 0 blocks, and `check_invariants([])`. Last, each healthy client's tokens are compared with a
# clean run: the healthy prompts on a fresh engine with no server, no hang-ups and no bad
# bodies, in one `generate` call (the leaky soak below reuses it).

# %%
clean_trace: list = []
run = soak.soak(24, trace=clean_trace)
for r in soak.summary_rows(run):
    print({k: v for k, v in r.items() if k != "p50_s"})
print("server ended:", dict(sorted(run["ended"].items())), "| /health after:",
      {k: run["health"][k] for k in ("running", "waiting", "kv_blocks_used")})  # fmt: skip
print("check:", run["verdict"], "| healthy clients equal to the clean run:", run["same"], "of 12")
soak.check_nothing_lost(run["results"], run["ended"], run["health"], run["engine"])
assert run["verdict"] == "nothing lost" and run["same"] == 12
assert max(b for _, b in clean_trace) > 0 and clean_trace[-1][1] == 0

# %%
# NBVAL_IGNORE_OUTPUT
print(f"soak wall time {run['wall_s']:.2f} s; peak blocks in use seen by the watcher:",
      max(b for _, b in clean_trace), "of", run["num_blocks"])  # fmt: skip

# %% [markdown]
# ## 4. A planted leak
#
# The wrong version: a scheduler whose `finish(seq, "abort")` takes the request off the running
# list and tells the runner it left, but never calls `allocator.free(seq.block_table)`. Nothing
# a client sees changes: the hang-ups still get their three events, the healthy clients still
# get their tokens, `/metrics` still counts every abort. Only the books show it, and the check
# must fail. How many blocks leak depends on how far each aborted request had decoded when
# its abort arrived, so the message's count is masked here; that some leaked is not.

# %%
leak_trace: list = []
leaky = soak.soak(24, leak=True, idle_timeout=0.3, trace=leak_trace, ref=run["ref"])
print("what the clients saw:", dict(sorted(Counter(r["outcome"] for r in leaky["results"]).items())),
      "| healthy equal to the clean run:", leaky["same"], "of 12")  # fmt: skip
print("server ended:", dict(sorted(leaky["ended"].items())))
try:
    soak.check_nothing_lost(leaky["results"], leaky["ended"], leaky["health"], leaky["engine"])
except AssertionError as e:
    used = leaky["health"]["kv_blocks_used"]
    print("caught:", type(e).__name__ + ":", str(e).replace(f"{used} KV", "N KV"))
    print("blocks leaked at least one per hang-up:", used >= 6)
else:
    raise AssertionError("the check passed on a server that leaks")
try:
    leaky["engine"].allocator.check_invariants([])
except AssertionError as e:
    print("check_invariants alone also fails:", str(e).split(" has ")[1])
assert leaky["same"] == 12 and leaky["ended"] == run["ended"]

# %% [markdown]
# The leak passes everything a client can observe, including `/metrics`' request counts; it is
# visible only to the block count. That is why the soak's check ends with `/health` and the
# allocator rather than with the responses.
#
# ## 5. The day's script
#
# `python days/day46/soak.py` runs the same soak with 96 clients (two rounds of the 48-client
# mix, drawn with seeds 0 and 1, all 96 started at once on one server), then again with the
# planted leak, and writes `day-46-soak.csv` (the clean run, by kind),
# `day-46-ledger.csv` (both runs' books) and `day-46-clients.csv` (one row per client). The
# clean table is four times the notebook's in every row: the client mix is the same rule.

# %%
with open(REPO / "days" / "day46" / "day-46-soak.csv") as f:
    table = list(csv.DictReader(f))
with open(REPO / "days" / "day46" / "day-46-ledger.csv") as f:
    ledger = list(csv.DictReader(f))
for r in table:
    print({k: v for k, v in r.items() if k not in ("p50_s", "cpu")})
facts = ["run", "clients", "finished", "aborted", "refused", "server_length", "server_abort", "blocks_leaked",
         "healthy_equal_clean", "check"]  # fmt: skip
for r in ledger:
    print("  ".join(f"{k}={r[k]}" for k in facts))
mine = {(r["kind"], r["what"]): r["requests"] for r in soak.summary_rows(run)}
assert all(int(r["requests"]) == 4 * mine[(r["kind"], r["what"])] for r in table)
assert ledger[0]["check"] == "nothing lost" and ledger[1]["check"] == "caught"
assert all(r["finished"] == r["server_length"] and r["aborted"] == r["server_abort"] for r in ledger)

# %%
# NBVAL_IGNORE_OUTPUT
for r in table:
    print(f"{r['kind']:>15} {r['what']:>28}: median {float(r['p50_s']) * 1000:.0f} ms from send to answer")
print("wall:", *(f"{r['run']} {float(r['wall_s']):.2f} s" for r in ledger))

# %% [markdown]
# ## 6. The diagram

# %%
fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
fig.suptitle("Day 46 — a soak in which nothing is lost (tiny Llama, loopback, CPU)", fontsize=13)

ax = axes[0]
outcomes = ["finished", "aborted", "refused"]
client_side = [int(ledger[0][o]) for o in outcomes]
server_side = [int(ledger[0]["server_length"]), int(ledger[0]["server_abort"]), 0]
ax.bar([i - 0.2 for i in range(3)], client_side, 0.4, label="clients' tally", color="#66c2a5")
ax.bar([i + 0.2 for i in range(3)], server_side, 0.4, label="server's /metrics count", color="#8da0cb")
for i, (a, b) in enumerate(zip(client_side, server_side)):
    ax.text(i - 0.2, a + 0.5, str(a), ha="center", fontsize=9)
    ax.text(i + 0.2, b + 0.5, str(b), ha="center", fontsize=9)
ax.set_xticks(range(3), ["finished\n(length)", "aborted\n(hang-up)", "refused\n(400, never started)"])
ax.set_ylabel("requests")
ax.set_title(f"the books of the script's {ledger[0]['clients']} clients")
ax.legend()

ax = axes[1]
for trace, label, style in ((clean_trace, "clean", "-"), (leak_trace, "planted leak", "--")):
    ax.step([t for t, _ in trace], [b for _, b in trace], style, where="post", label=label)
ax.axhline(0, color="k", lw=0.5)
ax.set_xlabel("seconds since the soak started (this run)")
ax.set_ylabel("KV blocks in use (/health)")
ax.set_title("the notebook's 24-client soak: the blocks come back, or not")
ax.legend()

ax = axes[2]
kinds = ["healthy", "healthy-stream", "hang-up", "bad"]
with open(REPO / "days" / "day46" / "day-46-clients.csv") as f:
    per_client = list(csv.DictReader(f))
ax.boxplot([[float(r["seconds"]) for r in per_client if r["kind"] == k] for k in kinds], tick_labels=kinds)
ax.set_ylabel("seconds from send to answer (this run)")
ax.set_title("per client, the script's clean soak")
fig.tight_layout()
path = diagram_path("day46-soak.png")
fig.savefig(path, dpi=110)
plt.close(fig)
display(Image(filename=str(path)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM**'s OpenAI server (`vllm/entrypoints/openai/api_server.py` with
#   `serving_completion.py` and `serving_chat.py`) turns a client that leaves into an abort:
#   the streaming generator is cancelled, and the handler calls the engine client's `abort`
#   for the request id, which `AsyncLLM` forwards to `EngineCore` in its own process, where
#   the scheduler frees the request's KV blocks. vLLM's test suite has a case of exactly this
#   shape (a completion stream cancelled mid-way must call `abort`). Its `/metrics` keeps the
#   books a soak reads: `vllm:request_success_total` labelled by `finished_reason`,
#   `vllm:num_requests_running` and `vllm:num_requests_waiting`, and a KV-cache usage gauge
#   (`vllm:gpu_cache_usage_perc` in older releases), which should return to 0 when idle.
# * **SGLang**'s `TokenizerManager` keeps the state of every request it sent (`rid_to_state`);
#   when the client disconnects it sends an `AbortReq` over ZeroMQ to the scheduler process,
#   which drops the request and releases its KV memory.
# * **TGI**'s router refuses work past `max_concurrent_requests` with 429 and "Model is
#   overloaded", so in its soak tests a refusal is a third outcome beside finished and
#   cancelled, as the 400s are here.
# * **llama.cpp**'s `llama-server` keeps a fixed number of slots; `/slots` shows what each is
#   doing, `/health` reports the server's state, and `/metrics` (when enabled) has
#   `llamacpp:requests_processing` and `llamacpp:kv_cache_tokens`, the numbers a soak would
#   watch return to zero.
#
# ## Try it
#
# 1. **A leak in the other direction.** Plant a scheduler that frees an aborted request's
#    blocks twice (call `sched.allocator.free(seq.block_table)` again after the real
#    `finish`). Predict which check catches it first: the allocator's own `free` or
#    `check_invariants`. The check: the soak's verdict starts with "caught", or the loop
#    reports a failed step.
# 2. **Refusals the engine does see.** Run `soak.soak(24)` on an app made with
#    `create_app(engine, max_waiting=2)` (edit `soak.soak` to pass it through). Some requests
#    now get 429 from the loop; add "429" as an outcome to `check_nothing_lost` so the books
#    still balance. The check: finished + aborted + refused still equals the client count,
#    and the blocks still come back.
# 3. **Hang up before the first token.** Make the hang-up clients close after 0 events (right
#    after the headers). The check: `/metrics` still counts one `abort` per hang-up and
#    `/health` returns to 0 blocks; compare how many blocks the planted leak loses now.

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
# # Day 47 — The loop: the engine steps on its own thread, the server only talks
#
# Since Day 35 the server has had an engine loop, and every day since has leaned on it without
# looking at it. Today is its day. The engine is not thread-safe: `add_request`, `step` and
# `abort` change the scheduler's queues, the block tables and the KV pool, and two threads doing
# that at once would corrupt all three. So one thread owns the engine. Handlers never touch it;
# they put a message in the loop's inbox and read what comes back on a queue of their own.
#
# The harder half is what happens when the loop goes wrong. A loop that dies quietly is worse
# than one that crashes the process: `/health` keeps saying 200, the port keeps accepting, and
# every handler waits forever for tokens that will never come. `nanoserve.loop.EngineLoop`
# contains a fault at three levels (one row, one step, the loop itself), and at the last level
# it ends everything in flight, tells the server, and refuses new work.
#
# 1. a loop by hand in a few lines, and the package's `EngineLoop`, giving the same tokens as
#    the engine alone,
# 2. behind a server: only the loop thread ever steps the engine,
# 3. planted faults: a step that raises, a step that raises fatally, a hand-off that raises,
#    and what every request, `/health` and the next request get (`days/day47/loopfaults.py`),
# 4. the hand-made loop under the same fatal fault: a check that nobody waits catches it,
# 5. the diagram.
#
# The engine is the one of day 47 (`engine_config(47, ...)` in `loopfaults.make_engine`): the
# prefill-first schedule, the gather read of the KV pool, the model's own linears, torch ops a
# step.

# %%
import contextlib
import csv
import io
import queue
import sys
import threading
import time

import httpx
import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, ServerThread, diagram_path, read_csv, tiny_llama
from nanoserve.bench import cpu_line
from nanoserve.engine import RequestOutput
from nanoserve.loop import Accepted, EngineLoop, Refused
from nanoserve.sampling import SamplingParams
from nanoserve.serve import LIVENESS_POLL, create_app

sys.path.insert(0, str(REPO / "days" / "day47"))
import loopfaults  # the day's script: its engine, its prompts, its faults

torch.set_num_threads(1)
print(cpu_line())
PROMPTS, N = loopfaults.PROMPTS, 12
greedy = SamplingParams(max_tokens=N, ignore_eos=True)
alone = loopfaults.make_engine(tiny_llama(0))
reference = [c.token_ids for c in alone.generate(PROMPTS, greedy, use_tqdm=False)]
print("the engine alone:", reference)

# %% [markdown]
# ## 1. A loop by hand
#
# The whole idea in a few lines: a thread that drains an inbox of requests into the engine,
# steps while there is work, and hands each output to the sink its request came with. A sink
# is any thread-safe callable; here it is a `queue.Queue`'s `put`, so the caller reads its
# outputs with `get`.

# %%
def hand_loop(engine, inbox: queue.SimpleQueue, stop: threading.Event):
    sinks = {}
    while not stop.is_set():
        with contextlib.suppress(queue.Empty):
            while True:
                rid, prompt, params, sink = inbox.get(timeout=0.01 if not engine.has_unfinished() else 0)
                engine.add_request(prompt, params, request_id=rid)
                sinks[rid] = sink
        if engine.has_unfinished():
            for out in engine.step():
                sinks[out.request_id](out)


def collect(q: queue.Queue, timeout=10.0) -> list:
    """Every item a request's queue gets, up to its last output (or a refusal)."""
    items = []
    while not items or not (isinstance(items[-1], Refused) or getattr(items[-1], "finished", False)):
        items.append(q.get(timeout=timeout))
    return items


engine = loopfaults.make_engine(tiny_llama(0))
inbox, stop = queue.SimpleQueue(), threading.Event()
threading.Thread(target=hand_loop, args=(engine, inbox, stop), name="hand-loop", daemon=True).start()
queues = [queue.Queue() for _ in PROMPTS]
for i, (p, q) in enumerate(zip(PROMPTS, queues)):
    inbox.put((f"r{i}", p, greedy, q.put))
by_hand = [[t for o in collect(q) for t in o.new_token_ids] for q in queues]
stop.set()
print("the hand loop:   ", by_hand)
assert by_hand == reference

# %% [markdown]
# `EngineLoop` is the same loop with the rest of what a server needs: its first item to a
# request is `Accepted` (the engine took it) or a `Refused` with a status (a full queue is 429,
# a bad request 400), it counts tokens for `/metrics`, it takes `abort` and `cut` messages in the
# same inbox, and it contains faults (section 3). Given the same requests, it gives the same
# tokens.

# %%
engine = loopfaults.make_engine(tiny_llama(0))
loop = EngineLoop(engine)
loop.start()
queues = [queue.Queue() for _ in PROMPTS]
for i, (p, q) in enumerate(zip(PROMPTS, queues)):
    loop.submit(f"r{i}", p, greedy, q.put)
items = [collect(q) for q in queues]
print("first request's queue:", [type(x).__name__ for x in items[0]][:4], "...",
      f"{len(items[0])} items, last finish_reason {items[0][-1].finish_reason!r}")  # fmt: skip
package = [[t for o in its if isinstance(o, RequestOutput) for t in o.new_token_ids] for its in items]
print("EngineLoop:      ", package)
assert package == reference and all(isinstance(its[0], Accepted) for its in items)
print("steps run by the loop:", loop.steps, "| in flight now:", loop.in_flight, "| alive:", loop.alive)
loop.stop()

# %% [markdown]
# ## 2. Behind a server, only the loop steps
#
# `create_app(engine)` starts an `EngineLoop` in its lifespan, and a handler's whole contact with
# it is `loop.submit(...)` with a sink that puts each item on the handler's asyncio queue
# (`call_soon_threadsafe`, because the sink is called from the loop's thread), plus
# `loop.abort(...)` when a client leaves. To see it, the engine's `step` is wrapped to record
# the name of the thread that calls it, and three completions are sent at once from three
# client threads through uvicorn's worker threads.

# %%
engine = loopfaults.make_engine(tiny_llama(0))
callers = set()
real_step = engine.step
engine.step = lambda: (callers.add(threading.current_thread().name), real_step())[1]
with ServerThread(create_app(engine)) as url:
    def complete(p):
        body = {"prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        return httpx.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["token_ids"]

    results = [None] * len(PROMPTS)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, complete(PROMPTS[i])))
               for i in range(len(PROMPTS))]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
print("over HTTP:       ", results)
print("threads that called engine.step:", sorted(callers))
assert results == reference and callers == {"nanoserve-engine"}

# %% [markdown]
# ## 3. Planted faults
#
# `days/day47/loopfaults.py` boots a fresh server per scenario, sends the same three greedy
# completions of 60 tokens at once, and plants its fault on the first step at which all three
# are decoding:
#
# * **step raises**: `engine.step` raises a `RuntimeError`, a bug rather than a bad request.
#   The loop catches `Exception` around the step, ends the requests in flight with a 500, and
#   goes on; the next request is served.
# * **step raises fatally**: `engine.step` raises a `BaseException` that is not an `Exception`
#   (as a `KeyboardInterrupt` or `SystemExit` is). Nothing in the turn catches it, so it escapes
#   the loop. Its outer `try` marks the loop dead with the reason, ends every request in flight
#   and every one still in its inbox, and calls `on_death`, which turns `/health` to 503
#   "failed".
# * **hand-off raises**: the step succeeds, but the loop's own code after it (the metrics it
#   updates for each output) raises. That is outside the step's `try`, so it kills the loop as
#   well, with the same outcome.
#
# Each row: the three requests' statuses and the error they got, which threads stepped the
# engine, `/health` afterwards, a new request's status, and the blocks still held. Run here,
# the deterministic columns must equal the committed table.

# %%
with contextlib.redirect_stderr(io.StringIO()) as log:
    rows = loopfaults.fault_table()
facts = ["fault", "statuses", "error", "stepped_by", "health_after", "health_error", "new_request",
         "blocks_used_after"]  # fmt: skip
for r in rows:
    print(f"{r['fault']:>20}: {r['statuses']} | {r['error'] or '-'}")
    print(f"{'':>20}  /health {r['health_after']} | new request {r['new_request']} | "
          f"blocks held {r['blocks_used_after']} | stepped by {r['stepped_by']}")  # fmt: skip
with open(loopfaults.CSV) as f:
    committed = list(csv.DictReader(f))
assert [[str(r[k]) for k in facts] for r in rows] == [[r[k] for k in facts] for r in committed]
tracebacks = [ln for ln in log.getvalue().splitlines() if ln.startswith(("RuntimeError", "loopfaults"))]
print("last lines of the tracebacks the loop printed to stderr:", tracebacks)

# %%
# NBVAL_IGNORE_OUTPUT
for r in rows:
    print(f"{r['fault']:>20}: the slowest of the three answered after {r['longest_wait_s']:.2f} s")

# %% [markdown]
# Nobody waited: in every scenario each request came back with a status and a sentence, and
# the slowest answer above is the time the request had been decoding. The handler also guards
# against a loop that dies without telling anyone: it waits on its queue at most
# `LIVENESS_POLL` seconds at a time and, between waits, asks `loop.alive`. A dead loop looks
# like this from the server's side:

# %%
engine = loopfaults.make_engine(tiny_llama(0))
app = create_app(engine)
real_step, fired = engine.step, []


def fatal_step():
    if engine.scheduler.running and not fired:
        fired.append(1)
        raise loopfaults.PlantedFatal("planted fatal fault in step")
    return real_step()


engine.step = fatal_step
with contextlib.redirect_stderr(io.StringIO()), ServerThread(app) as url:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8}, timeout=30)
    waited = time.perf_counter() - t0
    h = httpx.get(url + "/health", timeout=5)
    again = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8}, timeout=30)
    state = app.state.nanoserve
print("the request:", r.status_code, r.json()["error"])
print("/health:", h.status_code, h.json())
print("the next request:", again.status_code, again.json()["error"]["message"])
print("server phase:", state.phase, "| loop alive:", state.loop.alive, "| failure:", state.loop.failure)
print(f"liveness poll: {LIVENESS_POLL} s")
assert r.status_code == 500 and h.status_code == 503 and again.status_code == 503 and not state.loop.alive

# %%
# NBVAL_IGNORE_OUTPUT
print(f"the request answered after {waited * 1000:.1f} ms")

# %% [markdown]
# ## 4. The hand loop under the same fault
#
# The hand loop of section 1 has none of this. The check below is the property the table just
# showed: within a deadline, every request submitted has an answer (its last output or a
# refusal). `EngineLoop` passes it under the fatal fault; the hand loop, whose thread dies
# with the exception and takes its sinks with it, leaves all three waiting, and the check
# catches it.


# %%
def check_nobody_waits(queues, deadline_s=1.0):
    end, waiting = time.monotonic() + deadline_s, 0
    for q in queues:
        try:
            collect(q, timeout=max(end - time.monotonic(), 0.001))
        except queue.Empty:
            waiting += 1
    if waiting:
        raise AssertionError(f"{waiting} of {len(queues)} requests still waiting after {deadline_s:g} s")


def fatal_engine():
    eng = loopfaults.make_engine(tiny_llama(0))
    real, fired = eng.step, []

    def step():
        if len(eng.scheduler.running) == len(PROMPTS) and not fired:
            fired.append(1)
            raise loopfaults.PlantedFatal("planted fatal fault in step")
        return real()

    eng.step = step
    return eng


with contextlib.redirect_stderr(io.StringIO()):
    loop = EngineLoop(fatal_engine())
    queues = [queue.Queue() for _ in PROMPTS]
    for i, (p, q) in enumerate(zip(PROMPTS, queues)):
        loop.submit(f"r{i}", p, greedy, q.put)
    loop.start()  # after the three are in the inbox: the first step sees all of them
    check_nobody_waits(queues)
    print("EngineLoop: every request answered; loop alive:", loop.alive, "|", loop.failure)

    inbox, stop = queue.SimpleQueue(), threading.Event()
    queues = [queue.Queue() for _ in PROMPTS]
    for i, (p, q) in enumerate(zip(PROMPTS, queues)):
        inbox.put((f"r{i}", p, greedy, q.put))
    hand = threading.Thread(target=hand_loop, args=(fatal_engine(), inbox, stop), daemon=True)
    hand.start()
    try:
        check_nobody_waits(queues)
    except AssertionError as e:
        print("hand loop -> AssertionError:", e, "| its thread alive:", hand.is_alive())
    else:
        raise AssertionError("the check passed a loop that left its requests waiting")

# %% [markdown]
# ## 5. The diagram

# %%
fig, axes = plt.subplots(1, 2, figsize=(14, 4.8), gridspec_kw={"width_ratios": [1.2, 1]})
fig.suptitle("Day 47 — the engine loop under planted faults (tiny Llama, loopback, CPU)", fontsize=13)
ax = axes[0]
ax.set_xlim(0, 10)
ax.set_ylim(0, 6)
ax.axis("off")
for x, y, w, text in [(0.2, 4.2, 2.2, "handlers\n(event loop)"), (3.9, 4.2, 2.2, "inbox\nadd / abort / cut"),
                      (7.6, 4.2, 2.2, "engine loop\nthread"), (7.6, 1.2, 2.2, "Engine\nstep()"),
                      (0.2, 1.2, 2.2, "per-request\nqueues")]:  # fmt: skip
    ax.add_patch(plt.Rectangle((x, y), w, 1.2, fc="#e8eef8", ec="k"))
    ax.text(x + w / 2, y + 0.6, text, ha="center", va="center", fontsize=9)
ax.annotate("", (3.9, 4.8), (2.4, 4.8), arrowprops={"arrowstyle": "->"})
ax.annotate("", (7.6, 4.8), (6.1, 4.8), arrowprops={"arrowstyle": "->"})
ax.annotate("", (8.7, 2.4), (8.7, 4.2), arrowprops={"arrowstyle": "<->"})
ax.annotate("", (2.4, 1.8), (7.6, 4.4), arrowprops={"arrowstyle": "->"})
ax.annotate("", (1.3, 4.2), (1.3, 2.4), arrowprops={"arrowstyle": "->"})
ax.text(5.0, 2.6, "sinks: Accepted, outputs,\nRefused(500/503) on a fault", ha="center", fontsize=8)
ax.text(5.0, 0.4, "only the loop thread calls the engine", ha="center", fontsize=9, style="italic")
ax.set_title("who talks to whom")

ax = axes[1]
colors = {200: "tab:green", 500: "tab:red", 503: "tab:orange"}
for i, r in enumerate(rows):
    codes = [int(s) for s in r["statuses"].split()] + [int(r["new_request"])]
    for j, c in enumerate(codes):
        ax.barh(i, 1, left=j, color=colors[c], ec="k")
        ax.text(j + 0.5, i, str(c), ha="center", va="center", fontsize=9)
    ax.text(4.1, i, f"/health {r['health_after']}", va="center", fontsize=9)
ax.set_yticks(range(len(rows)), [r["fault"] for r in rows])
ax.set_xticks([0.5, 1.5, 2.5, 3.5], ["req 1", "req 2", "req 3", "next"])
ax.set_xlim(0, 6)
ax.invert_yaxis()
ax.set_title("what each request got, per planted fault")
path = diagram_path("day47-loop.png")
fig.savefig(path, dpi=80, bbox_inches="tight")
plt.close(fig)
display(Image(str(path)))

# %% [markdown]
# ## 6. Phase 4, from its first day to its last
#
# Phase 4 (days 34-47) put the engine behind a server a real client can use: the engine's API
# (day 34), an HTTP server (35), OpenAI's completions and chat (36-37), streaming (38),
# disconnects (39), bad input (40), `/health` and `/metrics` (41-42), a load generator (43),
# backpressure (44), the boot (45), a soak (46) and today's loop. The committed CSVs, first to
# last:

# %%
days_dir = REPO / "days"
api = {r["way"]: r for r in read_csv(days_dir / "day34" / "day-34-engine.csv")}
print(
    f"day 34: 32 requests in-process, one at a time {api['greedy_tokens']['tok_s']} tok/s, "
    f"through the engine's batch {api['engine.generate']['tok_s']} tok/s (tiny model)"
)
load = read_csv(days_dir / "day43" / "day-43-load.csv")
best = max(load, key=lambda r: float(r["output_tok_s"]))
print(
    f"day 43: over HTTP, {best['concurrency']} streaming clients, {best['server']}: "
    f"{best['output_tok_s']} output tok/s, TTFT p50 {best['ttft_p50_ms']} ms, incomplete {best['incomplete']}"
)
over = read_csv(days_dir / "day44" / "day-44-overload.csv")
for r in over:
    print(
        f"day 44: 256 req/s into 2 rows, queue limit {r['max_waiting']}: {r['status_200']} served, "
        f"{r['status_429']} refused, TTFT p50 {r['ttft_p50_ms']} ms"
    )
ledger = {r["run"]: r for r in read_csv(days_dir / "day46" / "day-46-ledger.csv")}
clean = ledger["clean"]
print(
    f"day 46: soak of {clean['clients']} clients: {clean['finished']} finished, {clean['aborted']} "
    f"aborted, {clean['refused']} refused, {clean['check']}; "
    f"the planted leak: {ledger['planted leak']['check']}"
)
faults = [r for r in read_csv(days_dir / "day47" / "day-47-faults.csv") if r["fault"] != "none"]
after = [r["blocks_used_after"] for r in faults]
print(f"day 47: {len(faults)} planted faults, KV blocks in use after each: {after}")
assert clean["check"] == "nothing lost" and all(r["blocks_used_after"] == "0" for r in faults)

# %% [markdown]
# Every request the server takes now finishes or is reported ended, every block comes back, and
# a fault ends only what it touched. The step itself is untouched since phase 3: a decode step
# of the default model is still hundreds of small operations called from Python. Phase 5 begins
# tomorrow by profiling one.

# %% [markdown]
# ## In the real systems
#
# * **vLLM** goes further than a thread: `AsyncLLM` in the API server process talks to
#   `EngineCore`, which runs its busy loop in a separate process, over ZeroMQ sockets. A
#   background task in the server process reads the engine's outputs and puts each on its
#   request's own queue, much as our sinks do. When the engine core process dies, the client
#   raises `EngineDeadError` ("Unrecoverable", in its docstring) to every request waiting and
#   from its health check, so `/health` stops answering 200.
# * **SGLang**: the `TokenizerManager` in the server process sends tokenized requests to the
#   scheduler process and receives results back through the detokenizer, again over ZeroMQ; each
#   request waits on its own event in the tokenizer manager.
# * **TGI**: the Rust router keeps a queue and a batching task that alone talks to the model
#   shards over gRPC; each request waits on its own channel, and `max_concurrent_requests` bounds
#   how many may be waiting (past it the router answers 429).
# * **llama.cpp**: `llama-server` runs one main loop that owns the model and its slots; HTTP
#   threads post tasks to a `server_queue` and wait for their own results from
#   `server_response`, by task id.
# * The shape is the same everywhere: one owner of the engine, messages in, per-request results
#   out. The choice between a thread and a process is about the GIL and about isolation: a
#   separate process can crash without taking the HTTP side with it, which is what our
#   `on_death` imitates inside one process.
#
# ## Try it
#
# 1. **Catch too little, on purpose.** In `EngineLoop._turn`, change `except Exception` to
#    `except RuntimeError`, and make `loopfaults.plant` raise `ValueError("planted fault in
#    step")` where it raises the `RuntimeError`; restart the kernel and run up to section 3.
#    The check: the "step raises" row now reads like "step raises fatally" (`error` "the engine
#    loop stopped: ValueError: planted fault in step", `/health` 503 failed, new request 503),
#    and the assert against the committed table fails.
# 2. **Drop the loop's last duty.** Patch `EngineLoop._run` with a copy whose `finally:` block
#    leaves out the `_fail_all` call, and rerun section 4. The check: `EngineLoop` now fails
#    `check_nobody_waits` as the hand loop does, with
#    `3 of 3 requests still waiting after 1 s`. Rerun section 3's dead-loop cells on the patched
#    class too: the request still gets its 500, now with a message that starts "the request was
#    aborted", and the time printed under it is close to `LIVENESS_POLL` (1.0 s), because the
#    handler learns of the dead loop only when its wait runs out and it asks `loop.alive`.
# 3. **Mend the hand loop.** Give the hand loop of section 1 a `try/finally` that sends every
#    sink still without a last output a `Refused("the loop died", 500)`. The check:
#    `check_nobody_waits` passes on it under `fatal_engine()`, and each of the three queues ends
#    with that `Refused`.

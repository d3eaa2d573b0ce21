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
# # Day 41 — `/health` and the pool plan
#
# A load balancer, an orchestrator or a careful client asks one question before it sends work:
# may I? The server's answer is `GET /health`. A 200 means "send requests now and they will be
# served"; anything else means "not here, not yet". The answer is only useful if it is exact.
# A server that says 200 while it is still warming makes the first client's request fail; a
# server that keeps saying 200 while it shuts down keeps receiving work it will cut.
#
# nanoserve's `/health` reads one field, the server's phase, and answers 503 with the phase's
# name in four of them: "loading" and "warming" while the builder runs, "draining" during a
# graceful shutdown, "failed" (with the reason) when the build raised or the engine loop died.
# In the fifth, "ready", it answers 200 with what an operator wants to see first: the model,
# the context length, the KV pool plan and how busy the engine is now.
#
# The server is the one of days 35-40 on the engine of day 34 (`health.make_engine` calls
# `engine_config(41, ...)`). `create_app` also takes a *builder* instead of a built engine: a
# function it runs on a background thread, which reports its phases ("loading", then "warming")
# as it goes. Day 55 builds the warm-up that fills "warming" (the decode graphs of days 52-54)
# and day 56 wires it into the boot; today's builder reports the phases and holds in each.
#
# 1. the pool plan in two lines of arithmetic, equal to `plan_pool`,
# 2. one server walked through its whole life, each state produced for real: a builder held on an
#    event in "loading" and in "warming", the 200, a request held waiting, a drain,
# 3. the two ways to fail: a builder that raises, an engine loop that dies,
# 4. the pool plan in the 200 body for nine budgets and block sizes, equal to `plan_pool`'s,
# 5. a client that trusts `/health`, against a planted route that answers 200 while warming,
# 6. the diagram.

# %%
import contextlib
import io
import statistics
import sys
import time

import httpx
import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, ServerThread, as_text, diagram_path, read_csv, tiny_llama
from nanoserve.bench import cpu_line
from nanoserve.pool import plan_pool
from nanoserve.serve import create_app

sys.path.insert(0, str(REPO / "days" / "day41"))
import health  # the day's script: the notebook runs its probes

torch.set_num_threads(1)
print(cpu_line())
DAY = REPO / "days" / "day41"
model = tiny_llama(0, max_position_embeddings=256)
quiet = contextlib.redirect_stderr(io.StringIO())  # boot lines and the failed builder's error line


def read(name):
    return read_csv(DAY / f"day-41-{name}.csv")


def as_csv(rows):
    return as_text(health.public(rows))


# %% [markdown]
# ## 1. The pool plan, in our own lines
#
# One token's K and V across every layer cost `2 x layers x KV heads x head dim x bytes`; a block
# is `block_size` of those. The budget first gives up one token's worth for the sink slot (day
# 16's entry past the last block, where a padded row writes), and the rest is divided into whole
# blocks. For the tiny
# model (2 layers, 2 KV heads, head dim 16, fp32) a token is 512 bytes.

# %%
cfg = model.cfg
per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
assert per_slot == cfg.kv_bytes_per_token(model.dtype) == 512
for budget, block_size in [(262_656, 16), (262_655, 16), (1_000_000, 32)]:
    blocks, slots = health.our_plan(budget, block_size, per_slot)
    plan = plan_pool(cfg, model.dtype, block_size=block_size, budget_bytes=budget)
    print(f"budget {budget:>9,} B, blocks of {block_size}: ours {blocks} blocks = {slots} slots | "
          f"plan_pool {plan.num_blocks} blocks = {plan.num_slots} slots")
    assert (blocks, slots) == (plan.num_blocks, plan.num_slots)
print(plan.describe())

# %% [markdown]
# The first budget is exactly 32 blocks of 16 tokens plus the sink slot; one byte less and the
# sink takes its slot out of the last block, so only 31 fit. The script's engines are all given
# budgets of that exact form (`health.pool_config`).
#
# ## 2. One server, its whole life
#
# `health.probe_life` boots `create_app` with a builder (`HeldBuilder`) that reports each phase
# and then waits on a `threading.Event` until the probe has looked; the engine it hands back was
# built before the app. At each stop the probe asks `/health` and sends one completion. Once ready,
# the engine is held (its step does nothing until another event is set), one request goes in
# and waits, and `serve.drain` starts on a thread: the state SIGTERM puts the server in. Then
# the engine is let go, the waiting request finishes, and the drain returns.

# %%
with quiet:
    life = health.probe_life(model)
for r in life:
    print(f"{r['state']:>8} ({r['produced_by']}): /health {r['health_code']} {r['health_status']!r}"
          + (f", waiting {r['waiting']}" if r["waiting"] != "" else "")
          + (f", in_flight {r['in_flight']}" if r["in_flight"] != "" else ""))
    if r["completion_code"] != "":
        print(f"{'':>10}completion -> {r['completion_code']}, Retry-After {r['retry_after']}"
              + (f": {r['completion_message']}" if r["completion_message"] else ""))
codes = [(r["state"], r["health_code"], r["completion_code"]) for r in life]
assert codes == [("loading", 503, 503), ("warming", 503, 503), ("ok", 200, 200), ("ok", 200, ""),
                 ("draining", 503, 503)]  # fmt: skip
assert life[-1]["retry_after"] == "5" and life[-1]["in_flight"] == 1

# %% [markdown]
# Only the drain's refusal carries `Retry-After`: a draining replica will not come back, so the
# client is told to go elsewhere soon, while "loading" and "warming" are a replica that will be
# ready, and the sentence says to ask `/health` again.
#
# The 200 body, as it was read right after the builder returned, today's fields of it. Its `pool`
# must be `plan_pool`'s plan for the engine's config (its fields, `num_slots` and `describe()`):

# %%
ok = life[2]["_body"]
print({k: ok[k] for k in ("status", "model", "max_model_len", "running", "waiting", "kv_blocks_used")})
print("pool:", ok["pool"])
config = health.pool_config()
expected = plan_pool(cfg, model.dtype, block_size=config.block_size, budget_bytes=config.kv_budget)
assert ok["pool"] == health.pool_body(expected)
assert ok["warm"] is None  # no warm-up ran: there is no warm plan to report
print("the 200 body's pool equals plan_pool's plan for the config")

# %% [markdown]
# The body has more keys than these, for later days to fill: `warm` is `null` until days 52-56
# build graph capture and the warm-up whose plan it reports.

# %% [markdown]
# ## 3. Two ways to fail
#
# A builder that raises: here the engine itself refuses a pool of 4 blocks of 16 tokens (64
# tokens) for a context of 128. And an engine loop that dies: its hand-off code is replaced with
# one that raises after the first step, the planted fault `tests/test_faults.py` uses. Either
# way the process keeps answering, `/health` says "failed" with the reason, and a completion
# gets 503 with the same sentence instead of waiting.

# %%
with quiet:
    failed = [health.probe_failed_build(model), health.probe_dead_loop(model)]
for r in failed:
    print(f"{r['server']:>11} ({r['produced_by']}): /health {r['health_code']} {r['health_status']!r}")
    print(f"{'':>13}error: {r['health_error']}")
    print(f"{'':>13}completion -> {r['completion_code']}: {r['completion_message']}")
assert all(r["health_code"] == 503 and r["completion_message"] == r["health_error"] for r in failed)
assert as_csv(life + failed) == read("states")
print("the seven states equal day-41-states.csv")

# %% [markdown]
# ## 4. The pool plan in `/health`, nine ways
#
# Three pool sizes (8, 32 and 128 blocks) at three block sizes (8, 16 and 32 tokens), each an
# engine behind its own server; each row is what `/health` said, checked against `plan_pool` of
# the same budget and against section 1's two lines.

# %%
pool_rows = health.pool_table(model)
for r in pool_rows:
    print(f"budget {r['kv_budget']:>9,} B, block {r['block_size']:>2}: {r['num_blocks']:>3} blocks, "
          f"{r['num_slots']:>4} slots, pool {r['pool_bytes']:>9,} B | plan_pool {r['equals_plan_pool']}, "
          f"ours {r['equals_ours']}")
assert all(r["equals_plan_pool"] == r["equals_ours"] == "yes" for r in pool_rows)
assert all(r["pool_bytes"] == r["kv_budget"] for r in pool_rows)  # exact budgets: nothing left over
assert as_csv(pool_rows) == read("pool")
print(pool_rows[-1]["_describe"])

# %% [markdown]
# ## 5. A client that trusts `/health`, and a `/health` that lies
#
# The client (`health.first_request`) polls `/health` and sends its first completion through
# the `openai` client, no retries, at the first 200. The builder moves out of a phase only when
# the client has seen it (each poll's status releases that phase's event), so what the client
# sees does not depend on timing. The check is one line: a client that waited for 200 must be
# served at its first request (`health.check_first_request`).
#
# The planted route is the liveness check many servers ship: it answers 503 only while loading,
# draining or failed, and 200 otherwise. So the warm-up counts as up. `plant_liveness_health`
# swaps it in for `create_app`'s route, on a server built the same way.

# %%
engine = health.make_engine(model)
builder = health.HeldBuilder(engine)
app = create_app(builder)
health.plant_liveness_health(app)
server = ServerThread(app)
try:
    with quiet:
        url = server.__enter__()
        health.wait_until(lambda: builder.reached == ["loading"], "the builder to report 'loading'")
        seen = health.first_request(url, on_poll=lambda b: builder.release(b["status"]))
        phase_then = app.state.nanoserve.phase
finally:
    with quiet:
        health.shut(server, app, builder)
print("the client saw:", " > ".join(seen["seen"]), "| the server was", repr(phase_then))
print("its first request:", seen["first_code"], seen["first_message"])
try:
    health.check_first_request(seen)
    print("not caught")
except AssertionError as e:
    print("caught:", e)

# %% [markdown]
# Both routes, through the script's probe, against `day-41-client.csv`: the real one is seen as
# loading, warming, ok and serves the first request; the planted one is seen as loading, then ok
# while the server is still warming, and the first request is refused with 503.

# %%
with quiet:
    clients = health.client_table(model)
for r in clients:
    print(f"{r['health']:>27}: saw {r['statuses_seen']:<24} phase then {r['phase_at_first_request']:<8} "
          f"first request {r['first_request']} | check {r['check_first_request']}")
assert [r["check_first_request"] for r in clients] == ["passes", "fails"]
assert as_csv(clients) == read("client")

# %% [markdown]
# What a poll costs: `/health` on a ready server, 50 times over one connection, next to a bare
# FastAPI app with one route that returns `{"status": "ok"}` on the same harness (uvicorn in a
# thread, loopback); and how many polls each client of the table sent. These vary run to run.

# %%
# NBVAL_IGNORE_OUTPUT
from fastapi import FastAPI  # noqa: E402

bare = FastAPI()


@bare.get("/health")
async def bare_health():
    return {"status": "ok"}


def median_get(app, n=50):
    with quiet, ServerThread(app) as url, httpx.Client() as c:
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            c.get(url + "/health")
            lat.append(time.perf_counter() - t0)
    return statistics.median(lat)


print(cpu_line())
ours_s, bare_s = median_get(create_app(health.make_engine(model))), median_get(bare)
print(f"/health median: nanoserve {1000 * ours_s:.2f} ms, bare FastAPI route {1000 * bare_s:.2f} ms, "
      f"ratio {ours_s / bare_s:.2f}")
print("polls:", {r["health"]: r["_polls"] for r in clients})

# %% [markdown]
# ## 6. The diagram
#
# Left: the states of section 2 and 3, what `/health` and a completion answered in each. Middle:
# the pool plan of section 4, slots against budget per block size. Right: the two clients of
# section 5, what each saw and what its first request got.

# %%
states = read("states")
fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
fig.suptitle("Day 41 — /health and the pool plan (tiny Llama, loopback)", fontsize=13)
ax = axes[0]
labels = [f"{r['state']}\n({r['server']})" if r["server"] != "life" else r["state"] for r in states]
labels[3] = "ok\n(1 waiting)"
hc = [int(r["health_code"]) for r in states]
cc = [int(r["completion_code"]) if r["completion_code"] else 0 for r in states]
xs = range(len(states))
ax.bar([x - 0.2 for x in xs], hc, 0.4, color=["C2" if c == 200 else "C3" for c in hc], label="/health")
ax.bar([x + 0.2 for x in xs], cc, 0.4, color=["#9bd19b" if c == 200 else "#f0a0a0" for c in cc],
       label="a completion")  # fmt: skip
for x, r in zip(xs, states):
    if r["retry_after"] not in ("", "none"):
        ax.text(x + 0.2, cc[x] + 10, f"Retry-After {r['retry_after']}", ha="center", fontsize=7)
ax.set_xticks(list(xs), labels, fontsize=7)
ax.set_ylim(0, 620)
ax.set_ylabel("HTTP status")
ax.set_title("each state, produced and asked")
ax.legend(loc="upper left", fontsize=8)

ax = axes[1]
pool = read("pool")
for bs, marker in (("8", "o"), ("16", "s"), ("32", "^")):
    rows = [r for r in pool if r["block_size"] == bs]
    ax.plot([int(r["kv_budget"]) / 1e6 for r in rows], [int(r["num_slots"]) for r in rows], marker + "-",
            label=f"block {bs}: /health = plan_pool")  # fmt: skip
ax.set_xlabel("KV budget (MB)")
ax.set_ylabel("slots (tokens) in the pool")
ax.set_title("the pool plan /health reports")
ax.legend(fontsize=8)

ax = axes[2]
colors = {"loading": "#8da0cb", "warming": "#fc8d62", "ok": "#66c2a5"}
for y, r in enumerate(read("client")):
    seen_s = r["statuses_seen"].split(" > ")
    for i, s in enumerate(seen_s):
        ax.barh(y, 1, left=i, color=colors[s], edgecolor="k")
        ax.text(i + 0.5, y, s, ha="center", va="center", fontsize=9)
    ok_code = r["first_request"] == "200"
    note = f"first request {r['first_request']}\n(server: {r['phase_at_first_request']})"
    ax.text(len(seen_s) + 0.1, y, note, va="center", fontsize=9, color="C2" if ok_code else "C3")
ax.set_yticks([0, 1], ["create_app's /health", "planted: 200\nwhile warming"])
ax.set_xlim(0, 5)
ax.set_xticks([])
ax.set_title("what a client saw, in order, and its first request")
fig.tight_layout()
path = diagram_path("day41-health.png")
fig.savefig(path, dpi=90)
plt.close(fig)
display(Image(str(path)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM**: `/health` (in `vllm/entrypoints/serve/instrumentator/health.py` in recent
#   versions) has no body. It calls the engine client's `check_health()` and returns a bare 200,
#   or 503 when that raises `EngineDeadError`, so its 503 is our "failed"; the HTTP server is
#   only started after the engine is built, so there is no "loading" to report, just a port that
#   does not answer yet (a newer handler's docstring also lists 503 while its warm-up runs).
#   The pool plan is in the start-up log instead (the KV cache size in tokens and the maximum
#   concurrency), not in the route.
# * **SGLang**: besides `/health`, the server has `/health_generate`, which sends a small
#   generation through the scheduler and answers 200 only when it comes back, a check that a
#   route like section 5's planted one could not fool.
# * **llama.cpp**: `llama-server`'s `/health` answers 503 with an error object saying the model
#   is loading, then 200 `{"status": "ok"}`; per-slot state is a separate route (`/slots`).
# * **TGI**: the router's `/health` answers 200 or 503; when it has no recent successful
#   generation to go by, it sends the shards a one-token request to find out.
# * **Kubernetes** separates the two questions section 5 mixes up: a liveness probe (restart me
#   if this fails) and a readiness probe (send me traffic only if this passes). Our `/health` is a
#   readiness answer; a liveness probe pointed at it would restart a pod that is merely warming.
#
# ## Try it
#
# 1. Run `python days/day41/health.py --blocks 4 8 --block-sizes 16`, then the same with
#    `--block-sizes 8`. Predict which fails before you run it: the pool probe serves a context of
#    64 tokens, and 4 blocks of 8 hold 32. The check: the second run stops with "the KV pool
#    holds 32 tokens, fewer than max_model_len 64".
# 2. Mend the planted route on purpose: in `plant_liveness_health`, add `"warming"` to the
#    phases that answer 503, `importlib.reload(health)` and rerun section 5. The check: its
#    first cell prints that the client saw `loading > warming > ok` and `not caught`, and the
#    next cell's assert, which expects the planted row to fail `check_first_request`, now fails
#    in its turn.
# 3. Call `first_request(url, timeout=0.5)` against a server whose builder you never release.
#    The check: the client raises `TimeoutError` with a sentence that starts "/health did not
#    answer 200 within 0.5 s" and lists the statuses it saw, instead of hanging.

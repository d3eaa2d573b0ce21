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
#

# %% [markdown]
# # Day 44 — Backpressure: saying no on purpose
#
# A server that takes every request it is sent does not serve more; it serves later. Past the
# point where the engine is busy, each new request only lengthens a queue, and every client in
# that queue waits longer for its first token. Saying no early, with a status a client
# understands, is kinder than a timeout after a minute. nanoserve has three refusals of this
# kind, and today they are probed through real HTTP and counted:
#
# * **429** when the scheduler's waiting queue already holds `max_waiting` requests;
# * **413** when a request body is larger than `max_body_bytes`, before the body is parsed;
# * **503 with Retry-After** while the server drains for a shutdown, while the requests already
#   in flight run to their end.
#
# 1. the two admission rules in a few lines of our own,
# 2. the queue: requests sent one at a time to an engine that is paused, until it says 429,
# 3. a limit written one off, caught against the server's own answers,
# 4. the body cap at the cap and one byte over, with and without Content-Length,
# 5. the drain, with a timeout that lets the work finish and one that cuts it,
# 6. TTFT under overload: yesterday's open-loop client above what the engine serves, with the
#    server's default queue and with a limit of 4,
# 7. the day's script (`days/day44/backpressure.py`): its four tables, and the diagram.
#
# The engine is the one of day 44 (`engine_config(44, ...)` in the script's `make_engine`): the
# prefill-first schedule, the gather read of the KV pool, plain linears, torch ops a step.

# %%
import contextlib
import csv
import io
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, tiny_llama
from nanoserve.bench import cpu_line
from nanoserve.serve import MAX_BODY_BYTES

sys.path.insert(0, str(REPO / "days" / "day44"))
import backpressure  # the day's script: the notebook calls its probes

torch.set_num_threads(1)
print(cpu_line())
DAY = REPO / "days" / "day44"
quiet = contextlib.redirect_stderr(io.StringIO())  # the boot line of every server started below
model = tiny_llama(0)


def read(name):
    with open(DAY / f"day-44-{name}.csv") as f:
        return list(csv.DictReader(f))


# %% [markdown]
# ## 1. The rules, in our own lines
#
# The queue rule looks only at the requests waiting, not at the ones running: a request is
# refused when the queue is already full, so `max_waiting` W lets exactly W wait. The body rule
# compares the body's size with the cap: a body of exactly the cap is taken.

# %%
def queue_answer(waiting: int, max_waiting: int) -> int:
    return 429 if waiting >= max_waiting else 200


def body_answer(size: int, cap: int) -> int:
    return 413 if size > cap else 200


print("max_waiting 2, waiting 0..3 ->", [queue_answer(w, 2) for w in range(4)])
print("cap 256, bodies 255..257 ->", [body_answer(s, 256) for s in (255, 256, 257)])
print(f"the server's default cap: {MAX_BODY_BYTES:,} bytes")

# %% [markdown]
# ## 2. Filling the queue until it says 429
#
# To make the queue fill the same way on any machine, the script's `PausedEngine` takes requests
# but runs no step while it is paused: it stands in for an engine too busy to start anything, so
# each admitted request stays in the waiting queue. Requests go out one at a time; each is
# either taken (the queue grows) or answered at once. Then the engine is released, the admitted
# requests run, and one more request is sent to the now empty queue.

# %%
with quiet:
    row, log = backpressure.probe_queue(model, max_waiting=2, extra=2)
for r in log:
    print(f"request {r['request']}: waiting before {r['waiting_before']}, taken {r['taken']}, "
          f"status {r['status']}, Retry-After {r['retry_after'] or 'none'}")
print("the refusal says:", log[-1]["message"])
print(row)
for r in log:
    assert r["status"] == queue_answer(r["waiting_before"], 2), r
assert row["after_release"] == 200  # a 429 is about now: once the queue empties, it takes work

# %% [markdown]
# The same probe at W = 0, 2 and 4, two requests past each, against the script's table (which
# also has W = 1). W = 0 refuses everything, even when nothing is running: a queue of no places is a
# server that is closed.

# %%
with quiet:  # W = 2 is section 2's run
    rows = [row if w == 2 else backpressure.probe_queue(model, w, 2)[0] for w in (0, 2, 4)]
for r in rows:
    print(r)
saved = read("queue")
assert [{k: str(v) for k, v in r.items()} for r in rows] == [r for r in saved if r["max_waiting"] != "1"]
for r in rows:
    assert r["admitted"] == r["max_waiting"] and r["status_429"] == 2 and r["first_429"] == r["max_waiting"]

# %% [markdown]
# ## 3. A limit one off, caught
#
# A limit written with `>` instead of `>=` would let W + 1 wait. Checked request by request
# against what the server answered in section 2, it disagrees at the boundary.

# %%
def check_queue_rule(log, rule, max_waiting):
    for r in log:
        want = rule(r["waiting_before"], max_waiting)
        said = r["status"]
        assert said == want, f"request {r['request']}: the rule says {want}, the server said {said}"


def wrong_rule(waiting, max_waiting):
    return 429 if waiting > max_waiting else 200  # planted: one place too many


check_queue_rule(log, queue_answer, 2)
try:
    check_queue_rule(log, wrong_rule, 2)
    print("not caught")
except AssertionError as e:
    print("caught:", e)

# %% [markdown]
# ## 4. The body cap
#
# A valid completion request padded with spaces to exactly 256 bytes, then to 257, each sent
# once with a Content-Length and once chunked (no length: the middleware counts while it reads
# and stops at the first byte over).

# %%
with quiet:
    body_rows = backpressure.probe_body(model, cap=256)
for r in body_rows:
    print(r)
    assert r["status"] == body_answer(r["body_bytes"], r["cap_bytes"])
assert [{k: str(v) for k, v in r.items()} for r in body_rows] == read("body")

# %% [markdown]
# ## 5. The drain
#
# Three requests are taken by the paused engine; then `serve.drain(state, timeout)` starts on a
# thread (what the server's SIGTERM handler runs). While it drains, /health and one new request
# are asked. In the first run the engine is released and the timeout is 10 s; in the second it
# stays paused and the timeout is 0.3 s, so the three are cut.

# %%
with quiet:
    drains = [
        backpressure.probe_drain(model, 3, timeout=10.0, release=True),
        backpressure.probe_drain(model, 3, timeout=0.3, release=False),
    ]
for r in drains:
    print(r)
assert [{k: str(v) for k, v in r.items()} for r in drains] == read("drain")
finished, cut = drains
assert (finished["status_200"], finished["drain_cut"]) == (3, 0)
assert (cut["status_503"], cut["drain_cut"]) == (3, 3)
assert all(r["health_status"] == "draining" and r["new_retry_after"] == "5" for r in drains)

# %% [markdown]
# ## 6. TTFT under overload
#
# Sections 2 to 5 held the engine still to count refusals. Here it runs. The script's
# `probe_overload` uses day 43's open loop (`loadgen.run_open_loop`): requests arrive at Poisson
# times at 256 a second, against an engine of 2 rows, so they come far faster than it finishes
# them, and nobody waits for an answer before sending the next. With the server's default limit
# (1024 places, so in practice none) every request is taken and waits its turn; with
# `max_waiting` 4 the ones that find four already waiting get 429 at once. What the served
# requests see is the question: their time to first token, and how many of them met day 43's
# objective (TTFT at most 250 ms, TPOT at most 25 ms). The script sends 48 requests each way
# at 256 a second. The notebook sends 24, all at once (a rate of infinity), so that its checks
# do not depend on how fast this machine happens to be: 24 requests at once are more than 2
# rows and 4 places can hold on any machine.

# %%
with quiet:
    limits = (backpressure.DEFAULT_WAITING, 4)
    open_rows = [backpressure.probe_overload(model, float("inf"), 24, w) for w in limits]
unlimited, limited = open_rows
print(f"no limit: {unlimited['status_200']} of {unlimited['requests']} served, "
      f"{unlimited['status_429']} refused")
assert unlimited["status_200"] == 24 and unlimited["status_429"] == 0 and unlimited["other"] == 0
assert limited["status_200"] + limited["status_429"] == 24 and limited["status_429"] > 0
assert limited["ttft_max_ms"] < unlimited["ttft_max_ms"]  # a short queue: a short worst wait
print("max_waiting 4: some refused, every other one served; the longest TTFT is shorter than without")

# %%
# NBVAL_IGNORE_OUTPUT
for r in open_rows:
    print(f"max_waiting {r['max_waiting']:>4}: 200 x{r['status_200']}, 429 x{r['status_429']}, TTFT p50 "
          f"{r['ttft_p50_ms']} ms, p99 {r['ttft_p99_ms']} ms, max {r['ttft_max_ms']} ms, TPOT p50 "
          f"{r['tpot_p50_ms']} ms, goodput {r['goodput_req_s']} req/s ({r['good']} met the objective)")

# %% [markdown]
# The script's run (`day-44-overload.csv`, 48 requests; every column after `requests` is that
# run's clock or depends on it, taken while nothing else was busy on the machine):

# %%
# NBVAL_IGNORE_OUTPUT
overload = read("overload")
cols = ["max_waiting", "requests", "status_200", "status_429", "peak_in_flight", "ttft_p50_ms",
        "ttft_p99_ms", "ttft_max_ms", "tpot_p50_ms", "good", "goodput_req_s"]  # fmt: skip
print(" | ".join(cols))
for r in overload:
    print(" | ".join(r[c] for c in cols))

# %%
assert [(r["max_waiting"], r["requests"], r["request_rate"]) for r in overload] == [
    ("1024", "48", "256.0"), ("4", "48", "256.0")]  # fmt: skip
assert overload[0]["status_429"] == "0" and int(overload[1]["status_429"]) > 0
assert float(overload[1]["ttft_max_ms"]) < float(overload[0]["ttft_max_ms"])

# %% [markdown]
# ## 7. The diagram
#
# Left: each queue limit's answers. Middle left: the body cap's four answers. Middle right: the
# two drains. Right: the script's overload run, TTFT of the served requests with and without
# the limit, and how many were refused.

# %%
fig, axes = plt.subplots(1, 4, figsize=(19, 4.4))
fig.suptitle("Day 44 — backpressure: 429 at the queue, 413 at the body cap, 503 while draining, "
             "and TTFT under overload (tiny Llama, CPU, shared)", fontsize=12)  # fmt: skip
ax = axes[0]
xs = range(len(saved))
ax.bar(xs, [int(r["status_200"]) for r in saved], label="200")
ax.bar(xs, [int(r["status_429"]) for r in saved], bottom=[int(r["status_200"]) for r in saved], label="429")
ax.set_xticks(list(xs), [f"W={r['max_waiting']}" for r in saved])
ax.set_ylabel("requests")
ax.set_title("queue limit: W taken, the rest 429")
ax.legend()
ax = axes[1]
labels = [f"{r['body_bytes']} B\n{r['framing']}" for r in body_rows]
colors = ["C0" if r["status"] == 200 else "C3" for r in body_rows]
ax.bar(range(4), [r["status"] for r in body_rows], color=colors)
ax.set_xticks(range(4), labels, fontsize=8)
ax.set_ylim(0, 450)
ax.set_ylabel("status")
ax.set_title("body cap 256 B: one byte over is 413")
ax = axes[2]
names = ["timeout 10 s\nreleased", "timeout 0.3 s\npaused"]
ax.bar([0, 1], [r["status_200"] for r in drains], label="in flight: 200")
cut_503 = [r["status_503"] for r in drains]
ax.bar([0, 1], cut_503, bottom=[r["status_200"] for r in drains], label="in flight: cut, 503")
ax.set_xticks([0, 1], names)
ax.set_ylim(0, 4.2)
ax.set_ylabel("requests in flight at the drain")
ax.set_title("drain: new requests 503 + Retry-After")
ax.legend()
ax = axes[3]
names = [f"max_waiting {r['max_waiting']}\n200 x{r['status_200']}, 429 x{r['status_429']}" for r in overload]
for i, key in enumerate(("ttft_p50_ms", "ttft_p99_ms", "ttft_max_ms")):
    ax.bar([j + 0.27 * (i - 1) for j in range(len(overload))], [float(r[key]) for r in overload], 0.27,
           label=key.replace("_ms", "").replace("_", " "))  # fmt: skip
ax.set_xticks(range(len(overload)), names, fontsize=8)
ax.set_ylabel("ms (the script's run)")
ax.set_title(f"open loop at {float(overload[0]['request_rate']):.0f} req/s, 2 rows: TTFT of the served")
ax.legend(fontsize=8)
fig.tight_layout()
path = diagram_path("day44-backpressure.png")
fig.savefig(path, dpi=90)
plt.close(fig)
display(Image(str(path)))

# %% [markdown]
# ## In the real systems
#
# * **TGI** puts a cap in its router: `--max-concurrent-requests` bounds how many requests it
#   holds at once, and a request past it is refused with 429 at the door, the same place
#   nanoserve's `max_waiting` acts (ours counts only the waiting queue, TGI's counts everything
#   it holds).
# * **vLLM** added `--shutdown-timeout` to its OpenAI server: with 0 (the default) a SIGTERM
#   aborts what is in flight, with N seconds the server stops taking new requests and waits up to
#   N for the rest, which is our `--drain-timeout`. Its Kubernetes guide pairs it with a
#   `preStop` sleep so the load balancer stops sending first, which is what our /health
#   "draining" is for.
# * **SGLang**'s tokenizer manager has a SIGTERM watchdog: it sets a graceful-exit flag, keeps
#   streaming outputs to the requests in flight, and exits when none are left.
# * nanoserve's 429 carries no Retry-After (the table shows "none"); only the drain's 503 says
#   when to come back. A client that backs off on 429 has to pick its own delay.

# %% [markdown]
# ## Try it
#
# 1. **More limits.** Run `python days/day44/backpressure.py --max-waiting 0 1 2 4 8 --extra 3
#    --out /tmp/day44` (a folder of your own: the run writes all four tables). The check: every
#    row of `/tmp/day44/day-44-queue.csv` has `admitted` equal to `max_waiting` and `status_429`
#    equal to 3.
# 2. **Break the body rule on purpose.** Make `body_answer` refuse a body of exactly the cap
#    (`size >= cap`) and rerun sections 1 and 4. The check: the assert in section 4 fails on the
#    first 256-byte row, whose status the server gave as 200.
# 3. **A longer queue.** Run `backpressure.probe_overload(model, 256.0, 24, 12)` under section
#    6's rows. The check: its `status_200 + status_429` is 24, it refuses fewer than the limit of
#    4 did (`limited["status_429"]`), and its `ttft_max_ms` lies between `limited`'s and
#    `unlimited`'s: each place in the queue is a request served, later.

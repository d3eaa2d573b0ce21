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
# # Day 27 — Continuous batching
#
# Day 22 ran static batches through the engine and found that, even with no padding computed
# and no row generating past its end, a static batch still lasts as long as its longest
# member, and the seats of the members that finish early stay empty until then. On the
# benchmark's 64 requests in batches of 16, those empty seats added up to 3,851 row-steps,
# almost as many as the 4,133 tokens generated. Day 26 built the scheduler's three lists,
# waiting, running and finished, and the policy that moves requests between them at every
# step, `schedule="prefill-first"`. Today measures what that buys against static batches: a
# request that finishes leaves at once, and the next waiting request takes its seat at the
# very next step.
#
# That is continuous batching (iteration-level scheduling, in the Orca paper's words): the
# batch is not a group of requests but whatever is running during one step, decided again at
# every step. The engine as of today, `engine_config(27)`, runs it with prefill-first: a step
# is all prefill or all decode, so a request that takes a freed seat has its prompt computed in
# a step of its own, while the rows already running sit that step out, and decodes with them
# from the next. The static policy stays as `schedule="static"`, so the two can run on the
# same requests. (Day 57's `budget` policy puts a new prompt and the running rows' next tokens
# in one mixed step.)
#
# 1. the two policies in a dozen lines of our own: which requests each step computes,
# 2. the same choices from the engine, step for step, and the requests drawn as a timeline,
# 3. steps, tokens a step, wall time on the tiny model, and the tokens: equal between the two
#    policies and to each request run alone,
# 4. a check that static batches admit only into an empty engine, catching a static
#    scheduler that tops its batch up,
# 5. the script's run at the benchmark's size (`days/day27/continuousbench.py`),
# 6. the diagram.

# %%
import sys
import time

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv, tiny_llama
from nanoserve.bench import cpu_line, throughput_workload
from nanoserve.generate import greedy_tokens
from nanoserve.scheduler import Scheduler

sys.path.insert(0, str(REPO / "days" / "day27"))
import continuousbench  # the day's script: the notebook runs its engines and reads its tables

# One thread: the tiny model's ops are too small to split, and the machine is shared.
torch.set_num_threads(1)
print(cpu_line())
tiny = tiny_llama(0)
SIZE = continuousbench.SMALL
ROWS, BUDGET = SIZE["rows"], SIZE["budget"]
reqs = throughput_workload(SIZE["requests"], SIZE["prompt"], SIZE["new"], tiny.cfg.vocab_size, seed=0)
outputs = [n for _, n in reqs]
print(f"{len(reqs)} requests, {ROWS} rows, a step budget of {BUDGET} tokens")
print("prompt lengths:", [len(p) for p, _ in reqs])
print("output lengths:", outputs)

# %% [markdown]
# ## 1. The two policies, by hand
#
# With a budget this large (512 tokens a step, the prompts at most 24) every prompt is computed
# in the step its request is admitted, and that step also gives the request its first token.
# A step computes either the prompts of the requests it admits, or one token for every running
# request; each computed row gets one token either way. A policy is then a rule for when the
# waiting requests may take the free seats: static, only when every seat is free; continuous,
# whenever one is.


# %%
def seats(outputs, rows, continuous):
    """Which requests (by index) each step computes: those it admits, or else all running."""
    waiting, running, steps = list(range(len(outputs))), {}, []
    while waiting or running:
        admitted = []
        if continuous or not running:
            while waiting and len(running) + len(admitted) < rows:
                admitted.append(waiting.pop(0))
        for i in admitted:
            running[i] = 0  # admitted: tokens so far
        computed = admitted or sorted(running)  # a prefill step, or else a decode step
        steps.append(sorted(computed))
        for i in computed:
            running[i] += 1
            if running[i] == outputs[i]:
                del running[i]  # finished: the seat is free for the next step
    return steps


mine = {"static": seats(outputs, ROWS, False), "prefill-first": seats(outputs, ROWS, True)}
for policy, steps in mine.items():
    occupancy = [len(s) for s in steps]
    print(f"{policy:>13}: {len(steps)} steps, rows per step {''.join(map(str, occupancy))}")
assert sum(map(len, mine["static"])) == sum(map(len, mine["prefill-first"])) == sum(outputs)

# %% [markdown]
# Both policies compute the same 177 row-steps, one per generated token; what differs is how
# they are packed into steps. Static batching runs four batches, each as long as its longest
# output, and the rows per step fall from 4 toward 1 inside each. Continuous batching keeps the
# seats filled until the queue runs dry; each time a seat frees, one step carries only the
# newcomer's prompt (the 1s amid the 4s of its row counts) before all 4 decode together again. Static
# takes 78 steps, continuous 59.
#
# ## 2. The engine's choices
#
# `continuousbench.make_engine` builds the engine twice, differing only in `schedule`, with a
# pool that holds every row at full length (no request waits for blocks or is preempted, so
# the pool cannot be the reason for any difference). `continuousbench.run` queues every
# request, steps to the end and records, for each step, which requests the scheduler gave a
# row. They must be the rows above:

# %%
runs = {}
for policy in continuousbench.POLICIES:
    engine = continuousbench.make_engine(tiny, policy, ROWS, BUDGET)
    runs[policy] = continuousbench.run(engine, reqs)
    members = [s["members"] for s in runs[policy]["steps"]]
    assert members == mine[policy], f"{policy}: the engine's rows differ from seats()"
    kinds = {k: engine.step_kinds[k] for k in ("prefill", "decode")}
    print(f"{policy:>13}: {len(members)} steps agree with seats(); steps by kind {kinds}")

# %% [markdown]
# Under `static` a batch's prompts all go in its first step and nobody joins afterwards, so it
# has 4 prefill steps, one per batch. Under `prefill-first` 12 of the 59 steps are prefill
# steps: the first batch's, then one each time a request is admitted into a freed seat (two
# requests share one when two seats free in the same step).
#
# Each request as a line, steps across: `-` waiting in the queue, `P` the step that computed
# its prompt (and its first token), `D` a decode step, `r` running but sitting out a step that
# prefills someone else's prompt, `.` the steps after it finished while its batch ran on
# (static only; continuous has no batch to wait for).


# %%
def timeline(steps, n, static):
    first = {i: next(t for t, m in enumerate(steps) if i in m) for i in range(n)}
    last = {i: max(t for t, m in enumerate(steps) if i in m) for i in range(n)}
    # a static batch is the requests admitted together; it ends with its last member
    batch_end = {i: max(last[j] for j in range(n) if first[j] == first[i]) if static else last[i]
                 for i in range(n)}  # fmt: skip
    lines = []
    for i in range(n):
        marks = "".join(
            "-" if t < first[i] else "P" if t == first[i] else ("D" if i in steps[t] else "r")
            if t <= last[i] else "." if t <= batch_end[i] else " "
            for t in range(len(steps))
        )  # fmt: skip
        lines.append(f"{i:>3} {marks}")
    return lines


for policy in continuousbench.POLICIES:
    steps = [s["members"] for s in runs[policy]["steps"]]
    print(f"{policy} ({len(steps)} steps)")
    print("\n".join(timeline(steps, len(reqs), policy == "static")))

# %% [markdown]
# Static's dots are Day 22's idle seats: request 1 finished after 3 tokens and its seat stayed
# empty for the 19 steps its batch's longest member, request 2 with 22 tokens, still needed.
# Under `prefill-first` request 4 takes that seat in step 3, the step right after request 1's
# last token, and the other three rows sit that step out (their `r`). The last request in the
# queue, request 15, waits 57 steps under `static` and 43 under `prefill-first`.
#
# ## 3. Steps, tokens and time
#
# Tokens first. Both runs must give every request the tokens it gets alone (`greedy_tokens`,
# one sequence, contiguous cache) and so the same tokens as each other; a request admitted
# into a running batch sees other rows around it at every step, which must change nothing.

# %%
with torch.inference_mode():
    alone = [greedy_tokens(tiny, p, n) for p, n in reqs]
for policy, got in runs.items():
    bad = [i for i, (a, b) in enumerate(zip(got["tokens"], alone)) if a != b]
    print(f"{policy:>13}: {len(reqs) - len(bad)} of {len(reqs)} requests equal to the request run alone")
    assert not bad
assert runs["static"]["tokens"] == runs["prefill-first"]["tokens"]

# %% [markdown]
# Then the steps. `continuousbench.summary` turns a run into the numbers the script's table
# holds: steps by kind, row-steps, mean rows a step, the share of the seats in use (row-steps
# over steps x rows) and mean tokens a step. Every one of them is a count, the same on every
# run:

# %%
rows = {p: continuousbench.summary(p, got, ROWS, BUDGET, len(reqs)) for p, got in runs.items()}
facts = ["steps", "prefill_steps", "decode_steps", "row_steps", "mean_rows", "seat_use",
         "mean_step_tokens", "generated"]  # fmt: skip
print(f"{'':<14}" + "".join(f"{c:>17}" for c in facts))
for policy, r in rows.items():
    print(f"{policy:<14}" + "".join(f"{r[c]:>17}" for c in facts))
assert rows["static"]["generated"] == rows["prefill-first"]["generated"] == sum(outputs)

# %% [markdown]
# And the time, on the tiny model, each policy twice in turn, keeping its faster run. On a
# model this small a step costs mostly its fixed Python and kernel-launch overhead (Day 49),
# so fewer steps means less time, if not quite in proportion: a prefill step carries a whole
# prompt and costs a little more than a decode step. On SmolLM2, where a step's cost grows
# with what it carries, the ratio is Day 33's to measure.

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
best = {}
for _ in range(2):
    for policy in continuousbench.POLICIES:
        t0 = time.perf_counter()
        got = continuousbench.run(continuousbench.make_engine(tiny, policy, ROWS, BUDGET), reqs)
        best[policy] = min(best.get(policy, float("inf")), got["seconds"])
for policy, seconds in best.items():
    print(f"{policy:>13}: {seconds * 1000:.1f} ms, {sum(outputs) / seconds:.1f} tok/s, "
          f"{seconds / len(runs[policy]['steps']) * 1000:.2f} ms a step")  # fmt: skip
print(f"prefill-first against static: {best['static'] / best['prefill-first']:.2f}x the tokens a second")

# %% [markdown]
# ## 4. A static batch admits only into an empty engine
#
# What makes the static policy static is one rule: nothing joins a batch that is running. The
# check below reads it off a run: in every step that admitted anyone, no sequence may have been
# running before it. Like any check read off a run, it passes vacuously on a run that admits
# nothing.


# %%
def check_static_admission(steps):
    for t, s in enumerate(steps):
        if s["admitted"] and s["running_before"]:
            raise AssertionError(
                f"step {t} admitted {s['admitted']} while {s['running_before']} were running"
            )


check_static_admission(runs["static"]["steps"])
opened = [(t, s["admitted"]) for t, s in enumerate(runs["static"]["steps"]) if s["admitted"]]
print("static: passes; batches open at (step, requests):", opened)
try:
    check_static_admission(runs["prefill-first"]["steps"])
except AssertionError as e:
    print("prefill-first (continuous by design) fails it:", e)

# %% [markdown]
# The planted scheduler keeps the static name and its first batch, but when a member
# finishes it lets the next waiting request into the freed seat, as if a half-empty batch
# were a waste worth fixing. It is continuous batching again (Day 26's prefill-first admission)
# under the wrong name, and a benchmark of "static" batching with it would flatter the static side.


# %%
class TopsUp(Scheduler):  # wrongly built: a static batch that refills its free seats
    def _schedule_static(self):
        batch = self._schedule_prefill()  # admits whenever a row is free
        return batch if batch.chunks else self._schedule_decode()


engine = continuousbench.make_engine(tiny, "static", ROWS, BUDGET)
engine.scheduler.__class__ = TopsUp
topped = continuousbench.run(engine, reqs)
try:
    check_static_admission(topped["steps"])
    raise RuntimeError("the topped-up static batch went unnoticed")
except AssertionError as e:
    print("caught:", e)
print(f"its run: {len(topped['steps'])} steps; tokens equal to the real static run's:",
      topped["tokens"] == runs["static"]["tokens"])  # fmt: skip
assert topped["tokens"] == runs["static"]["tokens"]

# %% [markdown]
# The tokens cannot tell: every request gets its right tokens whoever it shares a step with,
# which is the point of section 3. Only the admission rule, read off the run, says which
# policy ran.
#
# ## 5. At the benchmark's size
#
# `days/day27/continuousbench.py` runs the same comparison on `bench throughput`'s workload
# (64 requests, prompts of 16 to 256 tokens, outputs of 16 to 128) with 16 rows and the
# default budget of 512 tokens, on the tiny model, each policy twice in turn. With prompts
# this long a batch's prompts no longer fit one step, so static batches spend several
# prefill steps before their first decode; under prefill-first the first batch does the same,
# and after it each admission is a prefill step between decode steps. The script asserts
# every request's tokens against the request alone and writes `day-27-continuous.csv` and,
# step by step, `day-27-occupancy.csv`:

# %%
table = read_csv(continuousbench.CSV)
cols = ["policy", "steps", "prefill_steps", "decode_steps", "row_steps", "mean_rows",
        "seat_use", "mean_step_tokens", "generated", "same_as_alone"]  # fmt: skip
print(" | ".join(cols))
for r in table:
    print(" | ".join(r[c] for c in cols))
occupancy = read_csv(continuousbench.CSV_STEPS)
full = throughput_workload(64, (16, 256), (16, 128), tiny.cfg.vocab_size, seed=0)
assert all(int(r["generated"]) == sum(n for _, n in full) for r in table)

# %% [markdown]
# Continuous batching took 346 steps where static batches took 512, and kept 11.95 of the 16
# seats busy on average against 8.1 (a seat use of 0.747 against 0.506). The row-steps are
# nearly the same, 4,136 against 4,146, because both compute each generated token once; the
# few rows beyond the 4,133 tokens are prompt chunks that end short of their prompt's last
# token and so sample nothing. Static's 17 prefill steps are its four batches' prompts in
# 512-token chunks, during which rows whose prompts are already done wait for the others.
# Prefill-first has 42: the first batch's, then one for each seat or group of seats that frees,
# each a step the running rows sit out. That is the price of keeping prefill and decode in
# separate steps, and the part of the seats it leaves unused. The script's timing columns,
# from its own run (this machine, shared, one thread):

# %%
# NBVAL_IGNORE_OUTPUT
for r in table:
    print(f"{r['policy']:>13}: {r['seconds']} s, {r['tok_s']} tok/s")
s, c = table
print(f"prefill-first against static: {float(s['steps']) / float(c['steps']):.2f}x fewer steps, "
      f"{float(c['tok_s']) / float(s['tok_s']):.2f}x the tokens a second")  # fmt: skip

# %% [markdown]
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(14, 9.5), gridspec_kw={"hspace": 0.4, "wspace": 0.22})
colors = {"static": "tab:gray", "prefill-first": "tab:green"}
ax = axes[0, 0]
for policy in continuousbench.POLICIES:
    occ = [s["rows"] for s in runs[policy]["steps"]]
    ax.step(range(len(occ)), occ, where="post", color=colors[policy], lw=2,
            label=f"{policy}: {len(occ)} steps")  # fmt: skip
ax.set_ylim(0, ROWS + 0.5)
ax.set_xlabel("engine step")
ax.set_ylabel("rows computed in the step")
ax.set_title(f"tiny model, {len(reqs)} requests, {ROWS} rows: occupancy per step", fontsize=10)
ax.legend(fontsize=8, loc="lower left")

ax = axes[0, 1]
for policy, dy in (("static", -0.2), ("prefill-first", 0.2)):
    steps = [s["members"] for s in runs[policy]["steps"]]
    for i in range(len(reqs)):
        live = [t for t, m in enumerate(steps) if i in m]
        ax.plot([live[0], live[-1] + 1], [i + dy] * 2, color=colors[policy], lw=3,
                label=policy if i == 0 else None)  # fmt: skip
        ax.plot([0, live[0]], [i + dy] * 2, color=colors[policy], lw=1, ls=":")
ax.invert_yaxis()
ax.set_xlabel("engine step (dotted: waiting in the queue; solid: holding a row)")
ax.set_ylabel("request")
ax.set_title("each request's wait and run, both policies", fontsize=10)
ax.legend(fontsize=8, loc="upper right")

ax = axes[1, 0]
for policy in continuousbench.POLICIES:
    occ = [int(r[f"{policy}_rows"]) for r in occupancy if r[f"{policy}_rows"] != ""]
    ax.step(range(len(occ)), occ, where="post", color=colors[policy], lw=1.2,
            label=f"{policy}: {len(occ)} steps")  # fmt: skip
ax.set_ylim(0, 17)
ax.set_xlabel("engine step")
ax.set_ylabel("rows computed in the step")
ax.set_title("the benchmark's 64 requests, 16 rows, budget 512 (day-27-occupancy.csv)", fontsize=10)
ax.legend(fontsize=8, loc="lower right")

ax = axes[1, 1]
names = ["steps", "mean_rows", "mean_step_tokens"]
x = np.arange(len(names))
for j, r in enumerate(table):
    vals = [float(r[c]) for c in names]
    ax.bar(x + (j - 0.5) * 0.38, vals, 0.38, color=colors[r["policy"]], label=r["policy"])
    for i, v in enumerate(vals):
        ax.text(i + (j - 0.5) * 0.38, v * 1.15, r[names[i]], ha="center", fontsize=8)
ax.set_yscale("log")
ax.set_ylim(1, 2000)
ax.set_xticks(x, ["steps", "rows a step (of 16)", "tokens a step"])
ax.set_title("the benchmark-sized run: steps taken and what a step carries (log)", fontsize=10)
ax.legend(fontsize=8)
fig.suptitle("Day 27: continuous batching (schedule=\"prefill-first\") against static batches, "
             "same requests", fontsize=13)  # fmt: skip
png = diagram_path("day27-continuous.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **Orca** (Yu et al., OSDI 2022) introduced the idea as iteration-level scheduling: the
#   scheduler hands the engine one iteration at a time, so a request can join or leave at any
#   iteration boundary, instead of one batch of whole requests. Its measurements were against
#   FasterTransformer, which batched whole requests the static way.
# * **vLLM** was continuous from its first release (the PagedAttention paper, SOSP 2023, built
#   it on Orca's scheduling). In V1, `Scheduler.schedule` in `vllm/v1/core/sched/scheduler.py`
#   runs every step: first the `running` requests, then new ones from `waiting` while the
#   step's `max_num_batched_tokens` budget lasts and fewer than `max_num_seqs` are running;
#   a finished request is removed in `update_from_output` after the step, freeing its seat for
#   the next one. V1 mixes prompt chunks and decode rows in that step; our prefill-first
#   policy keeps them apart, as vLLM's V0 scheduler did by default (Day 57 builds the mixed
#   order).
# * **TensorRT-LLM** calls it in-flight batching, and its capacity scheduler policy says how
#   boldly to admit: `GUARANTEED_NO_EVICT` admits a request only if the blocks for its whole
#   output are there, `MAX_UTILIZATION` packs as many as fit now and may pause some later, and
#   `STATIC_BATCH` admits nothing until the current batch has completed, the role of our
#   `schedule="static"` (it replaced the older `BatchingType.STATIC`).
# * **llama.cpp**'s server gives each of `-np` slots one request at a time; with continuous
#   batching (`-cb`, on by default in recent builds) a free slot takes the next queued request
#   while the other slots go on decoding, all of them in one `llama_decode` call per step.
# * **SGLang**'s scheduler does the same every step, choosing whom to admit by a policy
#   (`schedule_policy.py`: first come first served, or longest prefix match against its radix
#   cache), and estimating how much a running request will still grow with `new_token_ratio`.
#
# ## Try it
#
# 1. **More rows than requests.** Rerun sections 1 and 2 with `ROWS = 16`: everyone is admitted
#    in step 0, so both policies must take exactly `max(outputs)` steps (22, from the printed
#    lengths), and the check in section 4 must pass on both. Why does continuous batching gain
#    nothing here?
# 2. **A leak of one.** Change `TopsUp` so it refills a freed seat only once per batch. The
#    check must still catch it; which step does it name?
# 3. **Budget too small.** Run the script with `--budget 32 --requests 16 --rows 4 --prompt-len
#    4 24 --output-len 2 24 --out /tmp/c.csv --out-steps /tmp/s.csv`: prompts now need more
#    than one step. Check: `prefill_steps` goes from section 3's 4 to 11 for static and from 12
#    to 14 for prefill-first, and `same_as_alone` stays 16 for both (the script asserts it).

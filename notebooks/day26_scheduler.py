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
# # Day 26 — The scheduler: waiting, running, finished
#
# Day 25's step plan addresses whatever rows it is given. Something has to pick those rows,
# step after step, while requests keep arriving and others end: that is the scheduler
# (`nanoserve/scheduler.py`). It holds every request the engine knows in one of three places.
# A new request joins the back of the waiting queue (`Scheduler.waiting`, a deque). At the
# start of a step the scheduler moves requests from the front of that queue into the running
# set (`Scheduler.running`) while a row is free (`max_batch`) and the step's token budget
# (`max_num_batched_tokens`) lasts, handing each one the blocks for its prompt; then it chooses
# what the step computes for the running ones: a chunk of a prompt, or one decode token. When
# a request's last token comes out, `Scheduler.finish` takes it out of the running set and
# gives its blocks back in the same step. Finished is the third place, and a request never
# leaves it.
#
# The policy this day builds is `schedule="prefill-first"`, and from today it is the engine's
# (`engine_config(26)`; Day 22's `"static"` stays as a named variant): a step is all prompt work
# if any is due, otherwise one decode token for every running request. Day 57 lets decode rows
# and prompt chunks share a step. Memory is roomy
# here, so nobody is refused blocks or preempted; Days 28 and 29 take those away.
#
# 1. a dozen requests with staggered arrivals, traced step by step on the tiny model,
# 2. the same trace from a state machine of our own, forty lines without the model,
# 3. the trace's invariants: one state per request, blocks used equal the running tables,
#    everyone finishes, and the per-step table,
# 4. the tokens against the eager reference,
# 5. a scheduler that forgets to free a finished request's blocks, caught,
# 6. the script's tables and the diagram.

# %%
import sys
from collections import deque

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, as_text, diagram_path, read_csv, same_or_near_tie, tiny_llama
from nanoserve.bench import cpu_line
from nanoserve.generate import greedy_tokens
from nanoserve.scheduler import Scheduler

sys.path.insert(0, str(REPO / "days" / "day26"))
import schedtrace  # the day's script: its workload, its traced run, the tables it wrote

# One thread: the tiny model's steps are small, and the machine is shared with other jobs.
torch.set_num_threads(1)
tiny = tiny_llama(0, 0.05, 512)
REQS = schedtrace.workload()  # 12 requests: (id, prompt ids, max_tokens, arrival step)
MAX_BATCH, BUDGET = 4, 32
print(cpu_line())
print(f"tiny Llama: {tiny.cfg.num_layers} layers, hidden {tiny.cfg.hidden_size}, vocab {tiny.cfg.vocab_size}")
print(f"max_batch {MAX_BATCH}, max_num_batched_tokens {BUDGET}, blocks of {schedtrace.BLOCK} tokens")
for rid, ids, n, t in REQS:
    print(f"  {rid}: arrives before step {t:>2}, prompt {len(ids):>2} tokens, {n:>2} to generate")

# %% [markdown]
# ## 1. The trace
#
# `schedtrace.run_trace` adds each request just before the step numbered its arrival, steps
# the engine until nothing is left, and watches what `Scheduler.schedule` hands the runner.
# After every step it writes one letter per request: `-` not arrived, `W` waiting in the queue,
# `P` a prompt chunk this step, `D` a decode row this step, `r` running but given nothing this
# step, `F` finished (from the step after its last token). Arrivals are step numbers, not
# clock times, so the trace is the same on every run.

# %%
engine = schedtrace.engine_for(tiny, MAX_BATCH, BUDGET)
trace = schedtrace.run_trace(engine, REQS)
sched = engine.scheduler
print("\n".join(schedtrace.grid(trace, REQS)))
print(f"{len(trace.states)} steps, step_kinds {engine.step_kinds}, preemptions {sched.num_preemptions}")

# %% [markdown]
# Read down a column and you see one step's decision; read along a line and you see one
# request's life. Four things are worth finding in it:
#
# * **Rows.** Before step 10, `r04` and `r05` arrive together. Three requests are running, so
#   one row is free: `r04` takes it and `r05` waits, seven steps, until `r01` and `r04` finish
#   in step 16 and free two rows at once. From step 10 to step 34 at least one request is
#   always waiting: four rows are not enough for this arrival rate.
# * **The budget.** `r04`'s prompt is 37 tokens and the budget 32, so it is computed as two
#   chunks (`PP` in steps 10 and 11; chunked prefill, Day 30). `r06` (26 tokens) is admitted
#   in step 17 beside `r05` (12) and gets the 20 tokens of budget `r05` leaves, then its last 6
#   in step 18.
# * **Prefill-first.** Every `r` is a running request sitting out a prompt step: when a prompt
#   is due, the step is prompt work only. `r02` loses 5 steps that way.
# * **Finishing frees at once.** The step that produces a request's last token is also the
#   step its row and blocks come back, so in step 17 two new prompts start.
#
# The chunks of the first steps, as `(start, end)` prompt positions:

# %%
for i in (0, 3, 6, 7, 10, 11, 17, 18):
    print(f"step {i:>2}: chunks {trace.chunks[i]}, {trace.tokens[i]} tokens")
assert trace.chunks[10] == {"r04": (0, 32)} and trace.chunks[11] == {"r04": (32, 37)}
assert trace.chunks[17] == {"r05": (0, 12), "r06": (0, 20)} and trace.chunks[18] == {"r06": (20, 26)}

# %% [markdown]
# ## 2. The same trace from forty lines of our own
#
# Without memory pressure the whole scheduler is three lists and two counters a request:
# `length` (tokens so far, prompt then generated) and `computed` (tokens whose K/V is in the
# cache). A request needs prompt work while more than its newest token is missing from the
# cache. The prompt pass gives the budget to running prompts first, then admits from the
# front of the queue while a row is free and budget is left; a step with no prompt work
# decodes every running request. A row samples a token once all its tokens are computed, and
# a request with all its tokens is finished. The model plays no part in any of it, so the
# simulation needs only the lengths.


# %%
def mini_trace(requests, max_batch, budget):
    """The letters of every step, for the prefill-first policy with blocks to spare."""
    length = {rid: len(ids) for rid, ids, _, _ in requests}
    goal = {rid: n for rid, _, n, _ in requests}
    computed, made = dict.fromkeys(length, 0), dict.fromkeys(length, 0)
    todo, waiting, running, finished = deque(sorted(requests, key=lambda r: r[3])), deque(), [], set()
    steps, step = [], 0
    while todo or waiting or running:
        while todo and todo[0][3] <= step:
            waiting.append(todo.popleft()[0])
        left, chunks = budget, {}
        prompts_due = [r for r in running if computed[r] < length[r] - 1]
        for rid in prompts_due + list(waiting)[: max_batch - len(running)]:
            if left <= 0:
                break
            if rid in waiting:
                waiting.remove(rid)
                running.append(rid)
            end = min(length[rid], computed[rid] + left)
            left -= end - computed[rid]
            chunks[rid], computed[rid] = "P", end
        rows = chunks or dict.fromkeys(running, "D")  # prefill-first: prompt work, else every decode
        computed.update({rid: length[rid] for rid in rows if rows[rid] == "D"})
        letters = {}
        for rid, *_ in requests:
            if rid in rows:
                letters[rid] = rows[rid]
            elif rid in finished:
                letters[rid] = "F"
            else:
                letters[rid] = "r" if rid in running else "W" if rid in waiting else "-"
        for rid in rows:
            if computed[rid] == length[rid]:  # sample: one more token
                length[rid], made[rid] = length[rid] + 1, made[rid] + 1
                if made[rid] == goal[rid]:
                    running.remove(rid)
                    finished.add(rid)
        steps.append(letters)
        step += 1
    return steps


mine = mini_trace(REQS, MAX_BATCH, BUDGET)
print(f"{len(mine)} steps from the state machine, {len(trace.states)} from the engine")
assert mine == trace.states
print("every step's letters equal")

# %% [markdown]
# ## 3. The invariants
#
# `run_trace` checked three things after every step, and would have raised on the first
# failure:
#
# * **One state each** (`schedtrace.check_states`): every request that has arrived is in exactly
#   one of `Scheduler.waiting`, `Scheduler.running` and finished (`Sequence.finished`).
# * **Blocks used are the running tables' blocks** (`schedtrace.check_blocks`): the allocator's
#   `num_used` equals the blocks the running sequences' block tables hold, and
#   `BlockAllocator.check_invariants` (Day 14) agrees block by block: each block's reference
#   count is the number of running tables that hold it, and it is on the free list exactly when
#   that count is 0. So a waiting or finished request holds no block.
# * **Everyone finishes**: at the end each request has all its tokens, and the allocator has all
#   its blocks back.
#
# The checks once more, by hand, at the end of the run:

# %%
seqs = {rid: engine.requests.get(rid) for rid, *_ in REQS}
assert all(v is None for v in seqs.values()), "a finished request is still in the engine's table"
assert not sched.waiting and not sched.running
assert engine.allocator.num_used == 0 and engine.allocator.num_free == engine.allocator.num_blocks
assert {rid: len(t) for rid, t in trace.outputs.items()} == {rid: n for rid, _, n, _ in REQS}
assert trace.blocks_used == trace.table_blocks
alloc = engine.allocator
print(f"all {len(REQS)} finished with their tokens; {alloc.num_free} of {alloc.num_blocks} blocks free")
print(f"blocks used after each step == the running tables' blocks, at all {len(trace.states)} steps")

# %% [markdown]
# The per-step table the script writes (`schedtrace.step_rows`): how many requests wait, run a
# chunk, decode and sit out in each step, how many have finished by its end, the tokens the
# step carried and the blocks used after it.

# %%
steps = schedtrace.step_rows(trace)
cols = list(steps[0])
print(" ".join(f"{c:>11}" for c in cols))
for r in steps:
    print(" ".join(f"{r[c]:>11}" for c in cols))
assert max(r["prefill"] + r["decode"] + r["idle"] for r in steps) == MAX_BATCH  # rows never exceed it
assert steps[-1]["finished"] == len(REQS) and steps[-1]["blocks_used"] == 0

# %% [markdown]
# And per request (`schedtrace.request_rows`): when it arrived, was admitted and produced its
# last token, and how its steps divide between waiting, prompt chunks, decode rows and idle
# steps under prefill-first.

# %%
per_req = schedtrace.request_rows(trace, REQS)
cols = list(per_req[0])
print(" ".join(f"{c:>12}" for c in cols))
for r in per_req:
    print(" ".join(f"{r[c]:>12}" for c in cols))
assert all(r["decode_steps"] == r["max_tokens"] - (r["chunk_steps"] > 0) for r in per_req)
waited, idle = sum(r["waited"] for r in per_req), sum(r["idle_steps"] for r in per_req)
print("request-steps spent waiting:", waited, "| running but idle:", idle)

# %% [markdown]
# Each request's decode steps are its tokens less one: the first token comes out of the step
# that finishes the prompt. Before anything ran, the 12 requests spent 83 request-steps in the
# queue, against 25 running but idle.
#
# ## 4. The same tokens
#
# Scheduling must not change what a request generates. The reference is `greedy_tokens`, one
# request alone on a contiguous cache; batches of other shapes round differently, so, as in
# `tests/test_engine.py`, a difference would be excused only where the reference's top two
# logits at the first differing position are within 1e-4 (`nanocourse.same_or_near_tie`).

# %%
ties = []
with torch.inference_mode():
    for rid, ids, n, _ in REQS:
        ref, got = greedy_tokens(tiny, ids, n), trace.outputs[rid]
        if same_or_near_tie(tiny, ids, ref, got, tie=1e-4) != "equal":  # raises on a real difference
            ties.append(rid)
print(f"{len(REQS) - len(ties)} of {len(REQS)} equal the eager tokens; near-ties excused: {len(ties)}")
print("r00:", trace.outputs["r00"])

# %% [markdown]
# ## 5. A scheduler that forgets to free
#
# The bug this day's second invariant is for: `finish` takes the request out of the running set
# but never calls `allocator.free` on its block table. Nothing else notices. The request has
# its tokens, its row is reused, and the next prompts still get fresh blocks from a pool this
# roomy. Only the books are wrong: the allocator counts the finished request's blocks as used,
# and no running table holds them. The same workload, run through the same checks:


# %%
class ForgetsToFree(Scheduler):
    def finish(self, seq, reason):
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)  # leaves the running set, and keeps its blocks
            self.on_leave(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)


leaky = schedtrace.engine_for(tiny, MAX_BATCH, BUDGET)
leaky.scheduler.__class__ = ForgetsToFree
try:
    schedtrace.run_trace(leaky, REQS)
    raise RuntimeError("the block check passed on a scheduler that never frees")
except AssertionError as e:
    print(f"caught after step {sum(leaky.step_kinds.values()) - 1}: {e}")

# %% [markdown]
# It is caught after step 5, the step `r00` produces its fifth and last token: its blocks still
# have a reference count of 1 while no running table holds them. Run without the checks, the
# leak simply grows with every finished request, and the tokens come out right:

# %%
leaky = schedtrace.engine_for(tiny, MAX_BATCH, BUDGET)
leaky.scheduler.__class__ = ForgetsToFree
leak = schedtrace.run_trace(leaky, REQS, check=False)
print("tokens equal the correct run's:", leak.outputs == trace.outputs)
print("blocks used at the end:", leak.blocks_used[-1], "| held by running tables:", leak.table_blocks[-1])
print(f"pool: {leaky.allocator.num_blocks} blocks; the correct run peaked at {max(trace.blocks_used)} used")
assert leak.outputs == trace.outputs and leak.blocks_used[-1] > 0 == leak.table_blocks[-1]

# %% [markdown]
# With a pool of 255 blocks the leaky engine finishes the workload holding 90 blocks that
# belong to nobody, where the correct run never had more than 31 in use at once. A server runs
# for days, so the leak ends in a pool with no free blocks, and the first symptom anyone would
# see is requests waiting forever for blocks the free list never gets back. The invariant
# turns that into an error at the step it starts.
#
# ## 6. The script's tables, and the diagram
#
# `days/day26/schedtrace.py` runs the same workload and writes the two tables above; the
# notebook's rows must equal what it committed.

# %%
committed_steps = read_csv(schedtrace.HERE / "day-26-steps.csv")
committed_reqs = read_csv(schedtrace.HERE / "day-26-requests.csv")
assert committed_steps == as_text(steps)
assert committed_reqs == as_text(per_req)
print(f"day-26-steps.csv: {len(committed_steps)} rows, day-26-requests.csv: {len(committed_reqs)}; equal")

# %%
COLORS = {"W": "0.82", "P": "tab:orange", "D": "tab:blue", "r": "lightsteelblue"}
LABELS = {"W": "waiting", "P": "prompt chunk", "D": "decode row", "r": "running, idle this step"}
fig, axes = plt.subplots(2, 2, figsize=(15, 10), gridspec_kw={"height_ratios": [1.2, 1], "hspace": 0.32})
n_steps, names = len(trace.states), [r[0] for r in REQS]

ax = axes[0][0]
for y, rid in enumerate(names):
    letters = [s[rid] for s in trace.states]
    for i, c in enumerate(letters):
        if c in COLORS:
            ax.barh(y, 1, left=i - 0.5, height=0.7, color=COLORS[c], edgecolor="white", linewidth=0.4)
    last = trace.finished_at[rid]
    ax.plot(last + 0.5, y, marker="|", color="black", ms=14, mew=2)
ax.set_yticks(range(len(names)), names)
ax.set_ylim(len(names) - 0.4, -0.6)
ax.set_xlim(-0.7, n_steps)
ax.set_xlabel("engine step")
ax.set_title(f"each request's state per step ({n_steps} steps, max_batch {MAX_BATCH}, budget {BUDGET})")
handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in COLORS]
handles.append(plt.Line2D([], [], marker="|", color="black", ls="", ms=12, mew=2))
ax.legend(handles, [*LABELS.values(), "last token"], fontsize=8, loc="upper center", ncol=5,
          bbox_to_anchor=(0.5, -0.1))  # fmt: skip

ax = axes[0][1]
x = range(n_steps)
running = [r["prefill"] + r["decode"] + r["idle"] for r in steps]
ax.stackplot(
    x,
    [sum(s[rid] == "F" for rid in names) for s in trace.states],
    running,
    [r["waiting"] for r in steps],
    labels=["finished", "running", "waiting"],
    colors=["tab:green", "tab:blue", "0.75"],
    step="mid",
)
ax.axhline(len(REQS), color="black", lw=0.8, ls=":")
ax.axhline(MAX_BATCH, color="tab:blue", lw=0.8, ls="--")
ax.text(1, MAX_BATCH + 0.2, "max_batch", color="tab:blue", fontsize=8)
ax.set_xlabel("engine step")
ax.set_ylabel("requests")
ax.set_title("where the arrived requests are, step by step")
ax.legend(fontsize=8, loc="upper left")

ax = axes[1][0]
ax.plot(x, trace.blocks_used, color="tab:blue", lw=2, label="allocator: blocks used")
ax.plot(x, trace.table_blocks, "k.", ms=4, label="running tables' blocks (the same)")
ax.plot(range(len(leak.blocks_used)), leak.blocks_used, color="crimson", lw=1.5,
        label="ForgetsToFree: blocks used")  # fmt: skip
ax.plot(range(len(leak.table_blocks)), leak.table_blocks, color="crimson", lw=0.8, ls=":",
        label="ForgetsToFree: running tables' blocks")  # fmt: skip
ax.set_xlabel("engine step")
ax.set_ylabel("blocks of 4 tokens")
ax.set_title("blocks used against blocks the running tables hold")
ax.legend(fontsize=8, loc="upper left")

ax = axes[1][1]
parts = [("waited", "W"), ("chunk_steps", "P"), ("decode_steps", "D"), ("idle_steps", "r")]
left = [0] * len(per_req)
for col, c in parts:
    vals = [r[col] for r in per_req]
    ax.barh(names, vals, left=left, color=COLORS[c], label=LABELS[c])
    left = [a + b for a, b in zip(left, vals)]
ax.invert_yaxis()
ax.set_xlim(0, 46)
ax.set_xlabel("steps")
ax.set_title("each request's steps by state (day-26-requests.csv)")
ax.legend(fontsize=8, loc="lower right")

fig.suptitle("Day 26: the scheduler moves requests from waiting to running to finished", fontsize=14)
png = diagram_path("day26-scheduler.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** (`vllm/v1/core/sched/scheduler.py`) keeps the same two collections: `self.waiting`
#   (a request queue, first come first served by default, or by priority) and `self.running` (a
#   list). `Scheduler.schedule` walks the running requests first, then admits from the waiting
#   queue while `len(self.running)` is below `max_num_seqs` and the step's token budget
#   (`max_num_batched_tokens`) lasts; a request's state is a `RequestStatus` (`WAITING`,
#   `RUNNING`, `PREEMPTED`, and several `FINISHED_*` values for stop, length and abort). When a
#   request finishes, the scheduler frees its KV blocks through the `KVCacheManager` in the same
#   update that reports its last token. V1 has no separate prefill and decode phases (Day 57
#   builds that policy here); today's engine runs prefill first, as vLLM's V0 scheduler did by
#   default.
# * **SGLang** (`python/sglang/srt/managers/scheduler.py`) has a `waiting_queue` and a
#   `running_batch`; each iteration either builds a prefill batch from the queue
#   (`get_new_batch_prefill`, with `schedule_policy.py` ordering the queue: `fcfs`, or `lpm`,
#   longest prefix match, to favour cache hits) or runs a decode step of the running batch,
#   finished requests being filtered out of the batch after each step.
# * **llama.cpp's server** has no queue of sequences inside the batch: it has a fixed number of
#   slots (`-np`), each in a state (`SLOT_STATE_IDLE`, `SLOT_STATE_PROCESSING_PROMPT`,
#   `SLOT_STATE_GENERATING`, ...). A request takes an idle slot or waits in the task queue until
#   one is released; with continuous batching (`-cb`, on by default) the prompt tokens of new
#   slots and the next token of generating slots go into one `llama_batch` per iteration.
# * **TensorRT-LLM** calls the whole loop in-flight batching: requests join and leave the batch
#   at every iteration, the way Orca (Yu et al., OSDI '22) proposed under the name
#   iteration-level scheduling, instead of a batch forming and running to its end.
#
# ## Try it
#
# 1. **More rows.** Rerun the trace with `MAX_BATCH = 8`. Predict which requests stop waiting at
#    all; `mini_trace` must still equal the engine's trace, and the per-step table's largest
#    running count must be at most 8.
# 2. **Break the state machine.** In `mini_trace`, admit from the back of the queue
#    (`list(waiting)[::-1]`) instead of the front. The assert in section 2 fails; find in the
#    grid the first step where the two disagree and say why that is the first.
# 3. **Another leak.** Write a scheduler whose `finish` sets `seq.finish_reason` and frees the
#    blocks (`self.allocator.free(seq.block_table)`) but leaves the request in `running`, and run
#    it through `schedtrace.run_trace` as section 5 runs `ForgetsToFree`. Check: what catches it
#    is the one-state check, not the block check: `r00 is running and finished`, after step 5.

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
# # Day 29 — Preemption by recompute
#
# Day 28's reserve keeps admission from promising blocks that running sequences are about to
# need. It cannot stop the running sequences themselves from outgrowing the pool: every one of
# them takes another block each time its next token starts one, and a pool sized for the
# average load will, under a heavier one, have a decode step in which some sequence needs a
# block and none is free. That step cannot simply go ahead without it. Something running has
# to give its blocks up.
#
# nanoserve gives them up by recompute. `Scheduler._schedule_decode` serves the running
# sequences oldest first; when one needs a block and the free list is empty, it preempts the
# newest running sequence, the one with the largest `arrival`, and tries again.
# `Scheduler.preempt` frees the victim's whole block table, adds what it had computed to
# `recomputed_tokens`, sets its `num_computed` to 0 and puts it back at the front of the
# waiting queue. Its `token_ids` stay as they were, prompt and generated tokens together, so
# when it is admitted again all of them are prefilled as one long prompt and the step that
# finishes them samples the next token. The client never sees the interruption, only a pause.
#
# The runs below build the engine as of today with `engine_config(29, ...)` (prefill-first, the
# gather read of the pool, the model's own linears). The `Engine` that steps the scheduler is
# ahead of us: day 34 builds its API (`add_request`, `step`, `generate`).
#
# 1. a pool too small for eight requests: every preemption, and who was picked,
# 2. one preemption traced: the blocks, the queue, the counters, the readmission,
# 3. the same in a few lines of our own, equal to the package's in every step,
# 4. the tokens recomputed, counted two ways, and what the prefix cache gives back,
# 5. the tokens against a roomy pool's, on the tiny model and on SmolLM2,
# 6. a preemption that forgets the generated tokens, caught,
# 7. the diagram.

# %%
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, as_text, diagram_path, read_csv, tiny_llama
from nanoserve.bench import cpu_line
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Scheduler

sys.path.insert(0, str(REPO / "days" / "day29"))
sys.path.insert(0, str(REPO / "days" / "day26"))
import preemptbench  # the day's script: its workload, its traced run, the tables it wrote
import schedtrace  # day 26's tracer: a letter per request per step, and the invariants

torch.set_num_threads(1)  # the tiny model's steps are small; the machine is shared
tiny = tiny_llama(0, 0.05, 512)
T = preemptbench.TINY
REQS = preemptbench.tiny_workload(vocab=tiny.cfg.vocab_size)
print(cpu_line())
PROMPT_TOKENS, NEW_TOKENS = sum(len(p) for p, _ in REQS), sum(n for _, n in REQS)
print(f"{len(REQS)} requests, {PROMPT_TOKENS} prompt tokens, {NEW_TOKENS} to generate")
for i, (p, n) in enumerate(REQS):
    blocks = -(-(len(p) + n) // T["block_size"])
    print(f"  req-{i}: prompt {len(p):>2} tokens, {n} to generate: {blocks} blocks at the end")


def engine(blocks, caching=False):
    """The engine as of day 29 (prefill-first, 8 rows, budget 64) on `blocks` blocks of 4 tokens."""
    return preemptbench.engine_for(tiny, None, blocks, T["block_size"], T["max_model_len"], caching)


# %% [markdown]
# ## 1. A pool too small
#
# The eight requests would hold 79 blocks of 4 tokens between them at the end; the pool has
# 39. All eight are queued at once.
# `preemptbench.run` steps the engine to the end and records every preemption as it happens.

# %%
roomy = preemptbench.run(engine(T["roomy"]), REQS)
tight_engine = engine(T["blocks"])
tight = preemptbench.run(tight_engine, REQS)
print(f"roomy pool ({T['roomy']} blocks): {roomy.steps} steps, {len(roomy.preemptions)} preemptions")
print(f"tight pool ({tight_engine.allocator.num_blocks} blocks): {tight.steps} steps, "
      f"{len(tight.preemptions)} preemptions")  # fmt: skip
cols = ["step", "victim", "victim_arrival", "newest_arrival", "running", "computed", "prompt", "generated",
        "blocks_returned", "readmitted", "recompute_tokens"]  # fmt: skip
print(" ".join(f"{c:>15}" for c in cols))
for p in tight.preemptions:
    print(" ".join(f"{getattr(p, c):>15}" for c in cols))
assert all(p.victim_arrival == p.newest_arrival for p in tight.preemptions)
assert all(p.free_before == 0 for p in tight.preemptions)

# %% [markdown]
# Four preemptions, and each victim was the newest sequence running at that moment: `req-7`
# first, then, as the seven left kept growing, `req-6`, `req-5` and `req-4`. Each happened with
# the free list empty, and each gave back every block its sequence held, 6 to 10 of them.
#
# Why the newest? It is first come, first served carried through to the end: the requests that
# have waited longest keep running, and a later one gives way. It is also, usually, the cheapest
# to throw away, since it has had the fewest steps to compute anything, although not always
# here: `req-4` had computed 38 tokens when it went. And the newest is a victim that cannot
# starve the others: a preempted sequence keeps its `arrival`, so once it is readmitted it is
# older than anything that came after it, and the queue hands them back oldest first. The four
# came back in steps 22, 25, 30 and 33, in the order `req-4`, `req-5`, `req-6`, `req-7`, because
# each was put at the front of the queue, ahead of the one preempted before it.
#
# The same run through Day 26's tracer, which checks after every step that each request is in
# exactly one place and that the blocks used are the running tables' blocks:

# %%
traced_engine = engine(T["blocks"])
traced = schedtrace.run_trace(traced_engine, [(f"req-{i}", p, n, 0) for i, (p, n) in enumerate(REQS)])
print("\n".join(schedtrace.grid(traced, [(f"req-{i}", p, n, 0) for i, (p, n) in enumerate(REQS)])))
assert traced_engine.scheduler.num_preemptions == len(tight.preemptions)
assert [traced.outputs[f"req-{i}"] for i in range(len(REQS))] == tight.streamed

# %% [markdown]
# Read `req-7`'s line: it waits in step 0 (the first five prompts take the whole budget of 64
# tokens), gets its prompt chunk in step 1 and decode rows in steps 2 to 4, and is `W` again from
# step 5: waiting, holding nothing, until its readmission in step 33 (`P`) recomputes its prompt
# and the four tokens it had generated in one chunk. The invariants held at every one of
# the 45 steps, preemptions included.
#
# ## 2. One preemption, traced
#
# The first preemption, step by step: the engine is stepped by hand until the scheduler picks a
# victim, and the state around that moment is printed.

# %%
eng = engine(T["blocks"])
sched, alloc = eng.scheduler, eng.allocator
ids = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in REQS]
streamed = {i: [] for i in ids}
seen, real_preempt = {}, sched.preempt


def watched_preempt(seq):
    seen["before"] = {
        "running": [s.request_id for s in sched.running],
        "free": alloc.num_free,
        "victim blocks": list(seq.block_table.blocks),
        "victim tokens": len(seq.token_ids),
        "victim computed": seq.num_computed,
        "recomputed_tokens": sched.recomputed_tokens,
    }
    real_preempt(seq)
    seen["victim"] = seq


sched.preempt = watched_preempt
step = 0
while "victim" not in seen:
    for o in eng.step():
        streamed[o.request_id] += o.new_token_ids
    step += 1
sched.preempt = real_preempt
victim = seen["victim"]
print(f"preemption in step {step - 1}; before it:")
for k, v in seen["before"].items():
    print(f"   {k}: {v}")
print("after it:")
print(f"   running: {[s.request_id for s in sched.running]}")
print(f"   free: {alloc.num_free}, waiting: {[s.request_id for s in sched.waiting]}")
print(f"   {victim.request_id}: blocks {victim.block_table.blocks}, num_computed {victim.num_computed}, "
      f"tokens {len(victim.token_ids)} ({len(victim.prompt_ids)} prompt + "
      f"{len(victim.output_ids)} generated)")  # fmt: skip
print(f"   recomputed_tokens: {sched.recomputed_tokens}, num_preemptions: {victim.num_preemptions}")
print(f"   tokens streamed to {victim.request_id} so far: {streamed[victim.request_id]}")
assert sched.waiting[0] is victim and victim.block_table.blocks == [] and victim.num_computed == 0
# the victim's blocks came back, and the row that asked took one of them
assert alloc.num_free == seen["before"]["free"] + len(seen["before"]["victim blocks"]) - 1
assert len(victim.token_ids) == seen["before"]["victim tokens"]  # nothing generated is lost

# %% [markdown]
# In step 5 all eight requests were decoding and the free list was empty. The scheduler serves
# decode rows oldest first; the row that found no block triggered the preemption of `req-7`,
# which gave back its 6 blocks, and the row took one of them, leaving 5 free. `req-7` is at the
# front of the queue with no blocks and nothing computed, and all 24 of its tokens, 20 of prompt
# and the 4 it had already streamed to its client, are still in `token_ids`.
# `recomputed_tokens` went up by 23, what it had in the cache: every token but the newest,
# whose K/V the lost decode step would have written.
#
# Now to its readmission: the step that admits it again, and the step after.

# %%
chunks_of_victim, real_schedule = [], sched.schedule


def watched_schedule():
    batch = real_schedule()
    for seq, a, b in batch.chunks:
        if seq is victim:
            chunks_of_victim.append((step, a, b))
    return batch


sched.schedule = watched_schedule
while not chunks_of_victim or chunks_of_victim[-1][2] < seen["before"]["victim tokens"]:
    for o in eng.step():
        streamed[o.request_id] += o.new_token_ids
    step += 1
sched.schedule = real_schedule
print("its readmission chunks (step, start, end):", chunks_of_victim)
print(f"after step {step - 1}: num_computed {victim.num_computed}, tokens {len(victim.token_ids)}, "
      f"blocks {len(victim.block_table.blocks)}")  # fmt: skip
print("tokens streamed to it now:", streamed[victim.request_id])
while eng.has_unfinished():
    for o in eng.step():
        streamed[o.request_id] += o.new_token_ids
assert chunks_of_victim[0][1] == 0 and chunks_of_victim[-1][2] == 24
assert [streamed[i] for i in ids] == tight.streamed == roomy.streamed

# %% [markdown]
# Step 33 prefills `req-7`'s 24 tokens in one chunk, from position 0, into fresh blocks, and
# samples its fifth token from the last position's logits: the stream carries on from where it
# stopped, with nothing sent twice. Its tokens at the end equal the roomy pool's, as do every
# other request's.
#
# ## 3. The same in a few lines
#
# Preemption by recompute is eight lines of bookkeeping. A scheduler whose `preempt` is ours,
# run beside the package's on the same workload, must make the same choices at every step and
# stream the same tokens.


# %%
class OurPreempt(Scheduler):
    def preempt(self, seq):
        self.running.remove(seq)
        self.allocator.free(seq.block_table)  # every block back, tail first
        self.on_leave(seq)
        self.recomputed_tokens += seq.num_computed  # thrown away, to be computed again
        self.num_preemptions += 1
        seq.num_preemptions += 1
        seq.num_computed = 0  # its token_ids stay: prompt and generated alike
        self.waiting.appendleft(seq)  # first in line, ahead of everything that waited


ours_engine = engine(T["blocks"])
ours_engine.scheduler.__class__ = OurPreempt
ours = preemptbench.run(ours_engine, REQS)
assert [vars(p) for p in ours.preemptions] == [vars(p) for p in tight.preemptions]
assert ours.streamed == tight.streamed and ours.steps == tight.steps
assert ours.recomputed_tokens == tight.recomputed_tokens
print(f"{len(ours.preemptions)} preemptions, all equal field by field; {ours.steps} steps; the same tokens")

# %% [markdown]
# ## 4. The tokens recomputed
#
# The scheduler counts what preemption threw away, `recomputed_tokens`: the victims' computed
# tokens at the moment each was preempted. The run also recorded what each readmission actually
# computed, over all its chunks. With prefix caching off (as so far) the two differ by exactly
# one token per preemption, the newest token, which the lost decode step would have computed
# anyway:

# %%
thrown = sum(p.computed for p in tight.preemptions)
readmitted = sum(p.recompute_tokens for p in tight.preemptions)
print(f"thrown away: {thrown} (recomputed_tokens {tight.recomputed_tokens}); "
      f"computed on readmission: {readmitted}")  # fmt: skip
assert thrown == tight.recomputed_tokens and readmitted == thrown + len(tight.preemptions)
print(f"against {PROMPT_TOKENS + NEW_TOKENS} tokens the workload needs: "
      f"{thrown / (PROMPT_TOKENS + NEW_TOKENS):.0%} more work")  # fmt: skip

# %% [markdown]
# With prefix caching on, the engine's default, a freed block keeps its hash on the free list
# until someone takes it fresh (Day 19), and the victim's own full blocks are exactly the
# prefix its readmission asks for. If nobody has reused them in the meantime, the readmission
# starts past them:

# %%
cached = preemptbench.run(engine(T["blocks"], caching=True), REQS)
for p in cached.preemptions:
    print(f"   {p.victim}: {p.computed} thrown away, {p.recompute_tokens} computed on readmission "
          f"in step {p.readmitted}")  # fmt: skip
back = thrown + len(cached.preemptions) - sum(p.recompute_tokens for p in cached.preemptions)
print(f"recomputed_tokens {cached.recomputed_tokens}; computed on readmission "
      f"{sum(p.recompute_tokens for p in cached.preemptions)}; "
      f"{back} came back from the prefix cache")  # fmt: skip
assert cached.streamed == roomy.streamed and cached.recomputed_tokens == tight.recomputed_tokens

# %% [markdown]
# `req-4`, readmitted three steps after its preemption, found 28 of its 39 tokens (7 blocks)
# still cached and computed 11. The other three waited 11 steps or more (`req-5` from 14 to 25,
# `req-6` from 8 to 30, `req-7` from 5 to 33), and by then their blocks had been handed out
# again.
# So `recomputed_tokens` is what preemption threw away, an upper bound on what it costs; the
# prefix cache can make the bill smaller, never larger, and the tokens are the same either way.
#
# ## 5. The same tokens
#
# Recompute gives a sequence its K/V back from its tokens, so the tokens that follow must be
# those a roomy pool gives. They can differ only where batches of different shapes round a
# near-tie the other way, which `tests/test_engine.py` excuses when the reference's top two
# logits are within 1e-4 (`preemptbench.compare`, which raises on anything else):

# %%
for name, r in (("tight", tight), ("tight, prefix caching", cached)):
    equal, ties = preemptbench.compare(tiny, REQS, roomy.streamed, r.streamed)
    print(f"{name:>22}: {equal} of {len(REQS)} equal to the roomy pool's, near-ties excused: {ties}")

# %% [markdown]
# On SmolLM2-135M-Instruct the script ran eight chat prompts, 32 greedy tokens each, on a roomy
# pool and on one of 12 blocks of 16 tokens (`day-29-runs.csv`, with the tiny runs above):

# %%
runs = read_csv(preemptbench.HERE / "day-29-runs.csv")
facts = ["run", "kv_blocks", "block_size", "prefix_caching", "preemptions", "recomputed_tokens",
         "readmission_tokens", "steps", "same_as_roomy", "near_ties", "requests"]  # fmt: skip
print(" | ".join(facts))
for r in runs:
    print(" | ".join(r[c] for c in facts))
mine = {"tiny, roomy": roomy, "tiny, tight": tight, "tiny, tight, prefix caching": cached}
for r in runs[:3]:
    got = mine[r["run"]]
    assert (int(r["preemptions"]), int(r["recomputed_tokens"]), int(r["steps"])) == (
        len(got.preemptions), got.recomputed_tokens, got.steps)  # fmt: skip
assert all(int(r["same_as_roomy"]) + int(r["near_ties"]) == int(r["requests"]) for r in runs)
assert as_text([vars(p) for p in tight.preemptions]) == read_csv(preemptbench.HERE / "day-29-preemptions.csv")

# %%
# NBVAL_IGNORE_OUTPUT
for r in runs:
    print(f"{r['run']:>28}: {r['seconds']} s")

# %% [markdown]
# On SmolLM2 each conversation is 35 to 37 prompt tokens and ends at 5 blocks of 16, so the
# tight pool of 12 blocks (192 tokens, one whole context) has room for two of the eight at their
# full length: 3 preemptions, 161 tokens thrown away and 164 computed on
# readmission, and 103 steps where the roomy pool needed 36. All eight requests' 32 tokens equal
# the roomy pool's, with no near-tie to excuse. In time, one run each on one thread of a quiet
# machine, the tight run took 8.3 s against 3.3 s. The steps explain that gap, 103 against 36,
# each one reading all the weights for a few rows instead of eight; the tight run's steps are
# cheaper one by one, since they carry fewer rows, so its time grew less than its step count.
# Beside the steps, the 164 recomputed tokens are a small part.
#
# ## 6. A preemption that forgets the generated tokens
#
# The tempting simplification is to treat a preempted request as new: drop what it generated
# and recompute only its prompt. With greedy decoding it even regenerates the same tokens. What
# it cannot take back is what it already streamed: the client gets those tokens again, and then
# as many more as it asked for. The check of section 5 is run on it:


# %%
class ForgetsGenerated(Scheduler):
    def preempt(self, seq):
        super().preempt(seq)
        del seq.token_ids[len(seq.prompt_ids) :]  # back to the prompt alone


wrong_engine = engine(T["blocks"])
wrong_engine.scheduler.__class__ = ForgetsGenerated
wrong = preemptbench.run(wrong_engine, REQS)
try:
    preemptbench.compare(tiny, REQS, roomy.streamed, wrong.streamed)
    raise RuntimeError("the comparison passed on a preemption that forgets what it generated")
except AssertionError as e:
    print("caught:", str(e)[:160], "...")
print("tokens streamed per request:", [len(s) for s in wrong.streamed])
print("tokens asked per request:   ", [n for _, n in REQS])
print(f"steps {wrong.steps} against {tight.steps}; computed on readmission "
      f"{sum(p.recompute_tokens for p in wrong.preemptions)} against {readmitted}")  # fmt: skip

# %% [markdown]
# The four victims streamed 18, 13, 7 and 4 tokens twice over (`req-4` 45 tokens for the 27 it
# asked for). The run even looks cheaper, since each readmission computed only a prompt (75
# tokens instead of 117), and it paid for that with 9 more steps generating again what had been
# sent. The check catches it on the first request whose stream is longer than it asked.
#
# ## 7. The diagram

# %%
COLORS = {"W": "0.82", "P": "tab:orange", "D": "tab:blue", "r": "lightsteelblue"}
names = [f"req-{i}" for i in range(len(REQS))]
fig, axes = plt.subplots(2, 2, figsize=(15, 10), gridspec_kw={"hspace": 0.35, "wspace": 0.25})

ax = axes[0][0]
for y, rid in enumerate(names):
    for i, s in enumerate(traced.states):
        if s[rid] in COLORS:
            ax.barh(y, 1, left=i - 0.5, height=0.7, color=COLORS[s[rid]], edgecolor="white", linewidth=0.4)
for p in tight.preemptions:
    y = names.index(p.victim)
    ax.plot(p.step, y, "x", color="crimson", ms=12, mew=3)
    ax.barh(y, 1, left=p.readmitted - 0.5, height=0.7, color="crimson")
ax.set_yticks(range(len(names)), names)
ax.set_ylim(len(names) - 0.4, -0.6)
ax.set_xlabel("engine step")
ax.set_title(f"the tight pool ({tight_engine.allocator.num_blocks} blocks of 4): states per step")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
handles += [plt.Line2D([], [], marker="x", color="crimson", ls="", ms=10, mew=3),
            plt.Rectangle((0, 0), 1, 1, color="crimson")]  # fmt: skip
ax.legend(handles, ["waiting", "prompt chunk", "decode row", "running, idle", "preempted", "recompute chunk"],
          fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=6)  # fmt: skip

ax = axes[0][1]
pool_blocks = tight_engine.allocator.num_blocks
free_at_start = [pool_blocks] + [pool_blocks - u for u in traced.blocks_used[:-1]]
ax.plot(range(len(free_at_start)), free_at_start, color="tab:blue", drawstyle="steps-mid",
        label="free blocks when the step is scheduled")  # fmt: skip
for p in tight.preemptions:
    ax.annotate(f"{p.victim}\n-{p.blocks_returned}", (p.step, 0), xytext=(p.step, 6 + p.blocks_returned),
                ha="center", fontsize=8, arrowprops={"arrowstyle": "->", "color": "crimson"})  # fmt: skip
ax.set_xlabel("engine step")
ax.set_ylabel("free blocks")
ax.set_title("every preemption came with an empty free list")
ax.legend(fontsize=8)

ax = axes[1][0]
x = range(len(tight.preemptions))
ax.bar([i - 0.27 for i in x], [p.computed for p in tight.preemptions], 0.27, color="tab:red",
       label="thrown away (recomputed_tokens)")  # fmt: skip
ax.bar(list(x), [p.recompute_tokens for p in tight.preemptions], 0.27, color="tab:orange",
       label="computed on readmission, prefix caching off")  # fmt: skip
ax.bar([i + 0.27 for i in x], [p.recompute_tokens for p in cached.preemptions], 0.27, color="tab:green",
       label="computed on readmission, prefix caching on")  # fmt: skip
ax.set_xticks(list(x), [f"{p.victim}\n(step {p.step})" for p in tight.preemptions])
ax.set_ylabel("tokens")
ax.set_title("what each preemption cost")
ax.legend(fontsize=8)

ax = axes[1][1]
x = range(len(REQS))
ax.bar([i - 0.2 for i in x], [len(s) for s in tight.streamed], 0.4, color="tab:blue",
       label="recompute (the engine)")  # fmt: skip
ax.bar([i + 0.2 for i in x], [len(s) for s in wrong.streamed], 0.4, color="tab:red", label="ForgetsGenerated")
ax.plot(list(x), [n for _, n in REQS], "k_", ms=30, mew=2, label="max_tokens asked")
ax.set_xticks(list(x), names)
ax.set_ylabel("tokens streamed to the client")
ax.set_title("forgetting the generated tokens streams them twice")
ax.legend(fontsize=8)

fig.suptitle("Day 29: the newest running sequence gives its blocks back and is recomputed from its tokens",
             fontsize=14)  # fmt: skip
png = diagram_path("day29-preemption.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM**'s V1 scheduler (`vllm/v1/core/sched/scheduler.py`) does what today's engine does.
#   While it schedules the running requests, a failed `kv_cache_manager.allocate_slots` makes it
#   preempt: under first-come-first-served it pops the last request of `self.running`, the most
#   recently scheduled, and under the priority policy the one with the largest `(priority,
#   arrival_time)`. `_preempt_request` frees its blocks, sets `num_computed_tokens` to 0, marks it
#   `PREEMPTED`, counts `num_preemptions` and puts it at the front of the waiting queue; when it
#   is scheduled again, the tokens to compute are `num_tokens - num_computed_tokens`, prompt and
#   output together. With prefix caching on, its freed blocks can be found again by hash, as
#   in section 4.
# * **vLLM V0** (`vllm/core/scheduler.py`) had two modes, `PreemptionMode.RECOMPUTE` and
#   `PreemptionMode.SWAP`: swapping copied the victim's blocks to a CPU pool (`swap_space`) and
#   back. Recompute was the default for a request with one sequence; swap was kept for groups of
#   several (beam search, parallel sampling), whose shared blocks would all have to be
#   recomputed. V1 dropped swapping. The vLLM paper (Kwon et al., SOSP '23) measured both and
#   found recompute no slower than swapping for small blocks, since a GPU prefill is fast and a
#   PCIe copy of many small blocks is not.
# * **SGLang** calls it retraction: when a decode batch will not fit (`check_decode_mem`),
#   `ScheduleBatch.retract_decode` sorts the running requests by how many tokens they have
#   generated and how long their prompts are, retracts from the end of that order until the next
#   steps fit, and raises `new_token_ratio` so the next admissions are more careful; the retracted
#   requests go back to the waiting queue, and the radix cache keeps what it can of their prefix.
# * **TensorRT-LLM**'s `GUARANTEED_NO_EVICT` capacity policy avoids preemption altogether by
#   reserving each request's whole output up front; `MAX_UTILIZATION` admits more and pauses
#   requests when the cache runs out, to resume them later.
#
# ## Try it
#
# 1. **Preempt the oldest.** Copy `Scheduler._schedule_decode` into a subclass and pick the
#    victim with `min` instead of `max` by arrival; the oldest has already been given its slots
#    in this step, so also take the victim out of `batch.decode` if it is there. The tokens must
#    still equal the roomy pool's (`preemptbench.compare`); then compare its preemptions, tokens
#    thrown away and steps with section 1's 4, 113 and 45. Which of the three got better, and why
#    are the others worse?
# 2. **A smaller pool.** Rerun section 1 with `preemptbench.engine_for(tiny, None, 32, 4, 96)` (a
#    pool must hold one whole context, so the context drops to 96). Predict which request is
#    preempted first and in which step; then check that `preemptbench.compare` still passes and
#    that Day 26's invariants still hold in `schedtrace.run_trace`.
# 3. **Forget the counter.** Remove the `recomputed_tokens` line from `OurPreempt`: which assert
#    of section 3 fails first?

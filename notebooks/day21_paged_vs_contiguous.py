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
# # Day 21 — Paged against contiguous: memory and speed
#
# Day 11's cache gave one sequence a K and a V tensor per layer, long enough for the longest
# the sequence might become, reserved before its first token. Days 13 to 20 replaced it with
# one pool of small blocks shared by every sequence: a sequence holds only the blocks its
# tokens have filled, takes one more when it crosses into the next, and gives them all back
# when it ends. Phase 2 closes by putting the two side by side on the same requests.
#
# Two questions. Memory: for a batch of requests of mixed lengths, how many bytes does each
# way hold over the run, against the bytes of K/V actually written? Speed: how many tokens a
# second does each way generate for the same requests? Day 11's cache serves one sequence, so
# it runs them one after another; the paged engine runs them one after another too (paging
# alone) and all in one batch (what paging makes room for). The tokens must be the same
# every way. The paged side runs through `Engine`, whose API (`add_request`, `step`) day 34
# builds; putting several requests in one step is batching, which days 22 to 27 build.
#
# 1. the requests, and the bytes each way holds, worked out by hand for the first step,
# 2. memory over the whole run (`pagedbench.memory_rows` over the engine's steps),
# 3. why not reserve less: a contiguous cache sized for the average request, and the gate
#    that refuses it,
# 4. speed on the tiny model, three ways, with equal tokens asserted,
# 5. the script's run on SmolLM2-135M (`days/day21/pagedbench.py`): the day's table,
# 6. the diagram.

# %%
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv, tiny_llama
from nanoserve.bench import cpu_line

sys.path.insert(0, str(REPO / "days" / "day21"))
import pagedbench  # the day's script: the notebook runs it on the tiny model, reads its SmolLM2 run

# One thread: on a machine shared with other jobs two threads that wait for each other at every
# op slow down far more than one, and the tiny model's ops are too small to split anyway.
torch.set_num_threads(1)
tiny = tiny_llama(0)
cfg = tiny.cfg
size = pagedbench.TINY
reqs = pagedbench.workload(size["requests"], size["prompt"], size["new"], cfg.vocab_size, seed=0)
MAX_LEN, BS = size["max_len"], pagedbench.BLOCK_SIZE
print(f"{len(reqs)} requests; max length {MAX_LEN}; blocks of {BS}")
for i, (prompt, n) in enumerate(reqs):
    print(f"  request {i}: prompt {len(prompt):>2} tokens, {n:>2} to generate")


# %% [markdown]
# ## 1. The bytes, by hand
#
# One token's K/V is K and V, every layer, every K/V head, head_dim fp32 numbers: for the tiny
# Llama 2 x 2 layers x 2 heads x 16 x 4 bytes. A contiguous cache holds max length x that per
# request, used or not; Day 11's `decode_loop` would size it at the request's own prompt plus
# budget instead, which assumes the server knows the budget and never lets a request run past
# it. The paged engine holds whole blocks of 16 tokens, as many as each sequence has filled.
# After the first step, which computes every prompt:

# %%
per_token = cfg.kv_bytes_per_token(torch.float32)
assert per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 == 512
prompts = [len(p) for p, _ in reqs]
by_hand = {
    "K/V written": sum(prompts) * per_token,
    "contiguous, max length": len(reqs) * MAX_LEN * per_token,
    "contiguous, prompt + max_tokens": sum(len(p) + n for p, n in reqs) * per_token,
    "paged blocks": sum(-(-p // BS) for p in prompts) * BS * per_token,
}
for name, nbytes in by_hand.items():
    print(f"{name:<32} {nbytes:>9,} bytes")

# %% [markdown]
# ## 2. Over the whole run
#
# `pagedbench.table` runs the requests every way (section 4 times them), and on the engine's
# batched run records after every step what each running sequence has computed and how many
# blocks the allocator holds; `memory_rows` turns that into the four ways' bytes per step, their
# peak and mean, and the mean against the bytes written. Step 1 must be section 1's numbers:

# %%
t0 = time.perf_counter()
rows, series = pagedbench.table(tiny, reqs, MAX_LEN)
print(f"three ways, {len(series['paged blocks'])} batched steps, in {time.perf_counter() - t0:.1f} s")
assert {name: values[0] for name, values in series.items()} == by_hand
memory = [r for r in rows if r["kv_mean_mb"] != "" and r["rows"] == len(reqs)]
print(" | ".join(["variant", "kv_peak_mb", "kv_mean_mb", "mean_vs_written"]))
for r in memory:
    print(" | ".join(str(r[c]) for c in ["variant", "kv_peak_mb", "kv_mean_mb", "mean_vs_written"]))

# %% [markdown]
# On average over the run the contiguous caches reserved at max length held 4.15 times the
# bytes written, and sized to each request's own budget 1.29 times; the paged pool held 1.12
# times. The paged pool's excess is at most one partly filled block per running sequence,
# fewer than 16 positions, whatever the request's length. The contiguous cache's excess is the
# whole unused rest of its reservation, and a reservation at the request's own budget pays it
# for the positions not yet generated: at the start of the run, the whole budget.
#
# ## 3. Why not reserve less
#
# The contiguous way's waste comes from reserving for the longest a request may grow. Reserve
# for the average instead and the memory looks better, until a request longer than the average
# comes. Day 11's cache has a gate for that moment: `begin` refuses a step that would write
# past the end. The planted version reserves every request at the mean of prompt + budget:

# %%
mean_len = sum(len(p) + n for p, n in reqs) // len(reqs)
print(f"mean prompt + budget: {mean_len} positions, against a max length of {MAX_LEN}")
try:
    pagedbench.run_contiguous(tiny, reqs, max_len=mean_len)
except ValueError as err:
    print("contiguous cache at the mean length caught:", err)
else:
    raise RuntimeError("a request longer than its reservation should have been refused")

# %% [markdown]
# The first request longer than the mean is refused at the step that would overflow, and a
# server reserving that way would have to fail the request or copy its cache into a larger one.
# The paged engine has no such moment: a sequence that grows takes one more block, and a pool
# that runs dry preempts (Day 29) rather than writing anywhere it should not.
#
# ## 4. Speed, three ways
#
# The same requests, greedy with end-of-sequence ignored so each runs its whole budget:
# Day 11's loop on a contiguous cache at max length, one request after another; the engine with
# `max_batch=1`, one after another; the engine with all of them in one batch. `table` asserted
# that all three gave the same tokens. `decode_tok_s` counts only steps that decode. The times
# are this run's, on one thread of a shared machine:

# %%
speed = [r for r in rows if r["tokens"] != ""]
tokens = {r["tokens"] for r in speed}
print(f"tokens generated by each way: {tokens.pop()} (the same tokens, asserted)")
assert not tokens

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
base = next(r for r in speed if r["variant"] == "contiguous, one at a time")
for r in speed:
    print(
        f"{r['variant']:<27} {r['seconds']:6.2f} s  {r['tok_s']:8.1f} tok/s  "
        f"decode {r['decode_tok_s']:8.1f} tok/s  ({r['tok_s'] / base['tok_s']:.2f}x the contiguous loop)"
    )

# %% [markdown]
# On this tiny model a step costs little more than its Python and kernel-launch overhead
# (Day 49). The two one-at-a-time ways differ only in that overhead, the engine's scheduler and
# plan against Day 11's bare loop, and on a shared machine which of them is ahead moves from
# run to run. The batch does 8 rows a step for not much more than the price of one, and comes
# out several times ahead. The printed ratios are this run's.
#
# ## 5. On SmolLM2-135M
#
# The script runs the same comparison on the real model (fp32, one thread): 16 requests,
# prompts of 16 to 256 tokens, budgets of 16 to 128, a max length of 2,048, every way twice in
# turn, keeping each one's faster run. Its table, read back (`day-21-paged.csv`):

# %%
committed = read_csv(pagedbench.CSV_PAGED)
print(" | ".join(committed[0]))
for r in committed:
    print(" | ".join(r.values()))
trace = read_csv(pagedbench.CSV_TRACE)
REAL = pagedbench.REAL
real = pagedbench.workload(REAL["requests"], REAL["prompt"], REAL["new"], vocab=49152, seed=0)
assert int(next(r for r in committed if r["tokens"])["tokens"]) == sum(n for _, n in real)

# %% [markdown]
# Memory, over the batched run of 16 requests: the K/V actually written peaked at 117.458 MB;
# contiguous caches reserved at 2,048 positions held 1,509.949 MB from the first step (16 x
# 94.372 MB) and on average 11.73 times the bytes written; sized to each request's own budget
# they held 1.25 times; the paged pool's blocks 1.04 times, 122.388 MB at the peak. At
# SmolLM2's own context of 8,192 positions the contiguous reservation would be four times
# larger again, while the blocks would not change.
#
# Speed, 1,026 generated tokens every way, the same tokens: one at a time, the paged engine and
# Day 11's loop ran at about the same rate, 23.5 and 24.2 tokens a second (26.6 and 27.6 in
# decode steps), so paging itself costs little at batch 1. The batch is what pays: 62.3 tokens
# a second over the whole run and 91.3 in decode steps, against the contiguous loop's 24.2 and
# 27.6. The run had the machine to itself; the ratios come from the ways run in turn. The
# batch is the point of the pool: contiguous reservations at 2,048 positions for these 16
# requests would need 1.5 GB
# before the first token, the pool never held more than 122 MB.
#
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
styles = {
    "K/V written": ("black", "-"),
    "contiguous, max length": ("tab:red", "-"),
    "contiguous, prompt + max_tokens": ("tab:orange", "--"),
    "paged blocks": ("tab:green", "-"),
}

ax = axes[0, 0]
for name, values in series.items():
    color, ls = styles[name]
    ax.plot(range(1, len(values) + 1), [v / 1e6 for v in values], color=color, ls=ls, label=name)
ax.set_xlabel("engine step (all 8 requests in one batch)")
ax.set_ylabel("K/V held (MB, fp32)")
ax.set_title(f"Tiny Llama, {len(reqs)} requests: memory over the run (this notebook)")
ax.legend(fontsize=8)

ax = axes[0, 1]
for name in styles:
    color, ls = styles[name]
    held = [(int(r["step"]), float(r[name])) for r in trace if float(r[name]) > 0]  # log axis: no zeros
    ax.plot(*zip(*held), color=color, ls=ls, label=name)
ax.set_xlabel(f"engine step (all {REAL['requests']} requests in one batch)")
ax.set_ylabel("K/V held (MB, fp32)")
ax.set_yscale("log")
ax.set_title("SmolLM2-135M, 16 requests: memory over the run (day-21-trace.csv)")
ax.legend(fontsize=8)

ax = axes[1, 0]
per_tok = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M, fp32
x = range(len(real))
ax.bar([i - 0.3 for i in x], [REAL["max_len"] * per_tok / 1e6] * len(real), 0.3, color="tab:red",
       label=f"contiguous, max length ({REAL['max_len']})")  # fmt: skip
ax.bar(list(x), [(len(p) + n) * per_tok / 1e6 for p, n in real], 0.3, color="tab:orange",
       label="contiguous, prompt + max_tokens")  # fmt: skip
ax.bar([i + 0.3 for i in x], [-(-(len(p) + n) // BS) * BS * per_tok / 1e6 for p, n in real], 0.3,
       color="tab:green", label="paged: its blocks at the end")  # fmt: skip
ax.set_xlabel("request of the SmolLM2 workload")
ax.set_ylabel("MB reserved or held for the request (log)")
ax.set_yscale("log")
ax.set_ylim(1, 400)
ax.set_title("Per request: a reservation against its blocks")
ax.legend(fontsize=8, loc="upper center", ncols=2)

ax = axes[1, 1]
ways = [r for r in committed if r["tokens"]]
names = [r["variant"] for r in ways]
pos = range(len(ways))
ax.bar(
    [i - 0.2 for i in pos],
    [float(r["tok_s"]) for r in ways],
    0.4,
    color="tab:blue",
    label="tokens/s, all steps",
)
ax.bar([i + 0.2 for i in pos], [float(r["decode_tok_s"]) for r in ways], 0.4, color="tab:cyan",
       label="tokens/s, decode steps")  # fmt: skip
for i, r in enumerate(ways):
    ax.text(i, float(r["decode_tok_s"]) * 1.02, f"{r['tok_s']} / {r['decode_tok_s']}",
            ha="center", fontsize=8)  # fmt: skip
ax.set_xticks(list(pos), [n.replace(", ", ",\n") for n in names])
ax.set_ylabel("generated tokens a second")
ax.set_title("SmolLM2-135M: the 16 requests three ways (day-21-paged.csv)")
ax.legend(fontsize=8)

fig.suptitle("Day 21: the paged pool against contiguous caches, same requests (fp32, CPU)", fontsize=14)
fig.tight_layout()
png = diagram_path("day21-paged-vs-contiguous.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## 7. Phase 2, from its first day to its last
#
# Phase 2 (days 13-21) replaced the cache that reserves a whole context per request with a pool
# of blocks: day 13 measured what the reservation wastes, days 14-17 built the allocator, the
# block tables, the pool's plan and the paged write, day 18 the paged read, day 19 prefix
# sharing, day 20 eviction and copy-on-write, and today put the two caches side by side. The
# committed CSVs of days 13, 19 and 21, first to last:

# %%
waste = {r["policy"]: r for r in read_csv(REPO / "days" / "day13" / "day-13-waste.csv")}
print(
    f"day 13: slots reserved and never written: {waste['max_len']['wasted_pct']}% reserving the "
    f"model's length, {waste['prompt+max_tokens']['wasted_pct']}% reserving prompt + max_tokens, "
    f"{waste['paged16']['wasted_pct']}% in blocks of 16"
)
chat = read_csv(REPO / "days" / "day19" / "day-19-chat.csv")
cached, prompt = sum(int(r["cached_tokens"]) for r in chat), sum(int(r["prompt_tokens"]) for r in chat)
print(f"day 19: {cached} of {prompt} prompt tokens over {len(chat)} chat turns came from the prefix cache")
runs = {r["variant"]: r for r in committed}
print(
    f"day 21: 16 rows' K/V at its peak: {runs['contiguous, max length']['kv_peak_mb']} MB reserved "
    f"contiguously, {runs['paged blocks']['kv_peak_mb']} MB in blocks, "
    f"{runs['K/V written']['kv_peak_mb']} MB written"
)
print(
    f"day 21: the same requests one at a time {runs['paged, one at a time']['tok_s']} tok/s, "
    f"in one paged batch {runs['paged, one batch']['tok_s']} tok/s"
)
assert float(waste["paged16"]["wasted_pct"]) < float(waste["prompt+max_tokens"]["wasted_pct"])

# %% [markdown]
# The pool holds what is written, to within a block a request, and any request can use any
# block. What it does not decide is who runs: the batch of section 5 was formed by hand. Phase 3
# builds the scheduler that forms it, step by step, starting tomorrow from the simplest batch.

# %% [markdown]
# ## In the real systems
#
# * **vLLM** was built on today's comparison. The PagedAttention paper (Kwon et al., SOSP 2023)
#   measured that serving systems which reserved a contiguous K/V region per request, sized for
#   its maximum length, kept only roughly 20 to 40 percent of that memory holding tokens, and
#   put the rest down to reservation and fragmentation. vLLM sizes one pool for everything:
#   `Worker.determine_available_memory` (`vllm/v1/worker/gpu_worker.py`) runs a profiling
#   forward at the largest batch, and the memory left under `--gpu-memory-utilization` (a
#   fraction of the GPU: 0.9 by default in most releases, 0.92 in the current docs) after the
#   weights and that peak becomes KV blocks; `reshape_and_cache` (`csrc/cache_kernels.cu`)
#   writes each step's K/V into them by slot mapping, as Day 17's `index_put_` does, and
#   `vllm:kv_cache_usage_perc` reports the share of blocks in use.
# * **llama.cpp** reserves like Day 11 but for the whole server: `-c` sets the context, the
#   number of KV cells allocated up front, and `-np` splits it among parallel slots, each slot
#   limited to its share unless the cells are pooled (`--kv-unified`), in which case any slot's
#   sequence can take any free cell, one token at a time. So a slot is a contiguous-style
#   reservation, and the unified cache is a pool with a block size of one cell.
# * **TensorRT-LLM** sizes its paged pool from `KvCacheConfig(free_gpu_memory_fraction=...)` or
#   an explicit `max_tokens`, in blocks of `tokens_per_block` (32 by default in its docs), and
#   its scheduler admits requests by the blocks they need.
# * **transformers** keeps both of Day 11's ways: `DynamicCache` grows by concatenation, and
#   `StaticCache` reserves `max_cache_len` positions for every batch row up front, which is
#   today's "contiguous, max length" row, chosen there because fixed shapes compile.
#
# ## Try it
#
# 1. **Blocks of one token.** Set `BLOCK_SIZE = 1` in the script and rerun it with `--tiny
#    --out /tmp/t.csv --out-trace /tmp/tt.csv`: the `paged blocks` row must then equal the
#    `K/V written` row (mean_vs_written 1.0). What does a block of one token cost elsewhere
#    (the block table's length, Day 15; the allocator's work per token, Day 14)?
# 2. **Reserve at the budget, honestly.** Section 3 reserved at the mean and was refused. Find the
#    smallest single reservation that serves every tiny request (`max(len(p) + n for p, n in
#    reqs)`), run `pagedbench.run_contiguous` with it, and check its tokens against the engine's;
#    then compute what that reservation costs for all 8 requests at once against `paged blocks`.
# 3. **Break the equality on purpose.** Give the batched engine `max_num_batched_tokens=16`
#    (chunked prefill, Day 30) in `paged_engine` and rerun the tiny table: the tokens must still
#    be equal (the script's assert), and `decode_tok_s` of the batch must change. Then make one
#    request's `SamplingParams` use `temperature=1.0` only in the engine runs and watch the
#    script's token check fail, naming the request.

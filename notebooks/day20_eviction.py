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
# # Day 20 — Eviction and reuse
#
# Yesterday a finished sequence's full blocks stayed on file under their names, and a later
# prompt with the same prefix took them back. Nothing wipes a block when its last owner lets
# go of it: it joins the free list with its K/V and its name, and it stays reusable until the
# allocator hands it out fresh to somebody else. So the free list is two things at once, the
# pool's spare room and the prefix cache's contents, and the order in which it gives blocks
# away is the cache's eviction policy.
#
# Sharing raises the other question of the day. Two sequences hold the same block; each goes on
# to write its own next tokens. Operating systems share pages that way and copy a page the
# moment one owner writes to it (copy-on-write). The engine never needs the copy, and the
# reason is a rule it keeps everywhere: only full blocks are shared.
#
# 1. the free list in order: who is handed out first, a prompt claiming freed blocks back, and
#    why a table is freed tail first,
# 2. a shared block when one owner finishes,
# 3. why no copy-on-write: two samples of one prompt, stepped by hand, sharing full blocks and
#    writing into their own,
# 4. a planted share of a partial block, and the gates that catch it,
# 5. a workload under pressure: blocks reused and recomputed as the pool shrinks, least
#    recently freed first against most recently freed first (`days/day20/evictbench.py`),
# 6. the diagram.

# %%
import random
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv, recording_cache, tiny_llama
from nanoserve.blocks import BlockAllocator, BlockTable, block_hashes
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.plan import plan_prefill
from nanoserve.sampling import SamplingParams, sample
from nanoserve.scheduler import Sequence

sys.path.insert(0, str(REPO / "days" / "day20"))
import evictbench  # the day's script: the notebook runs its workload and reads its table

# One thread: nothing here is timed, and on a machine shared with other jobs two threads that
# wait for each other at every op slow down far more than one.
torch.set_num_threads(1)
rng = random.Random(20)
draw = lambda n: [rng.randrange(256) for _ in range(n)]  # noqa: E731

# %% [markdown]
# ## 1. The free list, in order
#
# Twelve blocks of 4 tokens. Two prompts run and finish: a (10 tokens: two full blocks and a
# partial one) and b (9 tokens, the same shape). The allocator's free list is an ordered dict,
# front to back in the order blocks were freed; fresh blocks come off the front. `names` says,
# for each prompt's full blocks, which block is still filed under that name.

# %%
alloc = BlockAllocator(num_blocks=12, block_size=4)
a, b = draw(10), draw(9)
names = lambda tokens: [alloc.cached_block(h) for h in block_hashes(tokens, 4)]  # noqa: E731
timeline = []  # (event, free list front to back, blocks still named) for the diagram


def note(event):
    free = list(alloc._free)
    timeline.append((event, free, {blk for blk in names(a) + names(b) if blk is not None}))
    print(f"{event:<34} free list {free}   a's names -> {names(a)}, b's -> {names(b)}")


ta, tb = BlockTable(4), BlockTable(4)
for table, tokens in ((ta, a), (tb, b)):
    alloc.allocate_prompt(table, tokens)
    alloc.cache_full_blocks(table, tokens)  # the K/V is written: the full blocks get their names
print("a's table", ta.blocks, " b's table", tb.blocks)
note("a and b computed")
alloc.free(ta)
note("a finished")
alloc.free(tb)
note("b finished")
assert list(alloc._free) == [6, 7, 8, 9, 10, 11, 2, 1, 0, 5, 4, 3]

# %% [markdown]
# Each table went to the back of the list, and tail first: a's partial block 2, then block 1,
# then its head, block 0. Now two unrelated prompts arrive: c needs six blocks and gets the six
# never used; d needs two and gets the next two from the front, a's partial block (no name,
# nothing lost) and a's block 1, whose name is dropped as it is handed out: an eviction.

# %%
tc, td = BlockTable(4), BlockTable(4)
alloc.allocate_prompt(tc, draw(24))
note("c admitted (6 blocks)")
alloc.allocate_prompt(td, draw(8))
note("d admitted (2 blocks)")
print("c's table", tc.blocks, " d's table", td.blocks)
assert td.blocks == [2, 1] and names(a) == [0, None] and names(b) == [3, 4]

# %% [markdown]
# a's head is still named, so a prompt starting with a's first 4 tokens would still find them;
# one starting with a's first 8 finds the same 4 and no more, because a chained lookup stops at
# the first name it does not hold. Now e arrives with b's first 8 tokens and one more. Its two
# cached blocks are claimed back from the back of the free list, where they were waiting, and
# its one fresh block comes off the front: a's head, freed longest ago.

# %%
te = BlockTable(4)
e = b[:8] + draw(1)
print("e cached:", alloc.allocate_prompt(te, e), "tokens; table", te.blocks)
print("ref counts of e's blocks:", [alloc.ref_count(blk) for blk in te.blocks])
note("e admitted (b's prefix)")
alloc.check_invariants([tc, td, te])
assert te.blocks == [3, 4, 0] and te.num_cached_tokens == 8 and names(a) == [None, None]

# %% [markdown]
# Least recently freed first is a queue: the block that has gone longest without anyone asking
# for it goes first, and anything claimed back leaves the queue wherever it stands. The tail
# first rule decides the order within one table. A chained prefix is only as useful as its
# head: without block 0, blocks 1 and 2 can never be hit. Freeing the tail first puts the head
# at the back, so the tail is evicted first and the head survives longest. A variant that
# frees head first, replaying the same events up to d:


# %%
class HeadFirst(BlockAllocator):
    """The variant: a finished table's blocks join the free list head first."""

    def free(self, table):
        for blk in table.blocks:
            self._release(blk)
        table.blocks, table.hashes = [], []
        table.num_tokens = table.num_cached_tokens = 0


def replay(cls):
    """a and b computed and finished, then c (6 blocks) and d (2): how much of a is still named."""
    pool = cls(num_blocks=12, block_size=4)
    tables = [BlockTable(4), BlockTable(4)]
    for table, tokens in zip(tables, (a, b)):
        pool.allocate_prompt(table, tokens)
        pool.cache_full_blocks(table, tokens)
    for table in tables:
        pool.free(table)
    for n in (24, 8):
        pool.allocate_prompt(BlockTable(4), list(range(n)))
    held = [pool.cached_block(h) for h in block_hashes(a, 4)]
    return list(pool._free), held


for cls in (BlockAllocator, HeadFirst):
    free, held = replay(cls)
    usable = next((i for i, blk in enumerate(held) if blk is None), len(held)) * 4
    print(f"{cls.__name__:<15} free list after d {free}; a's names {held}: ", end="")
    print(f"a prompt on a's prefix finds {usable}")
assert replay(BlockAllocator)[1] == [0, None] and replay(HeadFirst)[1] == [None, None]

# %% [markdown]
# Head first, d's two blocks were a's two named ones, and a's whole prefix is gone; a's partial
# block, worth nothing to anyone, survives. Tail first, d took the partial block and one named
# block, and a's head is still there to be found.
#
# ## 2. A shared block when one owner finishes
#
# From here on the model runs: the tiny random-weight Llama (`nanocourse.tiny_llama`, 2
# layers, head dim 16) over a paged pool of 64 blocks of 4 tokens, stepped by hand. Two samples
# of one 14-token prompt go in, the way `n` samples of a request do. Step 1 computes sample a's
# prompt and files its full blocks; from step 2 on, a step holds a decode row for every running
# sample, and step 2 also holds b's prompt, which by then finds a's full blocks. (Choosing who
# runs in a step is the scheduler's job, which day 26 builds, and rows of several sequences in
# one step are batching, days 22 to 27; here `samples` writes the order out.) Sample a stops
# after 4 tokens, sample b after 10. After every step the cell notes both tables and the ref
# counts.

# %%
tiny = tiny_llama(0)
prompt = draw(14)
params = {
    "a": SamplingParams(max_tokens=4, temperature=1.0, seed=1, ignore_eos=True),
    "b": SamplingParams(max_tokens=10, temperature=1.0, seed=2, ignore_eos=True),
}


@torch.inference_mode()
def samples(alloc, names=("a", "b"), on_plan=None):
    """Step the samples to the end over `alloc`'s pool: one sample's prompt joins per step (a
    first), beside a decode row for each sample already running. Returns the tokens by name,
    each sample's block table as of the last step it ran in, the ref counts of blocks 0-5 after
    every step, and the pool. `on_plan(alloc, plan)` sees every step's plan before the model
    runs it."""
    cache = BatchedPagedKVCache(tiny.cfg, alloc.num_blocks * 4, attention="gather")
    waiting, running, gens = list(names), [], {}
    out, tables, steps = {name: [] for name in names}, {}, []
    while waiting or running:
        chunks = []
        for seq in running:  # its newest token, at position len - 1
            alloc.append_slots(seq.block_table, len(seq.token_ids))
            chunks.append((seq, len(seq.token_ids) - 1, len(seq.token_ids)))
        if waiting:  # the next sample's prompt, past the blocks the prefix cache hands it
            name = waiting.pop(0)
            seq = Sequence(name, list(prompt), params[name], 4)
            cached = alloc.allocate_prompt(seq.block_table, seq.token_ids)
            gens[name] = params[name].make_generator()
            chunks.append((seq, cached, len(prompt)))
            running.append(seq)
        plan = plan_prefill(chunks, 4)
        for seq, _, _ in chunks:
            tables[seq.request_id] = list(seq.block_table.blocks)
        if on_plan is not None:
            on_plan(alloc, plan)
        logits = tiny(plan.input_ids, plan.positions, cache.view(plan), logits_at=plan.logits_at)
        for row, (seq, _, end) in enumerate(chunks):
            name = seq.request_id
            alloc.cache_full_blocks(seq.block_table, seq.token_ids, upto=end)  # K/V written to `end`
            token = int(sample(logits[row : row + 1], [seq.params], [gens[name]])[0])
            seq.token_ids.append(token)
            out[name].append(token)
            if len(out[name]) == seq.params.max_tokens:  # done: its last token's K/V is never computed
                alloc.free(seq.block_table)
                running.remove(seq)
        steps.append([alloc.ref_count(blk) for blk in range(6)])
    return out, tables, steps, cache


alone = {name: samples(BlockAllocator(64, 4), (name,))[0][name] for name in ("a", "b")}
out, tables, steps, _ = samples(BlockAllocator(64, 4))
print("tables:", tables)
for i, counts in enumerate(steps, start=1):
    print(f"after step {i:>2}: ref counts of blocks 0-5 {counts}")
print("tokens equal to each sample run alone:", out == alone)
assert tables["a"][:3] == tables["b"][:3] and tables["a"][3] != tables["b"][3] and out == alone
steps_story = steps  # for the diagram

# %% [markdown]
# Step 1 computes a's prompt into blocks 0 to 3, one owner each. Step 2 admits b, which finds
# a's three full blocks (ref count 2) and takes block 4 for its partial tail, recomputing
# positions 12 and 13 there, while a writes its position 14 into the free slots of its own
# block 3. In step 4 a writes position 16 into a new block 5, samples its fourth token and is
# done: the shared blocks fall to one owner and stay where they are, in b's table and off the
# free list, while a's own blocks 3 and 5 go to the back of the free list. b carries on in
# fresh blocks 6 and 7 (the free list's front holds blocks never used yet, ahead of a's). Each
# sample's tokens equal the same sample run alone.
#
# ## 3. Why there is nothing to copy
#
# Follow the writes. A block gets a name only in `cache_full_blocks`, and only once every one
# of its slots holds K/V (the first `num_computed` tokens fill it): from then on its owner's
# next tokens land in a later block. A sharer gets only named blocks (`_cached_prefix`), and
# its prefill starts past them (its chunk in `samples` starts at `cached`); its partial last block
# is always fresh, and even a prompt whose blocks are all named recomputes its last token in a
# block of its own. So no step ever writes into a block that two tables hold. That is the gate:


# %%
def check_writes_private(alloc, plan) -> None:
    """No slot this step writes lies in a block that more than one table holds."""
    bs = alloc.block_size
    for slot in plan.write_slots.tolist():
        owners = alloc.ref_count(slot // bs)
        if owners > 1:
            raise AssertionError(
                f"this step writes slot {slot} of block {slot // bs}, which {owners} tables hold"
            )


def check_kv_is_own(cache, tokens, blocks):
    """The K in a table's slots equals what a fresh forward over its own tokens computes."""
    rec, pos = recording_cache(), torch.arange(len(tokens))
    rec.begin(pos)
    tiny(torch.tensor(tokens), pos, rec)
    slots = BlockTable(4, blocks).slots(0, len(tokens))
    for layer, want in rec.kept.items():
        bad = (cache.k[layer][slots] - want).abs().amax(dim=(1, 2))  # (N,)
        if bad.max() > 1e-5:
            wrong = (bad > 1e-5).nonzero().flatten().tolist()
            raise AssertionError(f"layer {layer}: the K at positions {wrong} is not this sequence's own")


out, tables, steps, pool = samples(BlockAllocator(64, 4), on_plan=check_writes_private)
for name in ("a", "b"):
    computed = prompt + out[name][:-1]  # the last sampled token's K/V is never computed
    check_kv_is_own(pool, computed, tables[name])
print("every step's writes private; both tables hold their own K/V; tokens as alone:", out == alone)
assert out == alone

# %% [markdown]
# The check of the K/V reads the pool after both samples finished: the shared blocks 0 to 2
# still hold the prompt's keys, bit for bit what a fresh forward gives (within 1e-5), and each
# sample's own blocks hold its own tokens'. No step wrote into a block with two owners.
#
# ## 4. A planted share of a partial block
#
# Now break the rule: an allocator that, when a prompt equal to one already running arrives,
# also hands it the other's partial last block, with the prompt's last token left to recompute.
# It saves a block per sample, and the two samples then write their different next tokens into
# the same slots.


# %%
class SharesPartial(BlockAllocator):
    """Planted: identical prompts also share the partial last block while its first owner runs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.partial = {}  # prompt tokens -> the block holding their partial tail

    def allocate_prompt(self, table, token_ids, use_cache=True):
        cached = super().allocate_prompt(table, token_ids, use_cache)
        tail = self.partial.get(tuple(token_ids))
        if len(token_ids) % self.block_size and tail is not None and self.ref_count(tail):
            self._release(table.blocks.pop())  # give back the fresh block...
            self._share(tail)  # ...and take the other sample's instead
            table.blocks.append(tail)
            table.num_cached_tokens = cached = len(token_ids) - 1
        else:
            self.partial[tuple(token_ids)] = table.blocks[-1]
        return cached


try:
    samples(SharesPartial(64, 4), on_plan=check_writes_private)
except AssertionError as err:
    print("write gate caught:", err)
else:
    raise RuntimeError("a write into a shared partial block should have been caught")

out, tables, steps, pool = samples(SharesPartial(64, 4))  # unguarded this time: then look at a's slots
print("tables:", tables)
try:
    check_kv_is_own(pool, prompt + out["a"][:-1], tables["a"])
except AssertionError as err:
    print("K/V check on a caught:", err)
else:
    raise RuntimeError("a's K/V should have been overwritten by b's")
print("a's tokens equal to a alone:", out["a"] == alone["a"], "| b's:", out["b"] == alone["b"])

# %% [markdown]
# The write gate stops the run at step 2, the first step that writes into the block both hold:
# a's position 14 goes to slot 14 of block 3, which b was handed in the same step. Let the
# planted run go on and the damage shows in the pool: a's K at positions 14 and 15 are b's,
# because b wrote its own tokens there one step after a did. The tokens the tiny model sampled
# did not change here, as on Day 19: the pool is where the harm is visible. The cure, were a
# partial block ever shared, is copy-on-write: give the writer a fresh copy of the block the
# moment it writes into a block someone else holds. Recomputing the last block per sample
# costs at most one block of prefill, and the engine pays that instead.
#
# ## 5. Under pressure
#
# The script's workload: 40 requests over four shared 24-token prefixes (the first four times
# as popular as the last) with a few tokens of their own, one request every two steps, at most
# two running at once, 6 greedy tokens each, 4-token blocks. The script runs them through
# `Engine` (`add_request`, `step`), the API that day 34 builds, pinned as it stood on day 20
# (`engine_config(20, ...)`): a batch of up to two starts only when the last one has finished
# (static batching, which day 22 builds), and a sequence that finds no free block for its next
# token is preempted and later recomputed (preemption, which day 29 builds). The smaller the
# pool, the fewer freed blocks survive until a prompt asks for them. `lrf` is the package's allocator; `mrf` a
# variant that takes the most recently freed block first; `off` no prefix caching. Live, `lrf`
# and `mrf` over the roomiest pool and over 20 blocks:

# %%
committed = read_csv(evictbench.CSV_PRESSURE)
t0 = time.perf_counter()
live = evictbench.pressure_rows(tiny, pools=(20, 96), variants=("lrf", "mrf"))
print(f"{len(live)} runs in {time.perf_counter() - t0:.1f} s")
facts = ["variant", "pool_blocks", "cached_tokens", "reused_blocks", "recomputed_blocks", "computed_tokens"]
facts += ["evictions", "preemptions", "steps", "hit_rate"]
by_key = {(r["variant"], r["pool_blocks"]): r for r in committed}
print(" | ".join(facts))
for r in live:
    print(" | ".join(str(r[c]) for c in facts))
    assert all(str(r[c]) == by_key[r["variant"], str(r["pool_blocks"])][c] for c in facts), (
        "rerun evictbench.py"
    )

# %% [markdown]
# The script's whole sweep (`day-20-pressure.csv`, read back), every run's tokens asserted equal
# to the roomy `lrf` run's:

# %%
print(" | ".join(facts))
for r in committed:
    print(" | ".join(r[c] for c in facts))

# %% [markdown]
# Read down the `lrf` rows. Down to 64 blocks nothing is lost: 864 of 1,151 prompt tokens come
# from the cache (0.751) and 287 are computed, against 1,151 with caching off. From 48 blocks
# down, freed blocks are handed out again before the next request with their prefix arrives:
# 2 blocks recomputed at 48, 12 at 32, 85 at 20. At 16 blocks the pool is short for two running
# sequences as well: 17 preemptions, 168 steps instead of 126, and a hit rate of 0.348.
#
# The `mrf` rows sit at 0.334 from 96 blocks all the way down to 20, and the 192 evictions do
# not move either. A stack hands out the block freed last, and with tail-first freeing that is
# the head of the prefix the finished request had just used, the one block a following request
# most needs; it does so even when the pool has blocks nobody ever touched. A roomier pool
# cannot help a policy that evicts what it was given last.
#
# ## 6. The diagram

# %%
num = ("pool_blocks", "cached_tokens", "computed_tokens", "evictions", "preemptions", "steps", "hit_rate")
full = [{k: float(v) if k in num else v for k, v in r.items()} for r in committed]
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
colors = {"lrf": "tab:green", "mrf": "tab:purple", "off": "tab:red"}
labels = {
    "lrf": "lrf: least recently freed first (the package)",
    "mrf": "mrf: most recently freed first (variant)",
    "off": "off: no prefix caching (through Day 18)",
}

ax = axes[0, 0]
for i, (_, free, named) in enumerate(timeline):
    for j, blk in enumerate(free):
        color = "tab:green" if blk in named else "lightgray"
        ax.add_patch(plt.Rectangle((j, i), 0.92, 0.8, color=color))
        ax.text(j + 0.46, i + 0.4, str(blk), ha="center", va="center", fontsize=8)
ax.set_xlim(0, 12)
ax.set_ylim(len(timeline), -0.2)
ax.set_yticks([i + 0.4 for i in range(len(timeline))], [event for event, _, _ in timeline], fontsize=8)
ax.set_xlabel("free list, front (handed out next) to back")
ax.set_title("Section 1: the free list after each event (green: still named)")

ax = axes[0, 1]
ax.imshow([list(col) for col in zip(*steps_story)], cmap="Blues", vmin=0, vmax=2.5, aspect="auto")
for j, counts in enumerate(steps_story):
    for blk, n in enumerate(counts):
        ax.text(j, blk, str(n), ha="center", va="center", fontsize=8)
ax.set_xticks(range(len(steps_story)), [str(j + 1) for j in range(len(steps_story))])
ax.set_yticks(range(6), [f"block {blk}" for blk in range(6)])
ax.set_xlabel("step (stepped by hand)")
ax.set_title("Section 2: ref counts (sample a: 4 tokens, b: 10)")

ax = axes[1, 0]
for variant in ("lrf", "mrf", "off"):
    rows = [r for r in full if r["variant"] == variant]
    ax.plot([r["pool_blocks"] for r in rows], [r["hit_rate"] for r in rows], "o-", color=colors[variant],
            label=labels[variant])  # fmt: skip
ax.set_xscale("log", base=2)
ax.set_xticks([16, 24, 32, 48, 64, 96], ["16", "24", "32", "48", "64", "96"])
ax.set_xlabel("pool size (blocks of 4 tokens)")
ax.set_ylabel("prompt tokens found in the cache / prompt tokens")
ax.set_title("Hit rate as the pool shrinks (40 requests, 4 shared prefixes)")
ax.legend(fontsize=8, loc="lower right", bbox_to_anchor=(1, 0.06))

ax = axes[1, 1]
for variant in ("lrf", "mrf", "off"):
    rows = [r for r in full if r["variant"] == variant]
    ax.plot([r["pool_blocks"] for r in rows], [r["computed_tokens"] for r in rows], "o-",
            color=colors[variant], label=labels[variant])  # fmt: skip
    for r in rows:
        if r["preemptions"]:
            at = (r["pool_blocks"], r["computed_tokens"])
            label = f"{r['preemptions']:.0f} preempted"
            ax.annotate(
                label, at, xytext=(6, 4), textcoords="offset points", fontsize=8, color=colors[variant]
            )
ax.set_xscale("log", base=2)
ax.set_xticks([16, 24, 32, 48, 64, 96], ["16", "24", "32", "48", "64", "96"])
ax.set_xlabel("pool size (blocks of 4 tokens)")
ax.set_ylabel("prompt tokens computed, every admission")
ax.set_title("Prefill work: what eviction and preemption cost")
ax.legend(fontsize=8)

fig.suptitle("Day 20: eviction and reuse (tiny Llama, 4-token blocks, CPU)", fontsize=14)
fig.tight_layout()
png = diagram_path("day20-eviction.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** (V1) keeps the free list as `FreeKVCacheBlockQueue` (`vllm/v1/core/kv_cache_utils.py`),
#   a doubly linked list threaded through the `KVCacheBlock` objects, so a hit can pull a block
#   out of the middle in constant time, which our ordered dict also does. `BlockPool.get_new_blocks`
#   takes blocks from the front and `_maybe_evict_cached_block` drops each one's hash from
#   `cached_block_hash_to_block` first; `touch` takes hit blocks off the queue and raises their
#   `ref_cnt`; and `KVCacheManager.free` frees a request's blocks in reverse order so the tail
#   is evicted first, as here. V1 shares only full blocks and has no copy-on-write: `n > 1`
#   sampling becomes several requests that meet in the prefix cache, like our `after=`. The
#   older V0 block manager (`vllm/core/block/`) did fork block tables mid-block for parallel
#   sampling and beam search, and kept a `CopyOnWriteTracker` to copy a shared block when one
#   sequence appended to it.
# * **SGLang**'s `RadixCache.evict` gathers the tree's leaves whose `lock_ref` is 0 into a heap
#   by `last_access_time` and frees the least recently used first, so a node's age is the time
#   it was last matched, not when it was freed. Its default page size is one token, so a new
#   token always gets a slot of its own and nothing is ever partly shared.
# * **TensorRT-LLM** evicts reusable blocks by a retention priority a request can set, then by
#   age. With `KvCacheConfig(enable_partial_reuse=True)` a request may also take a block whose
#   tokens match only in part, and `copy_on_partial_reuse` copies that block first when another
#   request is using it: exactly the copy the engine avoids by recomputing the partial block.
# * **llama.cpp** tags every KV cell with the set of sequence ids it belongs to. Its `batched`
#   example decodes the prompt once with every sequence's id on its tokens, and the sequence-copy
#   call (`llama_memory_seq_cp`, formerly `llama_kv_cache_seq_cp`) adds an id to existing cells;
#   nothing is copied, and each sequence's new tokens go to new cells.
#
# ## Try it
#
# 1. **Free head first, in the package.** Change `BlockAllocator.free` in `nanoserve/blocks.py` to
#    release `table.blocks` in order instead of `reversed(...)`, then run `pytest
#    tests/test_blocks.py -k least_recently_freed`: the test must fail on its `filler.blocks`
#    assert, because the filler now takes a's head instead of a's tail, and rerunning section 1
#    must stop at its first assert, on the free list's order. Undo the change: the test must
#    pass again.
# 2. **A harmless-looking planted share.** Make both samples greedy (`temperature=0.0` in
#    `params`) and rerun section 4. The two samples now write the same tokens at the same
#    positions, so the check: the cell must still print "write gate caught" for block 3, and
#    then stop at its own `RuntimeError`, because `check_kv_is_own` no longer finds anything
#    wrong with a's keys. Which of the two checks would you rather run in CI?
# 3. **Copy-on-write, for real.** Make `SharesPartial` copy the shared block's K/V into a fresh
#    block before the second sample's first write (`cache.k[layer][dst] = cache.k[layer][src]`
#    for every layer and slot) and repoint that table: the write gate and `check_kv_is_own`
#    must then both pass. Count what the copy costs in bytes for SmolLM2 (Day 16's bytes per
#    block).

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
# # Day 16 — The KV pool and its plan
#
# Days 14 and 15 handed out blocks as integers: a free list, reference counts, a table that
# turns a position into a slot number. Nothing said how many blocks there are. That number is
# a memory decision, made once when the engine starts: take a byte budget, price one block of
# K and V, and divide. `nanoserve.pool.plan_pool` does it and returns a `KVPoolPlan`, a frozen
# dataclass of numbers only; the allocator gets `num_blocks` from it, and the paged cache of
# Day 17 allocates one K pool and one V pool per layer with `num_slots + 1` entries.
#
# The plan is also where a deployment learns what it can serve. The same budget holds one
# request at the model's full context or dozens of short ones, and whether an engine starts
# at all depends on it: a pool that cannot hold one request of `max_model_len` tokens is
# refused before anything runs.
#
# 1. the price of a token and of a block, derived by hand from SmolLM2's shape, against the plan,
# 2. `plan_pool` from a budget, the division done by hand, and `describe()`,
# 3. the sink slot: the one entry past the last block, and what it is for,
# 4. what a few budgets buy in fp32 and bf16 (`days/day16/poolplan.py`): tokens, and requests at
#    once at 512, 2048 and 8192 tokens,
# 5. a budget too small for one full-length request, refused by the engine with its sentence,
# 6. a plan built wrong (it prices K and forgets V), caught when the pools are allocated,
# 7. the diagram.

# %%
import sys
from types import SimpleNamespace

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, as_text, diagram_path, engine_as_of, read_csv, show
from nanoserve.blocks import BlockAllocator, BlockTable
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.models import Llama, LlamaConfig
from nanoserve.pool import DEFAULT_CPU_BUDGET, KVPoolPlan, parse_bytes, plan_pool
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day16"))
import poolplan  # the day's script: the notebook calls its functions and prints its tables

MODEL_DIR = fetch_default_model()
cfg = LlamaConfig.from_dir(MODEL_DIR)  # the shape alone: this day never needs the weights
print(
    f"SmolLM2-135M: {cfg.num_layers} layers, {cfg.num_heads} query heads, {cfg.num_kv_heads} K/V heads, "
    f"head_dim {cfg.head_dim}, context {cfg.max_position_embeddings:,} tokens"
)


# %% [markdown]
# ## 1. The price of a token and of a block
#
# Every layer keeps, for every token, one key and one value per K/V head, each `head_dim`
# numbers. SmolLM2 has 9 query heads but only 3 K/V heads (grouped-query attention, Day 5), so
# the cache pays for 3. A token therefore costs 2 x layers x kv_heads x head_dim numbers, and a
# block of 16 tokens sixteen times that. By hand:

# %%
fp32_bytes, bf16_bytes, block_size = 4, 2, 16
per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * fp32_bytes
per_block = per_token * block_size
print(
    f"one token, fp32: 2 (K, V) x {cfg.num_layers} x {cfg.num_kv_heads} x {cfg.head_dim} x {fp32_bytes} "
    f"= {per_token:,} bytes"
)
print(f"one block of {block_size} tokens: {per_token:,} x {block_size} = {per_block:,} bytes")
half = bf16_bytes / fp32_bytes
print(f"in bf16: {int(per_token * half):,} a token, {int(per_block * half):,} a block")

plan32 = plan_pool(cfg, torch.float32, block_size=16, budget_bytes="512MiB")
plan16 = plan_pool(cfg, torch.bfloat16, block_size=16, budget_bytes="512MiB")
assert per_token == plan32.bytes_per_slot == cfg.kv_bytes_per_token(torch.float32) == 46_080
assert per_block == plan32.bytes_per_block == 737_280
assert plan16.bytes_per_block == per_block // 2 and plan16.bytes_per_slot == per_token // 2
print("by hand == plan.bytes_per_slot and plan.bytes_per_block, in fp32 and bf16")

# %% [markdown]
# `poolplan.bytes_per_block` is the same product as a function of the config, and the
# script's first table checks it against the plan for both dtypes and three block sizes. The
# block size changes how a sequence is cut, not what a token costs: a block of 32 is twice a
# block of 16.

# %%
blocks = poolplan.block_table(cfg)
assert as_text(blocks) == read_csv(poolplan.CSV_BLOCK), "rerun poolplan.py"
show(blocks, list(blocks[0]))

# %% [markdown]
# For scale: the weights of this model are 538 MB in fp32 (Day 12; section 5 counts them), and
# one sequence at the full context of 8,192 tokens holds 8,192 x 46,080 = 377.5 MB of K and V,
# seven tenths of the weights. Two such sequences already hold more than the model itself.
#
# ## 2. `plan_pool` from a budget
#
# The plan takes one slot's bytes off the budget for the sink (section 3), then fits as many
# whole blocks as it can. On CPU there is no free-memory query to ask, so the default budget
# is a fixed `DEFAULT_CPU_BUDGET`; on CUDA it would be 90% of the memory free after the
# weights are loaded. Budgets are read by `parse_bytes`, where MiB and MB are not the same:

# %%
for text in ("512MiB", "512MB", "2GiB", "1e9"):
    print(f"parse_bytes({text!r}) = {parse_bytes(text):,}")
print(f"DEFAULT_CPU_BUDGET = {DEFAULT_CPU_BUDGET:,} bytes")

budget = parse_bytes("512MiB")
by_hand = (budget - per_token) // per_block  # the sink slot first, then whole blocks
print(f"({budget:,} - {per_token:,}) // {per_block:,} = {by_hand} blocks")
assert by_hand == plan32.num_blocks == 728
print(plan32)
print(plan32.describe())

# %% [markdown]
# The derived numbers, each a property of the plan:

# %%
for name in ("num_slots", "max_tokens", "sink_slot", "bytes_per_slot", "total_bytes", "pool_bytes"):
    print(f"{name:>14} = {getattr(plan32, name):,}")
left = plan32.budget_bytes - plan32.pool_bytes
print(f"budget left unplanned: {left:,} bytes, less than one block ({per_block:,})")
assert plan32.num_slots == plan32.max_tokens == 728 * 16 == 11_648
assert plan32.pool_bytes == plan32.total_bytes + per_token <= plan32.budget_bytes
assert 0 <= left < per_block

# %% [markdown]
# 728 blocks are 11,648 tokens for every sequence together. `pool_bytes` (536.8 MB) is what the
# pools will take, and the `describe()` line prints it in MB of 10^6 bytes next to the budget,
# also in MB: 512 MiB is 536.9 MB. The 84,992 bytes left over are less than one block; the plan
# never rounds up.
#
# ## 3. The sink slot
#
# The allocator numbers blocks 0 to `num_blocks - 1`, so slots run from 0 to `num_slots - 1`.
# Each pool has one entry more, at index `sink_slot` = `num_slots`: it belongs to no block, so
# no block table can ever point at it and no sequence's attention ever reads it. It is a place
# to put K/V that nobody wants. From Day 51 on, decode runs at fixed shapes: a batch of 5 rows
# is padded to a bucket of 8, and the 3 padded rows still run through every layer and still
# write a key and a value. Their `write_slots` entry is the sink and their context length is 0,
# so the write lands somewhere harmless and is never read back (Day 52); the slot table fills
# unused entries with it (Day 51), and the warm-up steps of Day 55 write nothing else.
#
# A small pool makes it concrete: a budget of 16 MiB on SmolLM2 in fp32, allocated for real.

# %%
small = plan_pool(cfg, torch.float32, budget_bytes="16MiB")
print(small.describe())
cache = BatchedPagedKVCache(cfg, small.num_slots, attention="gather")
print(f"before the first write: {cache.allocated_bytes:,} bytes allocated (pools are made on first use)")
cache.ensure_pools()
print(f"{len(cache.k)} K pools and {len(cache.v)} V pools of shape {tuple(cache.k[0].shape)}")
print(f"allocated: {cache.allocated_bytes:,} bytes = plan.pool_bytes {small.pool_bytes:,}")
assert cache.allocated_bytes == small.pool_bytes <= small.budget_bytes
assert cache.k[0].shape[0] == small.num_slots + 1 and cache.sink_slot == small.sink_slot

# %% [markdown]
# No block reaches the sink: hand out every block of the allocator and look at the highest
# slot a table can name.

# %%
alloc = BlockAllocator(small.num_blocks, small.block_size)
everything = BlockTable(small.block_size)
alloc.append_slots(everything, small.num_slots)  # every block, to one table
highest = max(everything.slot(p) for p in range(everything.capacity))
print(f"all {alloc.num_used} blocks handed out: slots 0..{highest}; the sink is {small.sink_slot}")
assert highest == small.sink_slot - 1 and alloc.num_free == 0

# %% [markdown]
# Now a padded row's write. `write` is one `index_put_` at the plan's `write_slots` (Day 17);
# a padded row's entry is the sink. After writing a random key and value there in every layer,
# the sink holds them and every real slot is still zero:

# %%
pad = SimpleNamespace(write_slots=torch.tensor([cache.sink_slot]))
g = torch.Generator().manual_seed(0)
for layer in range(cfg.num_layers):
    k, v = torch.randn(2, 1, cfg.num_kv_heads, cfg.head_dim, generator=g)
    cache.write(layer, k, v, pad)
n = small.num_slots
real = all(not cache.k[i][:n].any() and not cache.v[i][:n].any() for i in range(cfg.num_layers))
sink = all(cache.k[i][small.sink_slot].any() for i in range(cfg.num_layers))
print(f"sink written in all 30 layers: {sink}; all {small.num_slots:,} real slots still zero: {real}")
assert sink and real

# %% [markdown]
# The sink is paid for like any slot: a budget of exactly 10 blocks holds 9, because the tenth
# block and the sink do not both fit. That is the one-slot subtraction in the plan.

# %%
exact = 10 * per_block
for b, what in ((exact, "10 blocks"), (exact + per_token, "10 blocks + sink")):
    print(f"budget {b:,} ({what}): {plan_pool(cfg, torch.float32, budget_bytes=b).num_blocks} blocks")
assert plan_pool(cfg, torch.float32, budget_bytes=exact).num_blocks == 9
assert plan_pool(cfg, torch.float32, budget_bytes=exact + per_token).num_blocks == 10
del cache

# %% [markdown]
# ## 4. What a budget buys
#
# `poolplan.budget_table` plans five budgets in both dtypes and counts the requests that fit at
# once when each holds a context of L tokens: a request of L tokens holds ceil(L / 16) blocks
# (its last block may be part empty), so `num_blocks // ceil(L / 16)` of them fit. L is 512,
# 2,048 and 8,192, the model's full context. The notebook recomputes the table and asserts it
# equals the committed CSV.

# %%
budgets = poolplan.budget_table(cfg)
assert as_text(budgets) == read_csv(poolplan.CSV_BUDGETS), "rerun poolplan.py"
show(budgets, ["budget", "dtype", "num_blocks", "tokens", "pool_mb", "requests_512", "requests_2048",
               "requests_8192", "fits_full_context"])  # fmt: skip

# %% [markdown]
# Read across a row: the CPU default of 512 MiB in fp32 holds 11,648 tokens, which is 22
# requests of 512 tokens, 5 of 2,048 or 1 of 8,192. The same memory serves twenty-two short
# conversations or one long one, and which it serves is decided by the requests, block by
# block, not by the engine in advance. bf16 halves the price of a block, so every count
# doubles (give or take a block of rounding): 256 MiB in bf16 is the same 728 blocks as 512
# MiB in fp32. And the budgets below 377.5 MB (64 and 256 MiB in fp32, 64 MiB in bf16) cannot
# hold a single request at the full context.
#
# These are the pool's limits, not the scheduler's: Day 28's admission keeps a reserve of free
# blocks back, so a real engine admits a little fewer.
#
# ## 5. A budget too small for one full-length request
#
# An engine is built for a `max_model_len` (by default, the model's own context), and accepts
# any request whose prompt and output fit in it. A pool smaller than one sequence of that
# length would accept requests it could never finish, even with nothing else running, so the
# engine refuses to start instead, and says what to change. The engine is `Engine`, the API that
# day 34 builds; this section only constructs it, as it stood on day 16
# (`engine_as_of(16, ...)`), to see the check it makes on the plan at start-up.
#
# Nothing in this section runs the model; the engine reads only its shape and dtype before it
# plans the pool. So the model here is SmolLM2 built on PyTorch's `meta` device: every
# parameter with its real shape and dtype and no storage, made in a fraction of a second
# instead of loading 538 MB. (As of day 16 the engine keeps the model's own linears, so nothing
# tries to repack weights that are not there.)

# %%
model = Llama(cfg, device="meta")  # SmolLM2's shapes, no storage
print("parameters on:", model.embed.device, "| first block's fused QKV:", tuple(model.blocks[0].qkv.shape))
weights = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied head once
full = cfg.max_position_embeddings * per_token
print(f"weights {weights / 1e6:.1f} MB; K/V of one sequence at 8,192 tokens {full / 1e6:.1f} MB", end="")
print(f" ({full / weights:.2f} of the weights); the 512 MiB pool {plan32.pool_bytes / 1e6:.1f} MB")
try:
    engine_as_of(16, model, None, kv_budget="64MiB")
except ValueError as e:
    print("kv_budget='64MiB', max_model_len the model's 8192:\n   refused:", e)
else:
    raise AssertionError("an engine whose pool cannot hold one full-length request should not start")

# %% [markdown]
# Either fix works. Lower `max_model_len` to what the pool holds, or raise the budget to one
# full request: 512 blocks of 16 tokens and the sink, 512 x 737,280 + 46,080 bytes. One byte
# less, and the pool holds 8,176 tokens and the engine refuses again.

# %%
eng = engine_as_of(16, model, None, kv_budget="64MiB", max_model_len=1024)
print("max_model_len=1024:  ", eng.pool.describe())
need = poolplan.blocks_per_request(cfg.max_position_embeddings) * per_block + per_token
eng = engine_as_of(16, model, None, kv_budget=need)
print(f"kv_budget={need:,}:", eng.pool.describe())
assert eng.pool.num_slots == cfg.max_position_embeddings and eng.allocator.num_blocks == 512
try:
    engine_as_of(16, model, None, kv_budget=need - 1)
except ValueError as e:
    print(f"kv_budget={need - 1:,}: refused:", e)
else:
    raise AssertionError("one byte under a full request should be refused")
del eng

# %% [markdown]
# Below one block the plan itself refuses, with the smallest budget that would do:

# %%
try:
    plan_pool(cfg, torch.float32, budget_bytes="512KiB")
except ValueError as e:
    print("plan_pool(budget 512KiB):", e)

# %% [markdown]
# ## 6. A plan built wrong
#
# The easiest mistake in this arithmetic is to price only the keys: "one token is layers x
# kv_heads x head_dim x 4 bytes" forgets that a value of the same size sits next to every key.
# Such a plan promises twice the blocks. Nothing complains while it is only numbers; it is the
# allocation that shows the truth. `check_pool_fits` builds the cache the plan describes, the
# way the engine will, allocates every layer's pools, and compares the bytes it got with the
# plan's `pool_bytes` and with the budget.


# %%
def check_pool_fits(plan: KVPoolPlan, cfg: LlamaConfig, dtype=torch.float32) -> None:
    """The pools a plan asks for, allocated for real, take plan.pool_bytes and fit its budget."""
    pools = BatchedPagedKVCache(cfg, plan.num_slots, dtype=dtype, attention="gather")
    pools.ensure_pools()
    got = pools.allocated_bytes
    if got != plan.pool_bytes or got > plan.budget_bytes:
        raise AssertionError(
            f"the pools of {plan.num_blocks} blocks take {got:,} bytes; the plan said "
            f"{plan.pool_bytes:,}, and the budget is {plan.budget_bytes:,}"
        )


def plan_forgetting_v(cfg: LlamaConfig, budget: int, block_size: int = 16) -> KVPoolPlan:
    slot = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # keys only: no factor 2
    return KVPoolPlan(
        num_blocks=(budget - slot) // (slot * block_size),
        block_size=block_size,
        bytes_per_block=slot * block_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype="fp32",
        budget_bytes=budget,
    )


budget = parse_bytes("16MiB")
right, wrong = plan_pool(cfg, torch.float32, budget_bytes=budget), plan_forgetting_v(cfg, budget)
print(f"plan_pool: {right.num_blocks} blocks; keys only: {wrong.num_blocks} blocks")
check_pool_fits(right, cfg)
print("plan_pool's plan: the pools take exactly pool_bytes, within the budget")
try:
    check_pool_fits(wrong, cfg)
except AssertionError as e:
    print("keys-only plan caught:", e)
else:
    raise AssertionError("a plan that forgets V should have been caught")

# %% [markdown]
# The keys-only plan would have let the scheduler admit twice the tokens the budget holds.
# On a GPU, where the budget is most of the free memory, asking for twice of it fails at
# startup; on a CPU the allocation may well succeed, in memory meant for something else. So
# the check compares with the budget, not with whatever the machine lets us allocate.
#
# ## 7. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 10))
fig.suptitle("Day 16: the KV pool and its plan (SmolLM2-135M, block size 16)", fontsize=14)

# top left: a 16 MiB pool's slots, block by block, and the sink
ax = axes[0, 0]
nb = small.num_blocks
for b in range(nb):
    ax.barh(b, 16, color="tab:blue" if b % 2 == 0 else "tab:cyan", height=0.85)
    ax.text(16.3, b, f"slots {16 * b}-{16 * b + 15}", va="center", fontsize=7)
ax.barh(nb, 1, color="tab:red", height=0.85)
ax.text(1.3, nb, f"sink: index {small.sink_slot}, in no block", va="center", fontsize=8, color="tab:red")
ax.set_ylim(nb + 0.8, -0.8)
ax.set_xlim(0, 22)
ax.set_xticks([0, 4, 8, 12, 16])
ax.set_xlabel("offset in the block")
ax.set_ylabel("block id")
ax.set_title(
    f"16 MiB in fp32: {nb} blocks x 16 = {small.num_slots} slots + the sink\n"
    f"each slot {per_token:,} bytes (30 layers, K and V)",
    fontsize=10,
)

# top right: tokens the pool holds against the budget
ax = axes[0, 1]
mib = torch.logspace(4, 14, 60, base=2)  # 16 MiB .. 16 GiB
for dtype, color in ((torch.float32, "tab:blue"), (torch.bfloat16, "tab:orange")):
    name = "fp32" if dtype == torch.float32 else "bf16"
    toks = [plan_pool(cfg, dtype, budget_bytes=int(m * 2**20)).max_tokens for m in mib]
    ax.plot(mib, toks, color=color, label=f"{name}: {cfg.kv_bytes_per_token(dtype):,} bytes a token")
    pts = [r for r in budgets if r["dtype"] == name]
    ax.plot([r["budget_bytes"] / 2**20 for r in pts], [r["tokens"] for r in pts], "o", color=color)
ax.axhline(cfg.max_position_embeddings, color="k", ls="--", lw=1, label="one request at the full 8,192")
ax.set_xscale("log", base=2)
ax.set_yscale("log", base=2)
ax.set_xlabel("KV budget (MiB)")
ax.set_ylabel("tokens the pool holds")
ax.set_title("tokens per budget (dots: day-16-budgets.csv)")
ax.legend(fontsize=8)

# bottom left: requests at once, by budget and context
ax = axes[1, 0]
contexts = [512, 2048, 8192]
labels = [f"{r['budget']} {r['dtype']}" for r in budgets]
grid = [[r[f"requests_{c}"] for c in contexts] for r in budgets]
im = ax.imshow([[max(x, 0.5) for x in row] for row in grid], cmap="Greens", aspect="auto",
               norm=matplotlib.colors.LogNorm(vmin=0.5, vmax=800))  # fmt: skip
for i, row in enumerate(grid):
    for j, x in enumerate(row):
        ax.text(j, i, str(x), ha="center", va="center", color="white" if x > 60 else "black", fontsize=9)
ax.set_xticks(range(3), [f"L = {c:,}" for c in contexts])
ax.set_yticks(range(len(labels)), labels, fontsize=8)
ax.set_title("requests held at once, each with a context of L tokens")

# bottom right: the staircase of small budgets, and what the sink shifts
ax = axes[1, 1]
xs = list(range(0, 5 * per_block, per_block // 64))
ax.step([x / 1e6 for x in xs], [max(0, (x - per_token) // per_block) for x in xs], where="post",
        color="tab:blue", label="plan_pool: (budget - one slot) // block")  # fmt: skip
ax.step([x / 1e6 for x in xs], [x // per_block for x in xs], where="post", color="gray", ls=":",
        label="budget // block, no sink")  # fmt: skip
first = (per_block + per_token) / 1e6
ax.axvline(first, color="tab:red", lw=0.8)
ax.annotate(
    f"one block needs {per_block + per_token:,} bytes\n(block + sink slot); below that, a sentence",
    (first, 0.2), xytext=(first + 0.3, 0.4), fontsize=8, arrowprops=dict(arrowstyle="->", color="tab:red"),
)  # fmt: skip
ax.set_xlabel("KV budget (MB), fp32")
ax.set_ylabel("blocks planned")
ax.set_title("small budgets: whole blocks only, one slot set aside")
ax.legend(fontsize=8, loc="upper left")

fig.tight_layout()
png = diagram_path("day16-pool.png")
fig.savefig(png, dpi=80)
plt.close(fig)
display(Image(filename=str(png)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** sizes its pool the same way, from a measured budget. At startup the worker runs a
#   profiling forward at the largest batch it will schedule, and `determine_available_memory`
#   (`vllm/v1/worker/gpu_worker.py`) returns what is left of `--gpu-memory-utilization`, a
#   fraction of the GPU's whole memory, once the weights and that peak are counted.
#   `vllm/v1/core/kv_cache_utils.py` divides it into blocks and logs two lines worth knowing:
#   `GPU KV cache size: N tokens` and `Maximum concurrency for L tokens per request: X x`,
#   the two numbers of section 4's table. `check_enough_kv_cache_memory` raises, as our engine
#   does, when one request of `max_model_len` does not fit, and its message says to raise
#   `gpu_memory_utilization` or lower `max_model_len`. vLLM has no sink slot: a padded token's
#   slot id is -1 and the write kernel skips it; `BlockPool` sets block 0 aside as a
#   `null_block`, a placeholder for block-table entries that point nowhere.
# * **SGLang** reserves memory with `--mem-fraction-static` (a fraction for the weights and the
#   KV pool together) and counts its pool in tokens (`max_total_num_tokens`). The per-layer
#   buffers of `MHATokenToKVPool` (`python/sglang/srt/mem_cache/memory_pool.py`) have
#   `page_size` entries more than the pool holds, and the allocator hands out slots from 1:
#   slot 0 is kept for the outputs of padded tokens. That is our sink, at the front.
# * **llama.cpp** takes the pool in tokens, not bytes: `-c` / `--ctx-size` is the number of KV
#   cells allocated per layer at startup. With `-np N` parallel sequences and no
#   `--kv-unified`, each sequence gets its own `n_ctx / N` cells, a fixed reservation per
#   sequence; with `--kv-unified` they share one buffer, as our sequences share one pool.
# * **TensorRT-LLM** takes `KvCacheConfig(free_gpu_memory_fraction=0.9)` by default, a fraction
#   of the memory free after the engine is loaded, as our `plan_pool` does on CUDA, or a token
#   count (`max_tokens`), and cuts it into blocks of `tokens_per_block` tokens.

# %% [markdown]
# ## Try it
#
# 1. **Another model's price.** Build a `LlamaConfig` for a Llama-3-8B shape (32 layers, 8 K/V
#    heads, head_dim 128) and derive a bf16 block of 16 by hand before calling `plan_pool`.
#    `poolplan.bytes_per_block(cfg8b, torch.bfloat16)` must equal the plan's `bytes_per_block`
#    (2 x 32 x 8 x 128 x 2 bytes x 16 tokens, 2 MiB), and a 16 GiB budget must give one block
#    fewer than 16 GiB / 2 MiB, because the sink slot is paid for first.
# 2. **Break the plan on purpose.** In a copy of `plan_pool`, drop the sink: divide the whole
#    budget by the block. `test_the_sink_slot_is_paid_for` in `tests/test_pool.py` must fail
#    (a budget of exactly 10 blocks and a sink gives 10 blocks, one byte less must give 9).
#    Run it with `monkeypatch` or a `pytest_configure` plugin, as in Day 11's Try it.
# 3. **Reproduce the table at other sizes.** `python days/day16/poolplan.py --budgets 1GiB 40GiB
#    --contexts 4096 --out-budgets /tmp/b.csv`: 40 GiB in bf16 must hold
#    (40 GiB - 23,040) // 368,640 blocks, and `fits_full_context` must say `yes` in all four rows.

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
# # Day 18 — Paged attention: gather and mask
#
# Yesterday every new token's key and value went to its slot. Today a decode row reads them
# back. A row of the batch attends over its own context: the first `context_len` slots of its
# slot window, which are wherever its blocks happen to lie in the pools, possibly next to
# another row's keys and always inside blocks that may hold slots it has not filled yet.
#
# PyTorch's attention (`scaled_dot_product_attention`) wants keys and values as dense tensors.
# The plainest way to give it some is to gather: index the pools with the whole
# (rows, width) window, which copies every row's slots into a padded tensor as wide as the
# widest row, and then hide, with a mask, each row's positions at or past its own length. Both
# halves matter. The gather puts each row's keys in order; the mask is the only thing that
# stops a short row from attending to slots that are not its own.
#
# 1. the read by hand, for four rows of different lengths: window, gather, mask, softmax,
# 2. equal to Day 11's contiguous cache on the same keys, and to the package's two decode
#    paths, `attention="gather"` (the padded copy and SDPA, the way this phase builds it) and
#    `attention="native"` (the C++ kernel that reads the pools in place, Day 58),
# 3. the same read inside a whole model: a decode step over four sequences, logits against each
#    sequence run alone,
# 4. the mask left out: a short row attends to another row's keys and to empty slots, and the
#    check catches it,
# 5. what each way moves and how long it takes, by context length (`days/day18/pagedread.py`),
# 6. the diagram.

# %%
import csv
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, tiny_llama
from nanoserve.bench import cpu_line
from nanoserve.blocks import BlockAllocator
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.kernels import native, native_status
from nanoserve.plan import plan_decode, plan_prefill
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Sequence

sys.path.insert(0, str(REPO / "days" / "day18"))
import pagedread  # the day's script: the notebook calls its functions and prints its tables

torch.set_num_threads(2)
print("native kernel:", native_status())
BS, TOL = pagedread.BLOCK, pagedread.TOL


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def show(rows, columns):
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row[c]) for c in columns))


# %% [markdown]
# ## 1. The read, by hand
#
# Four rows with contexts 40, 5, 17 and 32 tokens, blocks of 16, SmolLM2's head shape (9
# query heads, 3 K/V heads, head dim 64). An allocator hands out blocks in order, so row 0
# gets blocks 0-2, row 1 block 3, row 2 blocks 4-5 and row 3 blocks 6-7. `layer_setup` writes
# random keys and values for every row's tokens at its slots (Day 17's write) and the same keys
# into one contiguous cache per row, and draws one query per row.

# %%
lens = [40, 5, 17, 32]
alloc = BlockAllocator(16, BS, enable_prefix_caching=False)
tables = []
for n in lens:
    seq = Sequence(f"row{len(tables)}", [1] * n, SamplingParams(), BS)
    alloc.allocate_prompt(seq.block_table, seq.token_ids)
    tables.append(seq.block_table.blocks)
setup = pagedread.layer_setup(lens, seed=0, blocks=tables)
window, ctx, q = setup["window"], setup["context_lens"], setup["q"]
k_pool, v_pool = setup["paged"]["gather"].k[0], setup["paged"]["gather"].v[0]
print("block lists:", tables)
print("pools", tuple(k_pool.shape), "(slots + sink, kv_heads, head_dim);  q", tuple(q.shape))
print("slot window", tuple(window.shape), "= (rows, widest row's blocks x 16);  context_lens", ctx.tolist())
for r in range(len(lens)):
    w = window[r].tolist()
    print(f"  row {r}: slots {w[0]}..{w[15]} | {w[16]}..{w[31]} | {w[32]}..{w[47]}   (its length: {lens[r]})")

# %% [markdown]
# A row with fewer blocks than the widest is padded with block 0's slots (`plan.slot_window`),
# which here are row 0's first 16 keys. Row 1 has 5 tokens: its window is its own block 3
# (5 filled slots, 11 not yet written), then block 0 twice. The read, in a few lines:


# %%
def paged_decode_attention(q, k_pool, v_pool, window, context_lens, mask=True):
    """q (B, nh, hd); pools (slots, kv, hd); window (B, W); context_lens (B,) -> (B, nh, hd)."""
    rows, width = window.shape
    group = q.shape[1] // k_pool.shape[1]  # query heads per K/V head
    k = k_pool[window].repeat_interleave(group, dim=2)  # gather: (B, W, nh, hd), padding and all
    v = v_pool[window].repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bwhd->bhw", q, k) / q.shape[-1] ** 0.5  # (B, nh, W)
    if mask:
        visible = torch.arange(width)[None, :] < context_lens[:, None]  # (B, W)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    weights = scores.softmax(-1)  # (B, nh, W)
    return torch.einsum("bhw,bwhd->bhd", weights, v), weights


mine, weights = paged_decode_attention(q, k_pool, v_pool, window, ctx)
visible = torch.arange(window.shape[1])[None, :] < ctx[:, None]
print("gathered K:", tuple(k_pool[window].shape), " mask:", tuple(visible.shape), " out:", tuple(mine.shape))
print("mask, row 1 (5 tokens):", visible[1].int().tolist())
per_row = weights.sum(-1)[:, 0].tolist()
past = [weights[r, :, lens[r] :].sum().item() for r in range(4)]
print("attention weight per row, head 0:", [f"{w:.3f}" for w in per_row],
      "| weight at or past each row's length:", past)  # fmt: skip
assert all(p == 0.0 for p in past)

# %% [markdown]
# Masked positions get a score of minus infinity, so after the softmax their weight is exactly
# zero: each row's probability mass lies on its own filled slots and nowhere else.
#
# ## 2. Equal to the contiguous cache, and to both decode paths
#
# The reference is Day 11's `ContiguousKVCache`, one per row, each holding its row's keys side
# by side; its `attention` reads `[0, length)` with no mask at all (one query at the end of a
# sequence sees everything). The package's two paths are `BatchedPagedKVCache` with
# `attention="gather"`, the padded copy and one SDPA call with the mask, and
# `attention="native"`, the kernel that walks each row's window up to its length and reads
# the slots where they are. The gather cache and the native cache share the very same pool
# tensors.

# %%
with torch.inference_mode():
    outs = {way: pagedread.run(setup, way) for way in pagedread.WAYS}
check_close = pagedread.check_close
for way, got in (("gather", outs["gather"]), ("native", outs["native"]), ("by hand", mine)):
    print(f"contiguous vs {way:<7} max |difference| {check_close(way, got, outs['contiguous']):.1e}")
print(f"tolerance TOL = {TOL:g} (fp32: the same sums in different orders)")

# %% [markdown]
# Four ways, one answer, to within 5e-7: the contiguous caches, the gather with its mask, the
# kernel, and the dozen lines above.
#
# ## 3. Inside a model
#
# The same read has to hold where it matters, in a decode step of a real forward pass. A tiny
# Llama (2 layers, 4 query heads, 2 K/V heads, head dim 16) prefills four prompts of 40, 5, 17
# and 32 tokens through the paged cache in one step, then runs one decode step for all four.
# The decode step runs three times over the same pools: with `paged_decode_attention` in place
# of the cache's decode read, with `attention="gather"` and with `attention="native"`. Each
# row's logits must equal its sequence run alone through a contiguous cache.

# %%
tiny = tiny_llama(seed=0, std=0.3)
tcfg = tiny.cfg
g = torch.Generator().manual_seed(1)
prompts = [torch.randint(1, tcfg.vocab_size, (n,), generator=g).tolist() for n in lens]


def alone(prompt):
    """The sequence alone through a contiguous cache: prefill, the greedy token, its decode logits."""
    c = ContiguousKVCache(tcfg, len(prompt) + 1)
    pos = torch.arange(len(prompt))
    c.begin(pos)
    first = int(tiny(torch.tensor(prompt), pos, c, logits_at=pos[-1:])[0].argmax())
    c.begin(torch.tensor([len(prompt)]))
    return first, tiny(torch.tensor([first]), torch.tensor([len(prompt)]), c)[0]  # (V,)


class ByHand(BatchedPagedKVCache):
    """The package's cache with its decode read replaced by section 1's function when `by_hand`."""

    by_hand = False

    def _one_query_rows(self, layer, q, window, context_lens):
        if self.by_hand:
            return paged_decode_attention(q, self.k[layer], self.v[layer], window, context_lens)[0]
        return super()._one_query_rows(layer, q, window, context_lens)


ref = [alone(p) for p in prompts]
alloc = BlockAllocator(16, BS, enable_prefix_caching=False)
seqs = [Sequence(f"s{i}", p, SamplingParams(), BS) for i, p in enumerate(prompts)]
for s in seqs:
    alloc.allocate_prompt(s.block_table, s.token_ids)
cache = ByHand(tcfg, 16 * BS, attention="native")
pre = plan_prefill([(s, 0, len(s.token_ids)) for s in seqs], BS)
tiny(pre.input_ids, pre.positions, cache.view(pre), logits_at=pre.logits_at)
for s, (first, _) in zip(seqs, ref):
    s.token_ids.append(first)
    alloc.append_slots(s.block_table, len(s.token_ids))
dec = plan_decode(seqs, BS)
print("decode plan: positions", dec.positions.tolist(), " context_lens", dec.context_lens.tolist(),
      " window", tuple(dec.slot_window.shape))  # fmt: skip
logits = {}
for way in ("by hand", "gather", "native"):
    cache.by_hand, cache.attention = way == "by hand", "native" if way == "by hand" else way
    logits[way] = tiny(dec.input_ids, dec.positions, cache.view(dec), logits_at=dec.logits_at)  # (4, V)
    diffs = [check_close(f"{way}, row {r}", logits[way][r], ref[r][1]) for r in range(4)]
    print(f"{way:>8}: max |logit difference| from each sequence alone:", ", ".join(f"{d:.1e}" for d in diffs))
scale = max(lg.abs().max().item() for _, lg in ref)
print(f"(logits reach {scale:.2f})")

# %% [markdown]
# ## 4. The mask, left out
#
# Drop the mask and the gather still runs, with the same shapes. Every row now spreads its
# attention over its whole window. For row 1, with 5 tokens, that is 48 positions: its 5 own,
# the 11 slots of its block it has not written (zeros: a zero key scores 0, and a zero value
# adds nothing but still takes weight), and 32 slots of block 0, which hold row 0's keys.

# %%
leaky, leaky_w = paged_decode_attention(q, k_pool, v_pool, window, ctx, mask=False)
w1 = leaky_w[1].mean(0)  # row 1, averaged over its query heads: (48,)
regions = {"its own 5 tokens": w1[:5], "its 11 unwritten slots": w1[5:16],
           "row 0's keys (block 0, twice)": w1[16:]}  # fmt: skip
for name, part in regions.items():
    print(f"row 1, no mask: weight on {name:<30} {part.sum():.3f}")
try:
    check_close("gather without the mask", leaky, outs["contiguous"])
except AssertionError as e:
    print("caught:", e)
else:
    raise AssertionError("attention without the length mask should have been caught")

# %% [markdown]
# Row 1 keeps 0.137 of its attention on its own tokens: 0.705 goes to row 0's keys and 0.157
# to slots nobody wrote. Every row is off, even row 0, the widest, whose window is all its
# own: its last block has 8 slots it has not filled yet. The same leak in the kernel: tell it
# every row is as long as the window, and it reads the padding too.

# %%
full = torch.full_like(ctx, window.shape[1])
per_row = (leaky - outs["contiguous"]).abs().amax(dim=(1, 2)).tolist()
print("no mask, max |difference| per row:", [f"{d:.3f}" for d in per_row])
with torch.inference_mode():
    unmasked = native().decode_attention(q, k_pool, v_pool, window, full, pagedread.HEAD_DIM**-0.5)
try:
    check_close("native kernel with context_lens = the window's width", unmasked, outs["contiguous"])
except AssertionError as e:
    print("caught:", e)
else:
    raise AssertionError("the kernel reading past each row's length should have been caught")

# %% [markdown]
# ## 5. What each way moves, and how long it takes
#
# Per layer, for R rows of contexts L_r and a window W slots wide (the widest row's blocks):
# the contiguous caches and the kernel each read every row's own keys and values once,
# 2 x sum(L) x kv_heads x head_dim x 4 bytes; the gather reads R x W slots out of the pools,
# writes them into its copy, and SDPA reads the copy again, 3 x 2 x R x W x kv_heads x head_dim
# x 4. `pagedread` prices two mixes of four rows at widest contexts C from 64 to 4,096:
# "spread" (C/4, C/2, 3C/4, C) and "one long" (three rows of 16 and one of C). The arithmetic,
# checked against the committed CSV:

# %%
table = pagedread.bytes_table()
as_text = [{k: str(v) for k, v in r.items()} for r in table]
assert as_text == read_csv(pagedread.CSV_BYTES), "rerun pagedread.py"
show(table, list(table[0]))

# %% [markdown]
# With lengths spread evenly the padded copy moves 4.80 times the bytes the rows need, at
# every context; with one long row among short ones the ratio grows with the long row, to
# 11.86 at C = 4,096, because every short row is padded to the long one's width. The times,
# each way the least of a few turns taken in turn, on one thread (on this 2-core machine,
# shared with other jobs, a second thread times the scheduler as much as the read). A live
# run at one context, then the script's table:

# %%
# NBVAL_IGNORE_OUTPUT
torch.set_num_threads(1)
print(cpu_line())
r = pagedread.time_row("one long", 1024, reps=5)
print(f"one long, C = 1024: contiguous {r['contiguous_us']} us, gather {r['gather_us']} us, "
      f"native {r['native_us']} us")  # fmt: skip
torch.set_num_threads(2)

# %%
times = read_csv(pagedread.CSV_TIME)
show(times, list(times[0]))

# %% [markdown]
# In the script's run the kernel was the fastest at every context in both mixes, and the
# gather the slowest: gather over native from 4.68 to 32.03, contiguous over native from 1.25
# to 6.04. The contiguous way reads no more bytes than the kernel, but it pays one SDPA call
# per row, a fixed cost that dominates at short contexts and fades as the rows grow. The gather
# pays one call for all rows, on copies whose size the widest row sets, and its time follows
# its bytes only roughly: for the spread mix, whose bytes ratio is 4.80 everywhere, its time
# ratio was 6.02 and 4.68 at C = 64 and 256, then 10.48 and 10.01 at 1,024 and 4,096; for one
# long row at 4,096, 32.03 against a bytes ratio of 11.86. At the larger contexts each call
# allocates a fresh copy of megabytes, and this run cannot tell that cost from the machine's
# noise: the times swung between the two runs of the script I made, the ordering did not.
# These are one layer and four rows; Day 58 measures whole decode steps of 16 rows on SmolLM2.
#
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 10))
fig.suptitle("Day 18: paged attention for decode rows (SmolLM2's head shape, fp32, blocks of 16)")

ax = axes[0, 0]
W = window.shape[1]
for r, n in enumerate(lens):
    own_blocks = len(tables[r]) * BS
    ax.barh(r, n, color="tab:green", height=0.7, label="its tokens: read" if r == 0 else None)
    ax.barh(r, own_blocks - n, left=n, color="lightgray", height=0.7,
            label="its blocks, not yet written: masked" if r == 1 else None)  # fmt: skip
    if own_blocks < W:
        ax.barh(r, W - own_blocks, left=own_blocks, color="mistyrose", edgecolor="tab:red",
                height=0.7, label="padding (block 0 = row 0's keys): masked" if r == 1 else None)  # fmt: skip
    ax.text(W + 0.5, r, f"L = {n}", va="center", fontsize=9)
ax.set_xlim(0, W + 6)
ax.set_ylim(4.9, -0.6)  # room below the rows for the legend
ax.set_yticks(range(4), [f"row {r}: blocks {tables[r]}" for r in range(4)], fontsize=8)
ax.set_xlabel("window position")
ax.set_title("the test batch's windows: what the mask lets through")
ax.legend(fontsize=8, loc="lower center", ncol=2)

ax = axes[0, 1]
xs = range(W)
ax.bar(xs, weights[1].mean(0).tolist(), color="tab:green", label="with the mask")
ax.bar(xs, leaky_w[1].mean(0).tolist(), color="none", edgecolor="tab:red", label="without")
ax.axvline(4.5, color="k", lw=0.8)
ax.axvline(15.5, color="gray", lw=0.8, ls=":")
ax.text(5, ax.get_ylim()[1] * 0.9, "past row 1's length", fontsize=8)
ax.text(16.5, ax.get_ylim()[1] * 0.8, "block 0: row 0's keys", fontsize=8, color="tab:red")
ax.set_xlabel("row 1's window position")
ax.set_ylabel("attention weight (mean over query heads)")
ax.set_title("row 1 (5 tokens): where its attention goes")
ax.legend(fontsize=8)

colors = {"contiguous": "tab:blue", "gather": "tab:red", "native": "tab:green"}
ax = axes[1, 0]
for mix, style in (("spread", "-"), ("one long", "--")):
    rows = [r for r in table if r["mix"] == mix]
    cs = [r["widest"] for r in rows]
    ax.plot(cs, [float(r["gather_kb"]) / 1e3 for r in rows], "o" + style, color=colors["gather"],
            label=f"gather, {mix}")  # fmt: skip
    ax.plot(cs, [float(r["native_kb"]) / 1e3 for r in rows], "s" + style, color=colors["native"],
            label=f"contiguous = native, {mix}")  # fmt: skip
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("widest context C")
ax.set_ylabel("MB of K/V moved, one layer, 4 rows")
ax.set_title("bytes moved (day-18-bytes.csv; the two gather lines coincide)")
ax.legend(fontsize=8)

ax = axes[1, 1]
for mix, style in (("spread", "-"), ("one long", "--")):
    rows = [r for r in times if r["mix"] == mix]
    cs = [int(r["widest"]) for r in rows]
    for way in pagedread.WAYS:
        us = [float(r[f"{way}_us"]) for r in rows]
        ax.plot(cs, us, "o" + style, color=colors[way], label=f"{way}, {mix}")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("widest context C")
ax.set_ylabel("µs, one layer, 4 rows (1 thread, least of 50)")
ax.set_title("time (day-18-time.csv)")
ax.legend(fontsize=7, ncol=2)

fig.tight_layout()
png = diagram_path("day18-paged_attention.png")
fig.savefig(png, dpi=80)
plt.close(fig)
display(Image(filename=str(png)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM**'s first paged attention was a kernel, not a gather: `paged_attention_v1` and `v2`
#   (`csrc/attention/`) take the block-shaped caches, `block_tables` (num_seqs x
#   max_blocks_per_seq) and `seq_lens`, and each sequence's thread block walks its own table
#   and stops at its length, so no padding is ever read; v2 splits long contexts into partitions
#   and merges their softmaxes. Its V1 engine hands the same tables to FlashAttention
#   (`flash_attn_varlen_func` with a `block_table` argument) or FlashInfer.
# * **PyTorch** has no attention op that reads through an index table, which is why an engine
#   in plain PyTorch gathers. transformers' continuous batching (`PagedAttentionCache`,
#   `transformers/generation/continuous_batching/`) keeps a paged cache and, on its SDPA path,
#   moves K/V in and out of it with per-step write and read index tensors before calling
#   attention. PyTorch's experimental `PagedAttention` helper for FlexAttention
#   (`torch/nn/attention/experimental/_paged_attention.py`) goes the other way: it rewrites a
#   block mask from logical to physical pages so that one compiled kernel reads the pages in
#   place.
# * **SGLang** keeps a table from each request to its token slots (`ReqToTokenPool`) and gives
#   its attention backends (FlashInfer, Triton) per-token index lists, the same information as
#   our slot window without the padding.
# * **llama.cpp** attends over a range of its KV cells with a mask built per micro-batch that
#   hides every cell of another sequence and every empty one (`llama_kv_cache::set_input_kq_mask`):
#   the gather-and-mask idea without the gather, since its cells are already one tensor.

# %% [markdown]
# ## Try it
#
# 1. **Pad with something else.** Change `plan.slot_window`'s padding from block 0 to the
#    sink's slot (the pool's last index) in a copy of the function, rebuild section 1's
#    window with it, and check that section 2's outputs do not change by a single bit: with the
#    mask in place, what the padding points at must not matter.
# 2. **A row of length 0.** Give `paged_decode_attention` a row whose `context_lens` is 0 (a
#    padded row of Day 52's buckets). Its softmax over nothing but minus infinity is NaN; make
#    the function return zeros for such rows, as `cache.py`'s gather path does with
#    `torch.where`, and assert it equals `setup["paged"]["native"]._one_query_rows` on that
#    row.
# 3. **Break the mask in the package.** In `BatchedPagedKVCache._one_query_rows`, compare
#    with `<=` instead of `<` when building `visible` (every row sees one slot too many), run
#    it under `attention="gather"` in section 2 and watch `check_close` fail; then run
#    `pytest tests/test_kernels.py` with the same change: the test holding the kernel to the
#    gather path must fail too.
# 4. **Reproduce the bytes.** `python days/day18/pagedread.py --contexts 128 8192 --reps 5
#    --out-bytes /tmp/b.csv --out-time /tmp/t.csv`: at C = 8,192 the "one long" mix must give
#    a `gather_over_native` of 3 x 4 x 8,192 / (3 x 16 + 8,192), rounded to two places (three
#    passes over four rows of the long row's width, against the tokens the rows hold).

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
# # Day 18 — Paged attention: gather and mask, and the read in place
#
# Yesterday every new token's key and value went to its slot. Today a decode row reads them
# back. A row of the batch attends over its own context: the first `context_len` slots of its
# slot window, which are wherever its blocks happen to lie in the pools, possibly next to
# another row's keys and always inside blocks that may hold slots it has not filled yet.
#
# PyTorch's attention (`scaled_dot_product_attention`) wants keys and values as dense tensors.
# The plainest way to give it some is to gather: index the pools with the whole
# (rows, width) window, which copies every row's slots into a padded tensor as wide as the
# widest row, and then hide, with a mask, each row's positions at or past its own length. That
# is the package's way from today, `attention="gather"`. The copy is not needed for the
# arithmetic, only for the operator: a row can walk its own block table a block at a time, read
# each block's keys where they lie, and join the blocks' softmaxes as it goes. Today builds that
# read by hand too, in plain torch, and checks it against the other two.
#
# 1. the rows, their blocks and their windows,
# 2. gather and mask by hand, equal to Day 11's contiguous cache and to `attention="gather"`,
# 3. the mask left out: a short row attends to another row's keys, and the check catches it,
# 4. the read in place by hand: one block at a time, with an online softmax,
# 5. a planted bug in it (the accumulator not rescaled when the max rises), caught,
# 6. both reads inside a whole model: a decode step over four sequences, logits against each
#    sequence run alone,
# 7. what each way moves and how long it takes, by context length (`days/day18/pagedread.py`),
# 8. the diagram.

# %%
import math
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, as_text, cpu_line, diagram_path, read_csv, show, tiny_llama
from nanoserve.blocks import BlockAllocator
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.plan import plan_decode, plan_prefill
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Sequence

sys.path.insert(0, str(REPO / "days" / "day18"))
import pagedread  # the day's script: the notebook calls its functions and prints its tables

torch.set_num_threads(2)
BS, TOL = pagedread.BLOCK, pagedread.TOL
check_close = pagedread.check_close  # max |got - want| below TOL, returned, or AssertionError

# %% [markdown]
# ## 1. The rows and their windows
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
k_pool, v_pool = setup["k_pool"], setup["v_pool"]
print("block tables:", tables)
print("pools", tuple(k_pool.shape), "(slots + sink, kv_heads, head_dim);  q", tuple(q.shape))
print("slot window", tuple(window.shape), "= (rows, widest row's blocks x 16);  context_lens", ctx.tolist())
for r in range(len(lens)):
    w = window[r].tolist()
    print(f"  row {r}: slots {w[0]}..{w[15]} | {w[16]}..{w[31]} | {w[32]}..{w[47]}   (its length: {lens[r]})")

# %% [markdown]
# The window is the block table written out slot by slot. A row with fewer blocks than the
# widest is padded with block 0's slots (`plan.slot_window`), which here are row 0's first 16
# keys. Row 1 has 5 tokens: its window is its own block 3 (5 filled slots, 11 not yet
# written), then block 0 twice.
#
# ## 2. Gather and mask, by hand
#
# The read in a few lines: index the pools with the whole window (a copy, padding and all),
# score, set every position at or past the row's length to minus infinity, softmax.


# %%
def gather_read(q, k_pool, v_pool, window, context_lens, mask=True):
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


mine, weights = gather_read(q, k_pool, v_pool, window, ctx)
visible = torch.arange(window.shape[1])[None, :] < ctx[:, None]
print("gathered K:", tuple(k_pool[window].shape), " mask:", tuple(visible.shape), " out:", tuple(mine.shape))
print("mask, row 1 (5 tokens):", visible[1].int().tolist())
past = [weights[r, :, lens[r] :].sum().item() for r in range(4)]
print("weight at or past each row's length:", past)
assert all(p == 0.0 for p in past)

# %% [markdown]
# Masked positions get a score of minus infinity, so after the softmax their weight is exactly
# zero. The reference is Day 11's `ContiguousKVCache`, one per row, each holding its row's keys
# side by side; its `attention` reads `[0, length)` with no mask at all. The package's path is
# `BatchedPagedKVCache(attention="gather")`: the same copy (`index_select`) and one SDPA call
# with the mask.

# %%
with torch.inference_mode():
    ref = pagedread.run(setup, "contiguous")  # (4, 9, 64)
    package = pagedread.run(setup, "gather")
for way, got in (("package gather", package), ("gather by hand", mine)):
    print(f"contiguous vs {way:<15} max |difference| {check_close(way, got, ref):.1e}")
print(f"bound TOL = {TOL:g} (fp32: the same sums in different orders)")

# %% [markdown]
# ## 3. The mask, left out
#
# Drop the mask and the gather still runs, with the same shapes. Every row now spreads its
# attention over its whole window. For row 1, with 5 tokens, that is 48 positions: its 5 own,
# the 11 slots of its block it has not written (zeros: a zero key scores 0, and a zero value
# adds nothing but still takes weight), and 32 slots of block 0, which hold row 0's keys.

# %%
leaky, leaky_w = gather_read(q, k_pool, v_pool, window, ctx, mask=False)
w1 = leaky_w[1].mean(0)  # row 1, averaged over its query heads: (48,)
regions = {"its own 5 tokens": w1[:5], "its 11 unwritten slots": w1[5:16],
           "row 0's keys (block 0, twice)": w1[16:]}  # fmt: skip
for name, part in regions.items():
    print(f"row 1, no mask: weight on {name:<30} {part.sum():.3f}")
per_row = (leaky - ref).abs().amax(dim=(1, 2)).tolist()
print("no mask, max |difference| per row:", [f"{d:.3f}" for d in per_row])
try:
    check_close("gather without the mask", leaky, ref)
except AssertionError as e:
    print("caught:", e)
else:
    raise AssertionError("attention without the length mask should have been caught")

# %% [markdown]
# Row 1 keeps 0.137 of its attention on its own tokens: 0.705 goes to row 0's keys and 0.157
# to slots nobody wrote. Every row is off, even row 0, the widest, whose window is all its
# own: its last block has 8 slots it has not filled yet.
#
# ## 4. The read in place, by hand
#
# The gather copies so that one operator sees every key at once. Nothing in the arithmetic
# asks for that. A row can walk its block table, and for block j read its filled slots,
# `block * 16` up to the row's length, straight out of the pool: a slice of the pool is a view,
# so nothing is copied and no padding exists to be masked. What it cannot do is one softmax
# over all its scores, since it sees them a block at a time. The online softmax (the recurrence
# of FlashAttention and of vLLM's paged kernels) keeps three running quantities per query head:
#
# * `m`, the largest score seen so far,
# * `l`, the sum of exp(score - m) over the slots seen so far,
# * `acc`, the sum of exp(score - m) x value over the same slots.
#
# A new block with scores s brings a new max m' = max(m, max s). Everything already in `l` and
# `acc` was weighted against the old m, so both are multiplied by alpha = exp(m - m') before
# the block's own exp(s - m') terms are added; alpha is 1 when the max did not rise. After the
# last block the output is acc / l. The max only keeps exp from overflowing: any reference
# would give the same quotient, as long as `l` and `acc` always share it.
#
# Row 0, step by step (its 40 tokens are blocks 0, 1 and 2: 16, 16 and 8 slots), the running
# quantities of query head 4 (the second head of K/V head 1) printed after each block:

# %%
r, group = 0, q.shape[1] // k_pool.shape[1]
kh, gh = divmod(4, group)  # query head 4 is head 1 of K/V head 1's group
qr = q[r].view(3, group, 64) * 64**-0.5  # (kv, group, hd): each K/V head serves 3 query heads
m = torch.full((3, group), float("-inf"))
l = torch.zeros(3, group)  # noqa: E741
acc = torch.zeros(3, group, 64)
trace = []  # (position, score, running max) of head 4, for the diagram
for j, block in enumerate(tables[r]):
    n = min(BS, lens[r] - j * BS)  # the block's filled slots
    k, v = k_pool[block * BS : block * BS + n], v_pool[block * BS : block * BS + n]  # (n, 3, 64)
    assert k.data_ptr() == k_pool[block * BS].data_ptr()  # a view into the pool: no copy
    s = torch.einsum("kgd,nkd->kgn", qr, k)  # (kv, group, n)
    m_new = torch.maximum(m, s.amax(-1))
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[..., None])
    l = alpha * l + p.sum(-1)  # noqa: E741
    acc = alpha[..., None] * acc + torch.einsum("kgn,nkd->kgd", p, v)
    print(f"block {block}: slots {block * BS}..{block * BS + n - 1} ({n:>2}), "
          f"block max {s[kh, gh].max():.3f}, m {m[kh, gh]:.3f} -> {m_new[kh, gh]:.3f}, "
          f"alpha {alpha[kh, gh]:.3f}, l {l[kh, gh]:.3f}")  # fmt: skip
    trace += [(j * BS + i, s[kh, gh, i].item(), m_new[kh, gh].item()) for i in range(n)]
    m = m_new
row0 = (acc / l[..., None]).view(9, 64)
print(f"row 0 in place vs contiguous: max |difference| {check_close('row 0 in place', row0, ref[0]):.1e}")

# %% [markdown]
# Block 0 sets the max (its alpha is 0.000: exp of minus infinity, multiplying an accumulator
# that is still empty). Block 1 holds a score of 1.801, far above block 0's best of 0.142, so
# what block 0 put into `l` and `acc` is multiplied by alpha = 0.190 before block 1's terms go
# in: `l` falls from 9.122 to 6.778 although block 1 only adds to it. Block 2 stays under the
# max, its alpha is 1.000 and `l` just grows. The result equals row 0 of the contiguous caches.
#
# The same loop for every row is the whole read. `inplace_read` below is the loop of
# `pagedread.inplace_read`, the function the day's script times, with one switch added:
# `rescale_acc=False` plants a bug for section 5.


# %%
def inplace_read(q, k_pool, v_pool, tables, context_lens, rescale_acc=True):
    """q (B, nh, hd); pools (slots, kv, hd); tables: each row's block list; -> (B, nh, hd)."""
    rows, heads, hd = q.shape
    kv = k_pool.shape[1]
    out = torch.zeros_like(q)
    for r in range(rows):
        qr = q[r].view(kv, heads // kv, hd) * hd**-0.5  # (kv, group, hd)
        m = torch.full((kv, heads // kv), float("-inf"))  # running max
        l = torch.zeros(kv, heads // kv)  # running sum of exp(score - m)  # noqa: E741
        acc = torch.zeros(kv, heads // kv, hd)  # running sum of exp(score - m) * value
        for j, block in enumerate(tables[r]):
            n = min(BS, int(context_lens[r]) - j * BS)  # filled slots; none past the row's length
            if n <= 0:
                break
            k, v = k_pool[block * BS : block * BS + n], v_pool[block * BS : block * BS + n]  # views
            s = torch.einsum("kgd,nkd->kgn", qr, k)  # (kv, group, n)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)  # 1 where the max held, < 1 where it rose
            p = torch.exp(s - m_new[..., None])
            l = alpha * l + p.sum(-1)  # noqa: E741
            acc = (alpha[..., None] * acc if rescale_acc else acc) + torch.einsum("kgn,nkd->kgd", p, v)
            m = m_new
        if int(context_lens[r]) > 0:
            out[r] = (acc / l[..., None]).view(heads, hd)
    return out


inplace = inplace_read(q, k_pool, v_pool, tables, ctx)
assert torch.equal(inplace, pagedread.run(setup, "inplace")), "the script's loop differs from this one"
for way, want in (("contiguous", ref), ("package gather", package)):
    print(f"in place vs {way:<15} max |difference| {check_close(way, inplace, want):.1e}")
print("slots read in place:", sum(lens), " slots the gather copies:", window.numel())

# %% [markdown]
# Three reads, one answer within the bound: the in-place loop reads the 94 slots the rows
# hold, where the gather copies all 192 of the window (and SDPA reads the copy again).
#
# ## 5. A planted bug: the accumulator not rescaled
#
# Leave out the factor alpha on `acc` (and keep it on `l`). Where the max never rises after a
# row's first block, alpha is always 1 and the bug does nothing; where it rises, the values
# seen before are weighted against a max that no longer holds, too heavily, and the output
# is wrong. Row 1 has a single block, so it cannot be touched.

# %%
buggy = inplace_read(q, k_pool, v_pool, tables, ctx, rescale_acc=False)
bug_err = (buggy - inplace).abs().amax(dim=(1, 2))  # (4,): against the loop with the rescale
scale, rose = q.shape[-1] ** -0.5, []
for r, blocks in enumerate(tables):
    s = torch.einsum("hd,nhd->hn", q[r], k_pool[window[r, : lens[r]]].repeat_interleave(3, dim=1)) * scale
    first = s[:, :BS].amax(-1)  # (9,) each head's max over the row's first block
    rose.append(int((s.amax(-1) > first).sum()))  # heads whose max rose in a later block
    print(f"row {r}: {len(blocks)} block(s), {rose[r]} of 9 heads saw the max rise, "
          f"output moved by up to {bug_err[r]:.3f}")  # fmt: skip
try:
    check_close("in place, acc not rescaled", buggy, ref)
except AssertionError as e:
    print("caught:", e)
else:
    raise AssertionError("the missing rescale should have been caught")
assert bug_err[1].item() == 0.0  # one block: alpha only ever multiplies the empty accumulator

# %% [markdown]
# The check catches it. The error sits exactly where the recurrence needs alpha: rows whose
# heads found a larger score in a later block. A test that only ever used one block per row, or
# scores that happen to peak in the first block, would pass this bug.
#
# Day 58 builds this read in place in C++ (the native kernel) and measures it against the gather.
#
# ## 6. Inside a model
#
# Both reads have to hold in a decode step of a real forward pass. A tiny Llama (2 layers, 4
# query heads, 2 K/V heads, head dim 16) prefills four prompts of 40, 5, 17 and 32 tokens
# through the paged cache in one step, then runs one decode step for all four, three times
# over the same pools: with `gather_read`, with `inplace_read` (each row's block table read
# back from its window: every 16th slot over 16) and with the package's `attention="gather"`.
# Each row's logits must equal its sequence run alone through a contiguous cache.

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
    """The package's gather cache with its decode read replaced by one of the hand-built reads."""

    way = "package gather"

    def _one_query_rows(self, layer, q, window, context_lens):
        if self.way == "gather by hand":
            return gather_read(q, self.k[layer], self.v[layer], window, context_lens)[0]
        if self.way == "in place by hand":
            row_tables = (window[:, ::BS] // BS).tolist()  # the window's blocks, padding and all
            return inplace_read(q, self.k[layer], self.v[layer], row_tables, context_lens)
        return super()._one_query_rows(layer, q, window, context_lens)


alone_ref = [alone(p) for p in prompts]
alloc = BlockAllocator(16, BS, enable_prefix_caching=False)
seqs = [Sequence(f"s{i}", p, SamplingParams(), BS) for i, p in enumerate(prompts)]
for s in seqs:
    alloc.allocate_prompt(s.block_table, s.token_ids)
cache = ByHand(tcfg, 16 * BS, attention="gather")
pre = plan_prefill([(s, 0, len(s.token_ids)) for s in seqs], BS)
tiny(pre.input_ids, pre.positions, cache.view(pre), logits_at=pre.logits_at)
for s, (first, _) in zip(seqs, alone_ref):
    s.token_ids.append(first)
    alloc.append_slots(s.block_table, len(s.token_ids))
dec = plan_decode(seqs, BS)
print("decode plan: positions", dec.positions.tolist(), " context_lens", dec.context_lens.tolist(),
      " window", tuple(dec.slot_window.shape))  # fmt: skip
print("block tables read back from the window:", (dec.slot_window[:, ::BS] // BS).tolist())
logits = {}
for way in ("gather by hand", "in place by hand", "package gather"):
    cache.way = way
    logits[way] = tiny(dec.input_ids, dec.positions, cache.view(dec), logits_at=dec.logits_at)  # (4, V)
    diffs = [check_close(f"{way}, row {r}", logits[way][r], alone_ref[r][1]) for r in range(4)]
    print(f"{way:>16}: max |logit difference| from each sequence alone:",
          ", ".join(f"{d:.1e}" for d in diffs))  # fmt: skip
print(f"(logits reach {max(lg.abs().max().item() for _, lg in alone_ref):.2f})")

# %% [markdown]
# Row 3's decode token opened a third block (block 8), so every window is three blocks wide.
# The padding in a window turns into padding blocks in the table read back from it (row 1's
# table is block 3, then block 0 twice), and the in-place loop never reaches them: it stops at
# the row's length, which is all the mask did for the gather. All three reads give every row's
# logits within the bound of its sequence run alone.
#
# ## 7. What each way moves, and how long it takes
#
# Per layer, for R rows of contexts L_r and a window W slots wide (the widest row's blocks):
# the contiguous caches and the in-place read each read every row's own keys and values once,
# 2 x sum(L) x kv_heads x head_dim x 4 bytes; the gather reads R x W slots out of the pools,
# writes them into its copy, and SDPA reads the copy again, 3 x 2 x R x W x kv_heads x head_dim
# x 4. `pagedread` prices two mixes of four rows at widest contexts C from 64 to 4,096:
# "spread" (C/4, C/2, 3C/4, C) and "one long" (three rows of 16 and one of C). The arithmetic,
# checked against the committed CSV:

# %%
table = pagedread.bytes_table()
assert as_text(table) == read_csv(pagedread.CSV_BYTES), "rerun pagedread.py"
show(table)

# %% [markdown]
# With lengths spread evenly the padded copy moves 4.80 times the bytes the rows need, at
# every context; with one long row among short ones the ratio grows with the long row, to
# 11.86 at C = 4,096, because every short row is padded to the long one's width. The in-place
# read moves exactly what the contiguous caches move, and copies nothing.
#
# The times, each way the least of a few turns taken in turn, on one thread. A live run at one
# context, then the script's table:

# %%
# NBVAL_IGNORE_OUTPUT
torch.set_num_threads(1)
print(cpu_line())
r = pagedread.time_row("one long", 1024, reps=5)
print(f"one long, C = 1024: contiguous {r['contiguous_us']} us, gather {r['gather_us']} us, "
      f"in place {r['inplace_us']} us")  # fmt: skip
torch.set_num_threads(2)

# %%
times = read_csv(pagedread.CSV_TIME)
print(times[0]["cpu"])
show(times, [c for c in times[0] if c != "cpu"])

# %% [markdown]
# The in-place loop is slow here, and that is expected: every block costs a dozen small torch
# calls, each paying Python's and the dispatcher's overhead, and a row of 4,096 tokens walks
# 256 blocks. This run was made on a quiet machine. Up to C = 1,024 the loop took 3.95 to 7.82
# times the gather's time in both mixes, and 3.57 times at C = 4,096 with lengths spread. The
# one place it wins is one long row at C = 4,096: there the gather pads three rows of 16 to
# 4,096 and took 15,395.7 us against the loop's 8,690.5 us, so the loop came out at 0.56 of
# it. The contiguous caches read the same bytes as the loop, in one compiled SDPA call per row,
# and took 0.05 to 1.00 of the gather's time. The loop's point is the copy it does not make; a
# compiled loop is what turns that into time.
#
# ## 8. The diagram

# %%
fig, axes = plt.subplots(2, 3, figsize=(18, 10))
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
ax.set_ylim(5.4, -0.6)  # room below the rows for the legend
ax.set_yticks(range(4), [f"row {r}: blocks {tables[r]}" for r in range(4)], fontsize=8)
ax.set_xlabel("window position")
ax.set_title("the gather's windows: what the mask lets through\n(the in-place read visits only the green)")
ax.legend(fontsize=8, loc="lower center", ncol=1)

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

ax = axes[0, 2]
pos, score, run_max = zip(*trace)
ax.plot(pos, score, "o", color="tab:blue", ms=4, label="score of each slot")
ax.step(pos, run_max, where="post", color="tab:orange", label="running max m after its block")
for j in range(1, len(tables[0])):
    ax.axvline(j * BS - 0.5, color="gray", lw=0.8, ls=":")
for j, block in enumerate(tables[0]):
    ax.text(j * BS + 1, min(score) - 0.2, f"block {block}", fontsize=8)
ax.set_xlabel("row 0's position (read a block at a time)")
ax.set_ylabel("score q.k / 8, query head 4")
m_at = {x: mx for x, _, mx in trace}
ax.annotate("block 1 raises m: acc and l\nmultiplied by alpha = exp(m - m') = "
            f"{math.exp(m_at[0] - m_at[BS]):.3f}", (BS, m_at[BS]), (0.5, 0.75),
            fontsize=8, arrowprops={"arrowstyle": "->"})  # fmt: skip
ax.set_title("the in-place read, row 0: one block at a time")
ax.legend(fontsize=8, loc="upper left")

colors = {"contiguous": "tab:blue", "gather": "tab:red", "inplace": "tab:green"}
ax = axes[1, 0]
for mix, style in (("spread", "-"), ("one long", "--")):
    rows = [r for r in table if r["mix"] == mix]
    cs = [r["widest"] for r in rows]
    ax.plot(cs, [float(r["gather_kb"]) / 1e3 for r in rows], "o" + style, color=colors["gather"],
            label=f"gather, {mix}")  # fmt: skip
    ax.plot(cs, [float(r["inplace_kb"]) / 1e3 for r in rows], "s" + style, color=colors["inplace"],
            label=f"contiguous = in place, {mix}")  # fmt: skip
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
ax.set_title("time (day-18-time.csv; in place is a Python loop)")
ax.legend(fontsize=7, ncol=2)

ax = axes[1, 2]
ax.bar(range(4), bug_err.tolist(), color="tab:red", label="acc not rescaled")
ax.axhline(TOL, color="k", lw=0.8, ls="--", label=f"bound {TOL:g}")
for r in range(4):
    ax.text(r, bug_err[r].item(), f"{bug_err[r]:.3f}", ha="center", va="bottom", fontsize=9)
ticks = [f"row {r}\n{len(tables[r])} block(s)\nmax rose: {rose[r]}/9" for r in range(4)]
ax.set_xticks(range(4), ticks, fontsize=8)
ax.set_ylabel("max |difference| from the loop with the rescale")
ax.set_title("the planted bug (acc not rescaled), row by row")
ax.legend(fontsize=8)

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
#   and merges their softmaxes with the same max-and-rescale step as section 4. Its V1 engine
#   hands the same tables to FlashAttention (`flash_attn_varlen_func` with a `block_table`
#   argument) or FlashInfer.
# * **FlashAttention** (Dao et al., 2022) is where the online softmax became the standard way
#   to attend: it walks keys in tiles that fit in fast memory, keeps the running max and sum per
#   query row, and rescales its output tile whenever the max rises, as `inplace_read` does per
#   block. A reader that can hold all of a row's scores at once (one decode query's worth) may
#   instead keep them in a buffer and take a single softmax; the rescale is the price of holding
#   only a block at a time.
# * **PyTorch** has no attention op that reads through an index table, which is why an engine
#   in plain PyTorch gathers. transformers' continuous batching (`PagedAttentionCache`,
#   `transformers/generation/continuous_batching/`) keeps a paged cache and, on its SDPA path,
#   moves K/V in and out of it with per-step write and read index tensors before calling
#   attention. PyTorch's experimental `PagedAttention` helper for FlexAttention
#   (`torch/nn/attention/experimental/_paged_attention.py`) goes the other way: it rewrites a
#   block mask from logical to physical pages so that one compiled kernel reads the pages in
#   place.
# * **llama.cpp** attends over a range of its KV cells with a mask built per micro-batch that
#   hides every cell of another sequence and every empty one (`llama_kv_cache::set_input_kq_mask`):
#   the gather-and-mask idea without the gather, since its cells are already one tensor.

# %% [markdown]
# ## Try it
#
# 1. **Pad with something else.** Change `plan.slot_window`'s padding from block 0 to the
#    sink's slot (the pool's last index) in a copy of the function, rebuild section 1's
#    window with it, and check that `gather_read`'s and the package gather's outputs do not
#    change by a single bit (`torch.equal` against section 2's): with the mask in place, what
#    the padding points at must not matter.
# 2. **Read past the length.** In `inplace_read`, read every block whole (`n = BS`) instead of
#    stopping at the row's length, and run section 4's check: it must fail. The per-row errors
#    against `ref` must be below `TOL` for row 3 alone (its 32 tokens fill its two blocks) and
#    above it for rows 0, 1 and 2, whose last blocks hold slots nobody wrote.
# 3. **A row of length 0.** Append a fifth row with nothing to read: query `q[:1]`, table
#    `[0]`, window row `window[0]`, `context_lens` 0. `gather_read` gives it NaN (a softmax over
#    nothing but minus infinity); make it return zeros for such a row, as the package's gather
#    does with `torch.where`, and assert that `gather_read`, `inplace_read` (whose last lines
#    already guard it: there `l` is 0) and `setup["gather"]._one_query_rows` all give that row
#    exactly 0.0 everywhere.

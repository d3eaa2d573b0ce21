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
# # Day 24 — Batched decode over paged rows
#
# Yesterday's packed row prefilled several prompts in one step. After that, every step is a
# decode step: each running sequence brings exactly one new token, its newest, and attends over
# everything before it. One token per row makes the step regular in its queries and ragged in
# its keys: the rows' contexts have different lengths, and since Day 15 each context lives in
# whatever blocks of the shared pool the allocator handed out, scattered and interleaved with
# the other rows' blocks.
#
# Day 21 measured why this step is worth batching: a decode step reads every weight once, for
# one row or for sixteen. What makes it possible is that a row's attention needs only three
# facts the plan can carry as tensors: where its new K/V goes (a slot), which slots hold its
# context (a row of slot numbers, from its block table), and how many of them count (its
# length). `BatchedPagedKVCache` holds the pool; `view(plan)` binds it to one step's plan as a
# `BatchedCacheRows`, the object the model writes to and reads from.
#
# 1. four real prompts through an engine with small blocks: whose blocks sit where in the pool,
# 2. the next decode step's tensors: block tables, lengths, positions, write slots, windows,
# 3. the step built by hand (a slot per position from the block table, softmax per row) against
#    the package's,
# 4. each row's logits against the row decoded alone, and against Day 11's contiguous cache,
# 5. what the engine's read copies: `attention="gather"` and each row's padded window,
# 6. a wrong length, one slot past a row's end, caught by the logits and by a check of lengths,
# 7. one batched step against the rows one by one, 1 to 16 rows (`days/day24/decodebench.py`),
# 8. the diagram.

# %%
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, engine_config, read_csv
from nanoserve.bench import cpu_line
from nanoserve.cache import BatchedCacheRows
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.engine import Engine
from nanoserve.models import load_model
from nanoserve.plan import plan_decode
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day24"))
import decodebench  # the day's script: the notebook times with its functions and reads its table

# One thread: on a machine shared with other jobs two threads that wait for each other at every
# op slow down far more than one.
torch.set_num_threads(1)
MODEL_DIR = fetch_default_model()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
TOL = decodebench.TOL
BS = 4  # small blocks, so four short prompts already own several each
TEXTS = ["The capital of France is", "Write one sentence about the sea.", "def add(a, b):\n    return",
         "List three colours:"]  # fmt: skip
prompts = [tok.encode(t) for t in TEXTS]
per_block = model.cfg.kv_bytes_per_token(model.dtype) * BS
# the engine as of today: static schedule, attention by gather, the model's own linears (so
# cells outside the engine run the same model); its add_request and step are Day 34's API
config = engine_config(24, block_size=BS, max_model_len=128, kv_budget=64 * per_block)
eng = Engine(model, tok, config)
for p in prompts:
    eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
for _ in range(4):  # the prefill step and three decode steps
    eng.step()
print("prompt lengths:", [len(p) for p in prompts], "| steps:", eng.step_kinds["prefill"], "prefill,",
      eng.step_kinds["decode"], "decode")  # fmt: skip
print(eng.pool.describe())

# %% [markdown]
# ## 1. Four rows in one pool
#
# The prefill step gave each prompt the blocks its tokens fill, in order, so the first blocks
# of the pool went 0-1 to the first prompt, 2-3 to the second and so on. Each decode step since
# then has asked the allocator for a new block whenever a sequence's next token starts one, and
# the allocator hands out the next free block, so later blocks land between rows. A sequence's
# newest token, sampled by the last step, has no slot yet: the scheduler gives it one when it
# puts the row into the next decode step.

# %%
running = sorted(eng.scheduler.running, key=lambda s: s.arrival)
owner = {b: i for i, s in enumerate(running) for b in s.block_table.blocks}
for i, s in enumerate(running):
    print(f"row {i} ({s.request_id}): {len(s.token_ids):>2} tokens, blocks {s.block_table.blocks}")
print("pool blocks 0-15, by row:", " ".join(str(owner.get(b, ".")) for b in range(16)))

# %% [markdown]
# ## 2. What a decode step reads
#
# The scheduler's next batch is a decode batch of all four rows (Day 26 opens the scheduler;
# here it only hands over the running rows), and `ModelRunner.plan` turns it into a
# `plan_decode` plan. Every tensor in it is per row, except the window, which is per
# row and per position:

# %%
batch = eng.scheduler.schedule()
plan = eng.runner.plan(batch)
assert batch.is_decode and plan.is_decode and list(plan.rows) == running
for name in ("input_ids", "positions", "write_slots", "context_lens", "logits_at"):
    print(f"{name:<13}", getattr(plan, name).tolist())
print("slot_window  ", tuple(plan.slot_window.shape), "(rows, W): W = the most blocks any row has x", BS)
for r in range(len(plan.rows)):
    ctx = plan.context_lens[r].item()
    window = plan.slot_window[r].tolist()
    print(f"  row {r}: {window[:ctx]} | {window[ctx:]}")
owner = {b: i for i, s in enumerate(plan.rows) for b in s.block_table.blocks}  # with the new blocks
print("blocks after scheduling:", [s.block_table.blocks for s in plan.rows])
print("pool blocks 0-15, by row:", " ".join(str(owner.get(b, ".")) for b in range(16)))
assert plan.context_lens.tolist() == [len(s.token_ids) for s in plan.rows]
assert plan.positions.tolist() == [len(s.token_ids) - 1 for s in plan.rows]

# %% [markdown]
# Scheduling the step gave rows 0 and 2 one block each for their newest tokens, blocks 10 and
# 11, so the pool now reads 0 0 1 1 2 2 2 3 3 1 0 2: no row's blocks are contiguous past its
# prompt. Read row 0: its newest token sits at position 8, so its K/V is written to slot 40
# (block 10, offset 0) and it attends over 9 positions, the slots left of the bar. Right of the bar is
# padding: the window is as wide as the longest row's blocks (16 slots here), and a row with
# fewer blocks is filled out with block 0's slots, 0 to 3. Those belong to row 0. Nothing stops
# row 3 from reading them except its length, 8; the length is the row's whole protection.
#
# ## 3. The step by hand
#
# A cache object of our own over copies of the engine's pools: `write` turns each row's
# position into a slot through its block table (block `pos // 4`, offset `pos % 4`) and stores
# the new K/V there; `attention` gathers each row's context the same way and runs the softmax
# itself. GQA: each of SmolLM2's 3 K/V heads serves 3 of its 9 query heads.


# %%
class HandRows:
    """Decode over paged rows, from the block tables alone; pools are copies of the engine's."""

    def __init__(self, seqs, k_pools, v_pools, block_size):
        self.seqs, self.bs = seqs, block_size
        self.k = [k.clone() for k in k_pools]  # (slots + 1, kv_heads, head_dim) per layer
        self.v = [v.clone() for v in v_pools]

    def slot(self, seq, pos):
        return seq.block_table.blocks[pos // self.bs] * self.bs + pos % self.bs

    def write(self, layer, k, v):  # k, v: (rows, kv_heads, head_dim), one new token per row
        for r, seq in enumerate(self.seqs):
            s = self.slot(seq, len(seq.token_ids) - 1)
            self.k[layer][s], self.v[layer][s] = k[r], v[r]

    def attention(self, layer, q):  # q: (rows, heads, head_dim)
        out = []
        for r, seq in enumerate(self.seqs):
            slots = [self.slot(seq, p) for p in range(len(seq.token_ids))]
            k = self.k[layer][slots].repeat_interleave(q.shape[1] // self.k[layer].shape[1], dim=1)
            v = self.v[layer][slots].repeat_interleave(q.shape[1] // self.v[layer].shape[1], dim=1)
            scores = torch.einsum("hd,thd->ht", q[r], k) / q.shape[-1] ** 0.5  # (heads, ctx)
            out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v))  # (heads, head_dim)
        return torch.stack(out)


hand = HandRows(plan.rows, eng.cache.k, eng.cache.v, BS)
by_hand = model(plan.input_ids, plan.positions, hand, logits_at=plan.logits_at)  # (4, vocab)
rows_view = eng.cache.view(plan)
print(type(rows_view).__name__, "bound to this step's plan:", rows_view.plan is plan)
batched = model(plan.input_ids, plan.positions, rows_view, logits_at=plan.logits_at)  # (4, vocab)
diff = (by_hand - batched).abs().max().item()
print(f"by hand against the package's batched step: max |difference| {diff:.1e}")
print("greedy tokens:", batched.argmax(-1).tolist(), [tok.decode([t]) for t in batched.argmax(-1).tolist()])
assert isinstance(rows_view, BatchedCacheRows) and diff <= TOL
assert by_hand.argmax(-1).tolist() == batched.argmax(-1).tolist()

# %% [markdown]
# ## 4. Each row, alone
#
# The claim of batching is that a row's result does not depend on its neighbours. Each row as
# a decode step of its own (`plan_decode([seq])`, through the same runner and pool), and, as an
# outside reference, each sequence through Day 11's contiguous cache: its tokens but the newest
# prefilled, then the newest decoded.


# %%
def contiguous_decode(seq):
    ids = seq.token_ids
    cache = ContiguousKVCache(model.cfg, len(ids))
    for part in (torch.arange(len(ids) - 1), torch.tensor([len(ids) - 1])):  # prefill, then decode
        cache.begin(part)
        logits = model(torch.tensor(ids)[part], part, cache, logits_at=part[-1:] - part[0])
    return logits[0]


for r, seq in enumerate(plan.rows):
    alone = eng.runner.execute(plan_decode([seq], BS))[0]
    day11 = contiguous_decode(seq)
    a, b = (alone - batched[r]).abs().max().item(), (day11 - batched[r]).abs().max().item()
    print(f"row {r}: batched against alone {a:.1e}, against the contiguous cache {b:.1e}")
    assert a <= TOL and b <= TOL and alone.argmax() == batched[r].argmax() == day11.argmax()

# %% [markdown]
# Equal within the tolerance of 1e-3 on fp32 logits, the differences a few times 1e-5: the
# rounding of matrix products over 4 rows instead of 1, and of SDPA over a padded window
# against the contiguous cache's exact one.
#
# ## 5. What the read copies
#
# The engine as of today reads decode rows by gathering (`cache.attention` is `"gather"`, the
# way Day 18 built it): it copies every row's whole window out of the pool, padding included,
# into a `(rows, W, kv_heads, head_dim)` tensor, masks the positions past each row's length and
# runs SDPA. The copy is the price of reading scattered blocks as one tensor; its size is
# arithmetic on the plan:

# %%
print("engine cache reads by:", eng.cache.attention)
assert eng.cache.attention == "gather"
c = decodebench.counts(model.cfg, plan.rows, BS)
print(f"K/V the rows own: {c['kv_mb']} MB over 30 layers; gather copies {c['gather_mb']} MB "
      f"(4 rows x W = {c['window']} positions)")  # fmt: skip

# %% [markdown]
# Here the rows hold 41 positions between them and gather copies 64, about 1.6 times; the
# ratio is the window's width over the mean length, so it grows with the spread of lengths
# (section 7 has 16 rows with contexts of 53 to 254 tokens). Day 58 builds a kernel that reads
# each row's slots in place instead.
#
# ## 6. One slot past the end
#
# A plan whose length for a row is one too many. Row 3 is the interesting one: its 8 tokens
# fill its two blocks exactly, so the slot after its last is the first slot of the window's
# padding, slot 0, which holds row 0's first token. The planted plan is a copy of the real one
# with row 3's `context_lens` raised by one. Besides the logits, a check of our own that needs
# no forward: a decode row at position p attends over exactly p + 1 positions, and never over
# more slots than its block table holds.

# %%
wrong = plan_decode(plan.rows, BS)
wrong.context_lens[3] += 1
extra = wrong.slot_window[3, plan.context_lens[3]].item()
print(f"row 3 now reads position {plan.context_lens[3].item()}: slot {extra}, in block {extra // BS}, "
      f"row {owner[extra // BS]}'s")  # fmt: skip
leaked = model(wrong.input_ids, wrong.positions, eng.cache.view(wrong), logits_at=wrong.logits_at)
moved = (leaked - batched).abs().amax(-1)
print("logits moved, per row:", [f"{m:.2f}" for m in moved.tolist()])
try:
    for r in range(len(plan.rows)):
        if moved[r] > TOL:
            raise AssertionError(f"row {r}'s logits differ from the row alone by {moved[r]:.2f}")
    raise RuntimeError("the wrong length went unnoticed")
except AssertionError as e:
    print("caught by the logits:", e)


def check_lengths(plan, bs):
    """Each decode row attends over its position + 1 slots, all within its block table."""
    for r, seq in enumerate(plan.rows):
        pos, n = plan.positions[r].item(), plan.context_lens[r].item()
        if n != pos + 1:
            raise AssertionError(f"row {r} sits at position {pos} but attends over {n} positions")
        if n > len(seq.block_table.blocks) * bs:
            raise AssertionError(f"row {r} attends over {n} positions, its table holds fewer")


check_lengths(plan, BS)  # the real plan passes
try:
    check_lengths(wrong, BS)
    raise RuntimeError("the wrong length passed the check")
except AssertionError as e:
    print("caught by check_lengths:", e)
assert moved[:3].max() == 0

# %% [markdown]
# One extra key, row 0's first token, moved row 3's logits by 1.37; the other rows are
# untouched, since lengths are per row. `check_lengths` refuses the plan without running
# anything, on its first rule: position 7 with 9 positions. Its second rule, the block table's
# size, would also catch this row (9 positions, 8 slots), but not a row whose last block had
# room left; the first rule is the one that guards lengths. (Day 54 builds the package's own
# checks of a plan on these rules.)
#
# ## 7. One step for all, or one row at a time
#
# `decodebench` runs the comparison: the same rows decoded as one batched step and one by one,
# both reading by gather, with the same logits asserted. First the notebook's four rows, once
# each (the times are this run's):

# %%
timed = {}
for way in decodebench.WAYS:
    logits, timed[way] = decodebench.run_way(way, model, eng.cache, list(plan.rows), BS)
    assert (logits - batched).abs().max().item() <= TOL

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
for way, seconds in timed.items():
    print(f"{way:<16} {1e3 * seconds:7.1f} ms a step, {1e3 * seconds / 4:6.1f} ms a token "
          f"({seconds / timed['batched']:.2f}x batched)")  # fmt: skip

# %% [markdown]
# The script's run on SmolLM2: sixteen prompts of 52 to 253 random tokens prefilled into one
# pool (blocks of 16), then the decode step for the first 1, 2, 4, 8 and 16 of them, every way
# three times in turn, fastest kept, one thread. Its table (`day-24-decode.csv`):

# %%
committed = read_csv(decodebench.CSV_DECODE)
cols = [c for c in committed[0] if c != "cpu"]  # the cpu column names the machine of the run
print(" | ".join(cols))
for r in committed:
    print(" | ".join(r[c] for c in cols))
lens = [len(p) for p in decodebench.prompts(16)]
for r in committed:  # the counts are arithmetic on the prompts: they must reproduce
    n = int(r["rows"])
    assert (int(r["ctx_min"]), int(r["ctx_max"])) == (min(lens[:n]) + 1, max(lens[:n]) + 1)

# %% [markdown]
# At one row the two ways are the same computation, and their times (36.0 and 35.7 ms) show
# the noise. From there the batched step's time per token falls as rows join, 36.0 ms at 1
# row to 6.7 ms at 16, while one by one stays where one row is (35.5 to 36.2 ms), so at 16
# rows the batched step made 149.1 tokens a second against 28.2, 5.29 times as many. The step
# itself took 107.3 ms for 16 rows against 36.0 ms for one: sixteen times the tokens for under
# three times the time, because the weights, which dominate a decode step, are read once
# either way. Both ways read the K/V by gather, so the batched step at 16 rows also copied
# 188.744 MB of windows for the 125.292 MB the rows own; that copy grows with the rows and is
# part of why the step's time grows at all.
#
# The run had the machine to itself; the per-token times of one by one, flat within 1 ms from
# 1 row to 16, show how little noise there was.
#
# ## 8. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple"]

ax = axes[0, 0]
used = max(owner) + 1
for b in range(used):
    r = owner.get(b)
    ax.add_patch(plt.Rectangle((b, 0), 0.92, 0.9, color=colors[r] if r is not None else "lightgray"))
    ax.text(b + 0.46, 0.45, f"{b}", ha="center", va="center", fontsize=8, color="white")
ax.set_xlim(0, used)
ax.set_ylim(-0.1, 1.0)
ax.set_yticks([])
ax.set_xlabel(f"block of the pool ({BS} slots each), colored by the row that owns it")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors]
ax.legend(handles, [f"row {i}: {len(s.token_ids)} tokens" for i, s in enumerate(plan.rows)], fontsize=8,
          ncols=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))  # fmt: skip
ax.set_title("Section 1: four sequences' blocks in one pool")

ax = axes[0, 1]
W = plan.slot_window.shape[1]
for r in range(len(plan.rows)):
    ctx = plan.context_lens[r].item()
    for p in range(W):
        slot = plan.slot_window[r, p].item()
        face = colors[owner[slot // BS]]
        ax.add_patch(plt.Rectangle((p, r), 0.95, 0.9, color=face, alpha=1.0 if p < ctx else 0.25))
        ax.text(p + 0.47, r + 0.45, str(slot), ha="center", va="center", fontsize=7)
    pos = plan.positions[r].item()
    ax.add_patch(plt.Rectangle((pos, r), 0.95, 0.9, fill=False, lw=2, ec="black"))
ax.set_xlim(0, W)
ax.set_ylim(len(plan.rows), 0)
ax.set_yticks([r + 0.45 for r in range(len(plan.rows))], [f"row {r}" for r in range(len(plan.rows))])
ax.set_xlabel("position in the row's window (faded: past context_lens, masked)")
ax.set_title("Section 2: slot_window, the new token's slot boxed")

rows_n = sorted({int(r["rows"]) for r in committed})
styles = {"batched": ("tab:green", "o-"), "one by one": ("tab:red", "^-")}
panels = ((axes[1, 0], "ms_per_token", "ms per generated token"), (axes[1, 1], "tok_s", "tokens/s"))
for ax, col, label in panels:
    for way, (color, style) in styles.items():
        cell = {int(r["rows"]): float(r[col]) for r in committed if r["way"] == way}
        ys = [cell[n] for n in rows_n]
        ax.plot(rows_n, ys, style, color=color, label=way)
    ax.set_xscale("log", base=2)
    ax.set_xticks(rows_n, [str(n) for n in rows_n])
    ax.set_xlabel("rows in the decode step")
    ax.set_ylabel(label)
    ax.legend(fontsize=8)
axes[1, 0].set_title("SmolLM2: time per token (day-24-decode.csv, shared machine)")
axes[1, 1].set_title("SmolLM2: tokens a second from one decode step")

fig.suptitle("Day 24: one decode step over paged rows of different lengths (fp32, CPU)", fontsize=14)
fig.tight_layout()
png = diagram_path("day24-batched-decode.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** V1 gives every step a `CommonAttentionMetadata`
#   (`vllm/v1/attention/backends/utils.py`) whose `block_table_tensor`, shape (requests,
#   max blocks), is our block tables padded to a common width, `seq_lens` our `context_lens`,
#   and `slot_mapping` our `write_slots`; `reshape_and_cache_flash` (`csrc/cache_kernels.cu`)
#   writes the step's K/V to those slots. The attention kernels (FlashAttention's
#   `flash_attn_varlen_func` with a `block_table`, or the older `paged_attention_v1/v2`
#   kernels of `csrc/attention/`) read each row's blocks in place through the table and stop
#   at its length, as Day 58's native kernel does here; none of them copies a padded window.
#   Unused entries of the block table are just never reached, as our padding with block 0 is.
# * **SGLang** keeps a `req_to_token` table (`ReqToTokenPool`) that maps every request's
#   positions straight to K/V slots, a page size of 1 by default, and a decode `ForwardBatch`
#   carries `seq_lens` and `out_cache_loc` (the slots the new tokens go to); the FlashInfer
#   backend turns the table into `kv_indptr` / `kv_indices` for its batched decode wrapper.
# * **TensorRT-LLM**'s generation phase reads a paged K/V cache through per-request block
#   offsets (`kv_cache_block_offsets`) with `tokens_per_block` slots each, and its in-flight
#   batching puts every generating request into the same step.
# * **llama.cpp** does not page by block table: the KV cache is one array of cells, each cell
#   tagged with the sequences it belongs to, and a batch of one token per slot (`-np`) builds a
#   mask over the cells so each token sees only its own sequence's cells, which is the
#   block-diagonal idea of Day 23 applied to decode.

# %% [markdown]
# ## Try it
#
# 1. **Miss by one the other way.** Lower row 1's `context_lens` by one in a copy of the plan:
#    the row then ignores its own newest token's K/V. `check_lengths` must refuse it with
#    "row 1 sits at position 10 but attends over 10 positions", and the logits check must
#    catch row 1 alone.
# 2. **Point a window at the wrong block.** In a copy of the plan, set
#    `slot_window[2, 0] = slot_window[0, 0]` (row 2 reads row 0's first token instead of its
#    own): `check_lengths` must pass, since every length is right, and the logits must move
#    for row 2 alone (`moved[2] > TOL`, the other three 0). Which fact of the plan would a
#    check have to compare to catch it without a forward?
# 3. **Spread the lengths.** Run `python days/day24/decodebench.py --prompt 16 1024 --rows 16
#    --out /tmp/d.csv`. Before it finishes, predict its `gather_mb / kv_mb` from the prompt
#    lengths alone: with `lens = [len(p) + 1 for p in decodebench.prompts(16, (16, 1024))]`
#    (each row's context, its prompt and its first token), the window is the longest rounded
#    up to a whole block of 16, and the ratio is `16 * window / sum(lens)`. Check: your number
#    must equal the new CSV's `gather_mb / kv_mb` to three decimals; with the default lengths,
#    `(32, 256)`, the same formula must give the ratio of the committed table's 188.744 and
#    125.292 MB at 16 rows.
#    Does the wider spread give a larger ratio? Only the longest row against the mean decides.

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
# # Day 17 — Paged write: slot mapping
#
# Day 16 turned a byte budget into pools: per layer, one K tensor and one V tensor of
# `num_slots + 1` rows, every row one token's key (or value) for all K/V heads. Day 15's block
# table says which slot holds position p of a sequence. Today the model writes into them.
#
# Day 11's contiguous cache had one tensor per sequence and wrote a step's keys into a slice,
# `[start, length)`. A step over the pools carries tokens of several sequences at once, each
# with its own blocks scattered over the pool, so there is no slice. Instead the step carries
# a slot mapping: for each of its N new tokens, the slot its K and V go to. Then one
# `index_put_` per pool writes all N rows, whichever sequences and blocks they belong to.
# Getting that mapping wrong by one slot is the classic bug of this design, and it does not
# hurt the sequence that made it so much as its neighbour.
#
# 1. the slot mapping of a prefill step built by hand from block tables, against
#    `nanoserve.plan.plan_prefill`,
# 2. the write: the pools before and after, one `index_put_` per pool per layer, by hand against
#    `BatchedPagedKVCache`,
# 3. two decode steps (`plan_decode`), one of which needs a new block, and logits equal to each
#    sequence's own run through Day 11's contiguous cache,
# 4. an off-by-one slot: it overwrites the other sequence's first token, whose next logits
#    change, caught against its own clean run and by the package's addressing gate,
# 5. the paged write timed against the contiguous one (`days/day17/slotwrite.py`),
# 6. the diagram.

# %%
import sys
from collections import Counter

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display
from torch.overrides import TorchFunctionMode

from nanocourse import REPO, as_text, diagram_path, read_csv, show
from nanoserve.bench import cpu_line
from nanoserve.blocks import BlockAllocator
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.errors import GateError
from nanoserve.plan import check_plan_addressing, plan_decode, plan_prefill

sys.path.insert(0, str(REPO / "days" / "day17"))
import slotwrite  # the day's script: the notebook calls its functions and prints its tables

torch.set_num_threads(2)
model = slotwrite.tiny_model()
cfg = model.cfg
BS = slotwrite.BLOCK
print(
    f"tiny Llama: {cfg.num_layers} layers, {cfg.num_heads} query heads, {cfg.num_kv_heads} K/V heads, "
    f"head_dim {cfg.head_dim}; weights N(0, {slotwrite.STD}); block size {BS}, "
    f"{slotwrite.NUM_BLOCKS} blocks"
)
prompts = slotwrite.prompts()
for name, ids in prompts.items():
    print(f"prompt {name}: {len(ids)} tokens {ids}")


# %% [markdown]
# First the reference. Each sequence runs alone through Day 11's `ContiguousKVCache`: a
# prefill, then two greedy decode steps. Their tokens are what the paged steps below feed
# back, and their logits are what the paged steps must reproduce.

# %%
clean = {name: slotwrite.clean_run(model, ids, slotwrite.DECODE_STEPS) for name, ids in prompts.items()}
tokens = {name: t for name, (t, _) in clean.items()}
for name, (t, lg) in clean.items():
    print(f"{name} alone, contiguous cache: greedy tokens {t}, logits {tuple(lg.shape)}, "
          f"largest |logit| {lg.abs().max():.2f}")  # fmt: skip

# %% [markdown]
# ## 1. The slot mapping of a prefill step
#
# A fresh allocator with 8 blocks of 4 slots gives A's 3-token prompt block 0 and B's
# 6-token prompt blocks 1 and 2. Position p of a sequence lives in its table's entry p // 4, at
# offset p % 4 in that block, so its slot is `blocks[p // 4] * 4 + p % 4`. One step prefills
# both prompts, packed end to end: 9 tokens, 9 slots.

# %%
allocator = BlockAllocator(slotwrite.NUM_BLOCKS, BS, enable_prefix_caching=False)
seqs = slotwrite.new_sequences(allocator)
A, B = seqs["A"], seqs["B"]
print("block tables: A", A.block_table.blocks, " B", B.block_table.blocks)
by_hand = []
for seq in (A, B):
    for p in range(len(seq.token_ids)):
        block, offset = seq.block_table.blocks[p // BS], p % BS
        by_hand.append(block * BS + offset)
        print(f"  {seq.request_id} position {p}: table entry {p // BS} -> block {block}, offset {offset} "
              f"-> slot {block * BS + offset}")  # fmt: skip
prefill = plan_prefill([(A, 0, len(A.token_ids)), (B, 0, len(B.token_ids))], BS)
print("by hand:              ", by_hand)
print("plan_prefill.write_slots", prefill.write_slots.tolist())
assert by_hand == prefill.write_slots.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]

# %% [markdown]
# Slot 3 is not in the list: A's block has room for a fourth token, which it does not have
# yet. The plan also carries what attention will need: each row's slot window (its blocks'
# slots, padded with block 0's up to the widest row) and its context length.

# %%
print("input_ids   ", tuple(prefill.input_ids.shape), prefill.input_ids.tolist())
print("positions   ", prefill.positions.tolist())
print("slot_window ", prefill.slot_window.tolist())
print("context_lens", prefill.context_lens.tolist())

# %% [markdown]
# ## 2. The write
#
# `BatchedPagedKVCache` allocates a layer's pools on that layer's first write, so before the
# step there is nothing. Each block of the model hands the cache its new keys and values,
# (N, kv_heads, head_dim) for the step's N tokens, and `write` is
# `k_pool.index_put_((write_slots,), k)` and the same for V. To see what each layer handed
# over, the cache below keeps a copy.


# %%
class Recorded(BatchedPagedKVCache):
    """The package's cache, keeping the K and V each layer's write was given."""

    def write(self, layer, k, v, plan):
        self.seen[layer] = (k.clone(), v.clone())
        super().write(layer, k, v, plan)


class CountCalls(TorchFunctionMode):
    """Counts the torch functions and tensor methods called from Python while it is on."""

    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


cache = Recorded(cfg, slotwrite.NUM_BLOCKS * BS, attention="gather")
cache.seen = {}
print("before the step: K pool of layer 0 is", cache.k[0])
with CountCalls() as counted:
    logits0 = model(prefill.input_ids, prefill.positions, cache.view(prefill), logits_at=prefill.logits_at)
puts = counted.calls["index_put_"]
print(f"after: {cfg.num_layers} layers x (K pool, V pool) of shape {tuple(cache.k[0].shape)}")
print(f"index_put_ calls in the step: {puts} (one per pool per layer)")
assert puts == 2 * cfg.num_layers

# %% [markdown]
# The same write by hand: start from a zero pool of the same shape and put layer 0's nine
# key rows at the nine slots. It must equal the package's pool exactly, and the pool's rows
# that are not zero must be exactly the slots of the mapping (the sink, index 32, included
# among the untouched ones).

# %%
k0, v0 = cache.seen[0]
print("layer 0 handed over k", tuple(k0.shape), "and v", tuple(v0.shape))
mine = torch.zeros_like(cache.k[0]).index_put_((prefill.write_slots,), k0)
assert torch.equal(mine, cache.k[0]) and torch.equal(cache.v[0][prefill.write_slots], v0)
filled = cache.k[0].flatten(1).any(1).nonzero().flatten().tolist()
print("rows of the K pool that are not zero:", filled)
assert filled == prefill.write_slots.tolist()
print("K pool, layer 0, head 0, first 4 numbers of slots 0-9:")
print(cache.k[0][:10, 0, :4])

# %% [markdown]
# Row 3 is still zero, between A's three keys and B's first. A map of the pool makes the
# ownership visible; `pool_map` labels each non-zero row with the sequence and position whose
# key it holds, read from the worked example's table (`slot_rows`, equal to the committed
# `day-17-slots.csv`), and checks that the zero rows are exactly the unlabelled ones.

# %%
slot_table = slotwrite.slot_rows(tokens)
assert as_text(slot_table) == read_csv(slotwrite.CSV_SLOTS), "rerun slotwrite.py"
STEPS = ["prefill", "decode 1", "decode 2"]


def pool_map(pool, upto: str, layer_rows=None) -> str:
    """One line per block: each slot labelled with the token whose K it holds, '--' if zero."""
    steps = STEPS[: STEPS.index(upto) + 1]
    owner = {int(r["slot"]): f"{r['seq']}{r['position']}" for r in slot_table if r["step"] in steps}
    nonzero = set(pool.flatten(1).any(1).nonzero().flatten().tolist())
    assert nonzero == set(owner), f"non-zero rows {sorted(nonzero)}, expected {sorted(owner)}"
    lines = []
    for b in range(slotwrite.NUM_BLOCKS):
        cells = [owner.get(s, "--") for s in range(b * BS, (b + 1) * BS)]
        lines.append(f"  block {b}: " + " ".join(f"{c:>3}" for c in cells))
    lines.append(f"  sink {pool.shape[0] - 1}: {'set' if pool[-1].any() else ' --'}")
    return "\n".join(lines)


print("after prefill, layer 0 K pool:")
print(pool_map(cache.k[0], "prefill"))
print(f"prefill logits against each sequence alone: A {(logits0[0] - clean['A'][1][0]).abs().max():.1e}, "
      f"B {(logits0[1] - clean['B'][1][0]).abs().max():.1e}")  # fmt: skip

# %% [markdown]
# ## 3. Two decode steps
#
# Each sequence now appends its first greedy token and decodes it: one row per sequence, one
# token per row, written at the slot of its newest position. A's position 3 fills the last
# slot of block 0. At the second step A's position 4 starts a new table entry, so
# `append_slots` hands it the next free block, block 3: A's table becomes [0, 3], not
# contiguous in the pool, and it does not matter to anything downstream. `step_logits` runs
# one planned step and returns its logits; both steps' slots are checked by hand, and every
# row's logits against that sequence's clean run, within `TOL`.

# %%
TOL = 1e-5  # fp32: the paged and contiguous paths sum the same terms in different orders


def step_logits(plan):
    return model(plan.input_ids, plan.positions, cache.view(plan), logits_at=plan.logits_at)  # (B, V)


def check_matches_clean(name, step, got, want, tol=TOL):
    diff = (got - want).abs().max().item()
    if not diff < tol:
        raise AssertionError(
            f"{name}, step {step}: max |logit difference| {diff:.2e} from its own clean run (bound {tol:g})"
        )
    return diff


for step in (1, 2):
    for name, seq in seqs.items():
        slotwrite.grow(allocator, seq, tokens[name][step - 1])
    plan = plan_decode([A, B], BS)
    hand = [slotwrite.slot_of(s.block_table.blocks, len(s.token_ids) - 1)[2] for s in (A, B)]
    assert hand == plan.write_slots.tolist()
    out = step_logits(plan)
    diffs = [check_matches_clean(s.request_id, step, out[r], clean[s.request_id][1][step])
             for r, s in enumerate((A, B))]  # fmt: skip
    print(f"decode {step}: tables A {A.block_table.blocks} B {B.block_table.blocks}; positions "
          f"{plan.positions.tolist()} -> write_slots {plan.write_slots.tolist()} (by hand {hand}); "
          f"logits vs clean: A {diffs[0]:.1e}, B {diffs[1]:.1e}")  # fmt: skip
print("after decode 2, layer 0 K pool:")
print(pool_map(cache.k[0], "decode 2"))

# %% [markdown]
# Paged and contiguous agree to within 1e-6 on logits that reach 2.3 to 2.6 (the two runs add
# the same terms in a different order), at the prefill and at both decode steps, for both
# sequences. The two sequences never see each other's slots: each reads
# only its own window, up to its own length (Day 18 builds that read).
#
# ## 4. One slot off
#
# Now the same three steps with one planted mistake: in the first decode step, A's slot is
# computed one too far, 3 + 1 = 4. Slot 4 is B's, the key of B's position 0, written at
# prefill. Nothing fails when the step runs: `index_put_` writes wherever it is told.


# %%
def run_steps(off_by_one_at=None):
    """The example's prefill and two decode steps on a fresh pool; with `off_by_one_at`, A's
    write slot at that decode step is one too far. Returns (cache, logits per step, plans)."""
    global cache
    cache = BatchedPagedKVCache(cfg, slotwrite.NUM_BLOCKS * BS, attention="gather")
    out, plans = [], []
    for step, plan, _ in slotwrite.example_steps(tokens):
        if step == off_by_one_at:
            plan.write_slots = plan.write_slots.clone()
            plan.write_slots[0] += 1  # row 0 is A
        out.append(step_logits(plan))
        plans.append(plan)
    return cache, out, plans


good_cache, good_logits, good_plans = run_steps()
bad_cache, bad_logits, bad_plans = run_steps(off_by_one_at=1)
print("decode 1 write_slots with the bug:", bad_plans[1].write_slots.tolist(), "(right: [3, 10])")
# layer 0's keys depend on the token and its position only, so A3's key is the same in both runs
lost = torch.equal(bad_cache.k[0][4], good_cache.k[0][3]) and not bad_cache.k[0][3].any()
print(f"layer 0: slot 4 holds A's position-3 key, where B's position 0 was; slot 3 is zero: {lost}")
assert lost
for step in (1, 2):
    diffs = {s: (bad_logits[step][r] - clean[s][1][step]).abs().max().item() for r, s in enumerate("AB")}
    picks = bad_logits[step].argmax(-1).tolist()
    print(f"decode {step}: max |logit difference| from the clean runs: A {diffs['A']:.3f}, "
          f"B {diffs['B']:.3f}; greedy picks {picks}, clean {[clean[s][0][step] for s in 'AB']}")  # fmt: skip

# %% [markdown]
# Slot 3 stayed empty, so A attends to a zero key at its own position, and B's position 0 now
# holds A's key, so B attends to a token it never had. B did nothing wrong and its logits
# moved anyway, by far more than the tolerance. The check that catches it is the one from
# section 3: each sequence against its own clean run. It is run on B, the bystander:

# %%
try:
    for step in (1, 2):
        check_matches_clean("B", step, bad_logits[step][1], clean["B"][1][step])
except AssertionError as e:
    print("caught:", e)
else:
    raise AssertionError("B's logits after A's off-by-one write should have been caught")

# %% [markdown]
# A cheaper witness exists before any logits are computed. `check_plan_addressing`, one of
# `nanoserve.plan`'s gates (Days 51 and 52 run it on their decode plans), asks of every decode
# row whether it writes where its own window says its position lives. The right plan
# passes; the planted one does not.

# %%
check_plan_addressing(good_plans[1])
print("check_plan_addressing, right plan: passes")
try:
    check_plan_addressing(bad_plans[1])
except GateError as e:
    print("check_plan_addressing, off-by-one plan, caught:", e)
else:
    raise AssertionError("the gate should have refused a row writing outside its window")

# %% [markdown]
# ## 5. The write, timed against the contiguous one
#
# `slotwrite.write_table` times one layer's write at SmolLM2's shape (3 K/V heads x 64, fp32).
# The paged write is the cache's `write`: one `index_put_` into each pool for all the step's
# tokens, at slots in random blocks. The earlier way is Day 11's `ContiguousKVCache.write`,
# one slice copy per sequence. A decode step of R rows is then R copies into R caches against
# one scatter; a prefill of one sequence is one slice copy against a scatter into its blocks.
# Both ways are checked to hold the same rows afterwards. The writes run on one thread, the
# script's default: a write that takes microseconds, split over two threads of a small machine
# that other jobs share, can wait far longer than that for its second thread to be scheduled,
# and would then time the scheduler, not the write. A live run of two cases:

# %%
# NBVAL_IGNORE_OUTPUT
torch.set_num_threads(1)
print(cpu_line())
for case, per_seq in (("decode, 16 rows", [1] * 16), ("prefill, 512 tokens", [512])):
    r = slotwrite.write_row(case, per_seq, reps=50)
    print(f"{case:>20}: paged {r['paged_us']} us, contiguous {r['contiguous_us']} us, "
          f"contiguous / paged {r['contiguous_over_paged']}")  # fmt: skip
torch.set_num_threads(2)

# %% [markdown]
# The script's run (`day-17-write.csv`, one thread, the least of 300 runs each, the two ways
# in turn), read back. `bytes` is a fact; the times are that run's, on one thread of an AVX-512
# CPU, as the cpu column says:

# %%
writes = read_csv(slotwrite.CSV_WRITE)
show(writes, list(writes[0]))

# %% [markdown]
# For decode the paged write wins and the gap grows with the rows: 2.00x at 1 row, 6.69x at 4,
# 19.22x at 16 and 37.27x at 64, because the contiguous way pays a Python call and a small copy
# per sequence while the pool takes every row in one call. At 64 rows the scatter took 10.4 µs
# and the 64 copies 388.9 µs. For one long prefill it loses from 128 tokens on, and by more as
# the prompt grows: at 128, 512 and 2048 tokens the slice copy took 0.52, 0.32 and 0.27 of the
# scatter's time. Writing into one contiguous range is a plain memory copy; `index_put_` has to
# place each row separately. The engine writes one prefill per prompt but one decode row per
# running sequence every step, so the trade is the right way round; Day 21 measures paged
# against contiguous over whole runs.
#
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 10))
fig.suptitle("Day 17: the paged write (tiny Llama, block size 4; timings at SmolLM2's shape)", fontsize=13)
colors = {"A": "tab:blue", "B": "tab:orange"}


def draw_pool(ax, rows, title, highlight=None):
    ax.set_xlim(-0.5, BS - 0.5)
    ax.set_ylim(slotwrite.NUM_BLOCKS + 0.5, -0.5)
    owner = {int(r["slot"]): r for r in rows}
    for b in range(slotwrite.NUM_BLOCKS + 1):
        for o in range(BS if b < slotwrite.NUM_BLOCKS else 1):
            s = b * BS + o
            r = owner.get(s)
            face = "tab:red" if b == slotwrite.NUM_BLOCKS else (colors[r["seq"]] if r else "white")
            ax.add_patch(plt.Rectangle((o - 0.45, b - 0.4), 0.9, 0.8, facecolor=face, edgecolor="gray",
                                       alpha=0.35 if r and r["step"] == "prefill" else 0.85))  # fmt: skip
            label = "sink" if b == slotwrite.NUM_BLOCKS else (f"{r['seq']}{r['position']}" if r else "")
            ax.text(o, b - 0.05, label, ha="center", va="center", fontsize=9)
            ax.text(o, b + 0.28, f"slot {s}", ha="center", va="center", fontsize=6, color="gray")
    if highlight:
        for s, text in highlight.items():
            ax.add_patch(plt.Rectangle((s % BS - 0.45, s // BS - 0.4), 0.9, 0.8, fill=False,
                                       edgecolor="red", lw=2.5))  # fmt: skip
            ax.text(BS - 0.4, s // BS, text, color="red", fontsize=8, va="center")
    ax.set_yticks(range(slotwrite.NUM_BLOCKS + 1), [f"block {b}" for b in range(slotwrite.NUM_BLOCKS)] + [""])
    ax.set_xticks(range(BS), [f"offset {o}" for o in range(BS)])
    ax.set_title(title, fontsize=10)


draw_pool(axes[0, 0], slot_table,
          "the pool after prefill + 2 decode steps: A's table [0, 3], B's [1, 2]\n"
          "(pale: written at prefill; strong: at a decode step)")  # fmt: skip
bad_rows = [r for r in slot_table if not (r["step"] == "decode 1" and r["seq"] == "A")]
bad_rows = [r for r in bad_rows if int(r["slot"]) != 4] + [
    {"slot": "4", "seq": "A", "position": "3", "step": "decode 1"}
]
draw_pool(axes[0, 1], bad_rows, "A's slot at decode 1 one too far: A3 lands on B0's slot",
          highlight={3: "empty", 4: "B0 lost"})  # fmt: skip

ax = axes[1, 0]
labels, right, wrong = [], [], []
for step in (1, 2):
    for r, s in enumerate("AB"):
        labels.append(f"{s}, decode {step}")
        right.append(max((good_logits[step][r] - clean[s][1][step]).abs().max().item(), 1e-10))
        wrong.append((bad_logits[step][r] - clean[s][1][step]).abs().max().item())
x = range(len(labels))
ax.bar([i - 0.2 for i in x], right, 0.4, color="tab:green", label="right slot mapping")
ax.bar([i + 0.2 for i in x], wrong, 0.4, color="tab:red", label="A's slot off by one at decode 1")
ax.axhline(TOL, color="k", ls="--", lw=1, label=f"bound {TOL:g}")
ax.set_yscale("log")
ax.set_ylim(1e-7, 1e4)  # room above the bars for the legend
ax.set_xticks(list(x), labels)
ax.set_ylabel("max |logit difference| from the sequence's own clean run")
ax.set_title("each sequence against its own contiguous run")
ax.legend(fontsize=8, loc="upper left", ncol=2)

ax = axes[1, 1]
for case, marker in (("decode", "o"), ("prefill", "s")):
    rows = [r for r in writes if r["case"] == case]
    n = [int(r["tokens"]) for r in rows]
    ax.plot(n, [float(r["paged_us"]) for r in rows], marker + "-", color="tab:green",
            label=f"{case}: paged, one index_put_ per pool")  # fmt: skip
    per = "row" if case == "decode" else "prompt"
    ax.plot(n, [float(r["contiguous_us"]) for r in rows], marker + "--", color="tab:purple",
            label=f"{case}: contiguous, one copy per {per}")  # fmt: skip
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("tokens written in the step (decode: one per row)")
ax.set_ylabel("µs, one layer's K and V (1 thread, least of 300)")
ax.set_ylim(top=30 * max(float(r["contiguous_us"]) for r in writes))  # room above the lines for the legend
ax.set_title("the write, SmolLM2 shape (day-17-write.csv)")
ax.legend(fontsize=8)

fig.tight_layout()
png = diagram_path("day17-paged_write.png")
fig.savefig(png, dpi=80)
plt.close(fig)
display(Image(filename=str(png)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** computes the slot mapping on the GPU for every step, as Day 15 described:
#   `BlockTable.compute_slot_mapping` (`vllm/v1/worker/block_table.py`) launches a Triton
#   kernel, `_compute_slot_mapping_kernel`, with one program per request. For each of the
#   request's tokens it takes `position // block_size` as the index into the request's row of
#   the block table, reads the block number there, and stores
#   `block_number * block_size + position % block_size`, the same formula as section 1; one more
#   program fills the unused tail of `slot_mapping` with the padding slot, -1, so a captured
#   graph always sees a buffer of the same length. The write is a CUDA kernel, `reshape_and_cache` (and
#   `reshape_and_cache_flash` for the FlashAttention layout, `csrc/cache_kernels.cu`): one
#   thread block per token reads `slot_mapping[token]`, skips the token when the slot is
#   negative (padding), and stores its key and value at that block and offset. Like ours, one
#   launch per layer writes every sequence's tokens.
# * **SGLang** names the same tensor `out_cache_loc`: the pool slots the scheduler assigned to
#   the step's new tokens. `MHATokenToKVPool.set_kv_buffer(layer, loc, cache_k, cache_v)`
#   (`python/sglang/srt/mem_cache/memory_pool.py`) writes them with an indexed store,
#   `k_buffer[layer][loc] = cache_k`, our `index_put_`.
# * **llama.cpp** finds free cells for each micro-batch in its KV cache (`find_slot`), and its
#   graph writes K and V at those cell indices (`cpy_k` and `cpy_v` of `llama_kv_cache`, built
#   on `ggml_set_rows` with the index tensor the cache hands over).
# * **nano-vllm** has the whole idea in a few lines: `prepare_prefill` and `prepare_decode`
#   build `slot_mapping` from each sequence's `block_table`, and a Triton kernel,
#   `store_kvcache_kernel` (`nanovllm/layers/attention.py`), stores each token's K and V at its
#   slot.

# %% [markdown]
# ## Try it
#
# 1. **Move the bug to B.** In `run_steps`, add 1 to row 1 (B) at decode 1 instead of row 0.
#    B's position 6 lands on slot 11, inside B's own block, unused until then. Predict whose
#    logits move before you run it: `check_matches_clean` must pass for A at both steps and fail
#    for B, and `check_plan_addressing` must name row 1 and slot 11.
# 2. **Predict a mapping.** On a fresh `BlockAllocator(8, 4, enable_prefix_caching=False)`,
#    give prompts of 5 and 6 tokens their blocks (`slotwrite.new_sequences` shows how) and write
#    down the prefill's slots before printing `plan_prefill(...).write_slots`: it must be
#    `[0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13]`.
# 3. **Reproduce the timing.** `python days/day17/slotwrite.py --reps 500 --out-write /tmp/w.csv`:
#    the slots table must come out identical (`diff` with `day-17-slots.csv` prints nothing), and
#    in the write table `contiguous_over_paged` should again grow with the decode rows and stay
#    below 1 for the longest prefill.

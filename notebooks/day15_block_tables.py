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
# # Day 15 — Block tables
#
# Yesterday's allocator hands out block ids and counts who holds them. It says nothing about
# where a given token's keys and values are. That is the block table's job. A sequence's
# `BlockTable` lists the blocks it holds in position order: its first `block_size` positions
# live in the first block on the list, the next `block_size` in the second, and so on. Since
# the pool is one long array of slots, block b's slots are `b * block_size` to
# `b * block_size + block_size - 1`, and position p lives in slot
#
#     slot = blocks[p // block_size] * block_size + p % block_size
#
# The sequence sees positions 0, 1, 2, ... with no gaps. The pool sees blocks scattered
# wherever the allocator found room, mixed with other sequences' blocks. The table is the
# whole translation between the two, and every read and write of K/V goes through it.
#
# 1. the formula by hand, against `BlockTable.slot`,
# 2. four sequences sharing one pool with interleaved allocations (`days/day15/block_tables.py`),
#    every position checked against the package,
# 3. the slot mapping of the next step for those sequences, as `nanoserve.plan` builds it, and
#    the package's own gates on it,
# 4. a wrong formula, two sequences' slots colliding, and the checks that catch it,
# 5. the slot window built position by position and block by block, timed,
# 6. the diagram.

# %%
import csv
import dataclasses
import sys

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path
from nanoserve.bench import cpu_line
from nanoserve.blocks import BlockTable
from nanoserve.errors import GateError
from nanoserve.plan import check_plan_addressing, check_window_intact

sys.path.insert(0, str(REPO / "days" / "day15"))
import block_tables as day  # the day's script: the notebook builds its pool and reads its CSVs


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def show(rows, columns=None):
    columns = columns or list(rows[0])
    print(" | ".join(columns))
    for r in rows:
        print(" | ".join(str(r[c]) for c in columns))


def as_text(rows):
    return [{k: str(v) for k, v in r.items()} for r in rows]


# %% [markdown]
# ## 1. The formula by hand
#
# A table of two blocks, 7 then 2, with blocks of 4 slots: positions 0-3 are in block 7
# (slots 28-31), positions 4-7 in block 2 (slots 8-11).

# %%
table = BlockTable(block_size=4, blocks=[7, 2])
for pos in range(table.capacity):
    block, offset = table.blocks[pos // 4], pos % 4
    by_hand = block * 4 + offset
    print(f"position {pos}: table entry {pos // 4} -> block {block}, offset {offset} -> slot {by_hand}")
    assert by_hand == day.slot_by_hand(table.blocks, pos, 4) == table.slot(pos)
assert table.slots(0, 8) == [28, 29, 30, 31, 8, 9, 10, 11]
try:
    table.slot(8)
except ValueError as e:
    print("position 8:", e)

# %% [markdown]
# Positions 3 and 4 are neighbours in the sequence, and in the pool they are slots 31 and 8. A
# table covers `capacity` positions, whole blocks, and refuses a position past them rather than
# compute a slot in somebody else's block.
#
# ## 2. Four sequences in one pool
#
# `day.build_pool` plays a short history on an allocator of 12 blocks of 4 slots. A, B, D and
# C arrive, all four decode three tokens taking turns, D finishes, the other three decode four
# more, and E arrives into D's old blocks. Each decode step first grows its table with
# `append_slots`, as the scheduler does, and a sequence that crosses into a new block takes
# whatever is at the front of the free list at that moment:

# %%
alloc, running, arrived, log = day.build_pool()
print("\n".join(log))
seqs = running | {arrived.request_id: arrived}
tables = day.tables_rows(seqs)
assert as_text(tables) == read_csv(day.CSV_TABLES), "rerun days/day15/block_tables.py"
show(tables, ["seq", "tokens", "blocks", "capacity"])
alloc.check_invariants([s.block_table for s in seqs.values()])
print(f"free blocks: {list(alloc._free)}")

# %% [markdown]
# No table is contiguous. A holds blocks 0, 1, 9 and 7, not in order: block 7 was D's, freed
# when D finished, and A took it when it grew to 13 tokens. D's blocks went back tail first, 7,
# 4, 3. A took 7, and E got the other two in that order, so E holds 4 and then 3.
#
# Every position of every sequence, by hand and by the package:

# %%
owner = {}  # slot -> (sequence, position)
for name, s in seqs.items():
    t = s.block_table
    mine = [day.slot_by_hand(t.blocks, p) for p in range(len(s.token_ids))]
    assert mine == [t.slot(p) for p in range(len(s.token_ids))] == t.slots(0, len(s.token_ids))
    for p, slot in enumerate(mine):
        assert slot not in owner, f"slot {slot} is {owner[slot]} and {name}@{p}"
        owner[slot] = (name, p)
    print(f"{name}: positions 0-{len(s.token_ids) - 1} -> slots {mine}")
num_slots = day.NUM_BLOCKS * day.BLOCK
held = sum(len(s.block_table.blocks) for s in seqs.values()) * day.BLOCK
print(f"{len(owner)} positions in {len(owner)} distinct slots; {held} slots held, {num_slots} in the pool")
assert len(owner) == sum(len(s.token_ids) for s in seqs.values()) == 41
assert held == num_slots - alloc.num_free * day.BLOCK

# %% [markdown]
# 41 positions, 41 distinct slots, and every slot inside a block its own sequence holds. The
# 7 slots held but not written are the tails of A's and B's last blocks (3 and 2) and of E's
# (2): Day 13's internal fragmentation of a paged pool, at most `block_size - 1` a sequence.
#
# ## 3. The slot mapping of a step
#
# The next step has A, B and C decoding one token each and E's whole prompt to prefill. The
# model never sees a block table. It gets a `StepPlan` (`nanoserve.plan`), tensors that say
# for each new token where its K/V goes (`write_slots`), and for each row which slots to read
# (`slot_window`, the first `context_lens[r]` of row r). `plan_decode` and `plan_prefill` build
# them from the tables:

# %%
decode, prefill = day.step_plans(running, arrived)
for kind, plan in (("decode", decode), ("prefill", prefill)):
    print(f"--- {kind} plan, rows {[s.request_id for s in plan.rows]}")
    for field in ("input_ids", "positions", "write_slots", "context_lens", "logits_at"):
        print(f"{field:>13} {tuple(getattr(plan, field).shape)}: {getattr(plan, field).tolist()}")
    print(f"  slot_window {tuple(plan.slot_window.shape)}:")
    for r, row in enumerate(plan.slot_window.tolist()):
        ctx = plan.context_lens[r].item()
        print(f"      row {r} ({plan.rows[r].request_id}): {row[:ctx]} | past context_len: {row[ctx:]}")

# %% [markdown]
# The decode plan's write slots are each row's newest position: A's position 12 goes to slot
# 28, the first slot of block 7, which A took when it grew. B's position 9 goes to 45 and C's
# position 11 to 43. The window has one row per sequence, as wide as the longest table (4
# blocks, 16 slots). Past its context length a row runs on into the unwritten tail of its own
# last block, then into block 0's slots for a shorter table. B's row ends in 46, 47, 0, 1, 2,
# 3, and those last four slots are A's. `context_lens` masks all of it. E's prefill writes its
# six tokens to 16-19 and 12-13.
#
# Position by position, against the formula, and the committed `day-15-mapping.csv`:

# %%
mapping = day.mapping_rows(decode, prefill)
assert as_text(mapping) == read_csv(day.CSV_MAPPING), "rerun days/day15/block_tables.py"
show(mapping)
for r in mapping:
    s = seqs[r["seq"]]
    assert (
        r["slot"]
        == day.slot_by_hand(s.block_table.blocks, r["position"])
        == s.block_table.slot(r["position"])
    )
for plan in (decode, prefill):
    check_window_intact(plan)  # every row's window equals its table's slots up to context_len
check_plan_addressing(decode)  # each decode row writes where its window says its position lives
print("check_window_intact (both plans) and check_plan_addressing (decode): passed")

# %% [markdown]
# `plan.slot_window` builds the window without going position by position. It takes each row's
# block ids as a (rows, blocks) tensor and broadcasts `block * block_size + arange(block_size)`
# over it, so the formula runs once per block rather than once per slot. Section 5 times the
# difference.
#
# ## 4. A wrong formula
#
# Swap the roles of block and offset: `offset * block_size + block`. It is a plausible slip,
# with the same two numbers and the same operations, and in range for this pool (at most
# 3 x 4 + 11 = 23 of 48 slots), so nothing raises. `day.check_slots` requires every live
# position to have a slot of its own, inside one of its own sequence's blocks:

# %%
for name, formula in day.FORMULAS.items():
    try:
        day.check_slots(seqs, formula)
        print(f"{name:<30} passes")
    except AssertionError as e:
        print(f"{name:<30} caught: {e}")
formulas = day.formula_rows(seqs)
assert as_text(formulas) == read_csv(day.CSV_FORMULAS), "rerun days/day15/block_tables.py"
show(formulas, ["formula", "distinct_slots", "shared_slots", "shared_across_sequences", "outside_own_blocks"])
show(formulas, ["formula", "first_collision"])

# %% [markdown]
# The check stops at the first violation it finds. For the swapped formula that is B's position
# 0, which lands in block 0, one of A's. Over all positions, the swapped formula puts the 41
# positions in 22 slots. A's position 1 and E's position 0 both go to slot 4 (offset 1 x 4 +
# block 0, and offset 0 x 4 + block 4), 12 slots are shared between two sequences, and 30
# positions land outside their own sequence's blocks.
#
# What that does to the K/V: write every sequence's tokens into a pool through a formula, in
# the order the sequences came, then read each one back through the same formula. The token
# ids stand in for keys and values.


# %%
def read_back(formula) -> dict[str, int]:
    """Positions per sequence whose value reads back wrong after everyone has written."""
    pool = torch.full((num_slots,), -1)
    for s in seqs.values():
        pool[[formula(s.block_table.blocks, p, day.BLOCK) for p in range(len(s.token_ids))]] = torch.tensor(
            s.token_ids
        )
    wrong = {}
    for name, s in seqs.items():
        got = pool[[formula(s.block_table.blocks, p, day.BLOCK) for p in range(len(s.token_ids))]]
        wrong[name] = int((got != torch.tensor(s.token_ids)).sum())
    return wrong


damage = {name: read_back(f) for name, f in day.FORMULAS.items()}
for name, wrong in damage.items():
    print(f"{name:<30} positions read back wrong: {wrong}")
assert sum(damage["block * block_size + offset"].values()) == 0
assert all(sum(w.values()) > 0 for n, w in damage.items() if n != "block * block_size + offset")

# %% [markdown]
# With the right formula every sequence reads back exactly what it wrote. With the swapped one,
# 19 positions read back a wrong value: 10 of A's, 6 of B's and 3 of C's. E reads back all of
# its own, because it wrote last and won every slot it shared. A step would raise no error and
# return wrong attention, and the sequences that are hurt are not the one whose write did it.
#
# The package has its own gate for a plan: `check_window_intact` compares each row's window with
# what its block table says, through the right formula. A decode plan whose window was built
# with the swapped formula fails it:

# %%
swapped = day.FORMULAS["offset * block_size + block"]
width = decode.slot_window.shape[1]
bad_window = torch.tensor(
    [[swapped(s.block_table.blocks + [0] * 4, p, day.BLOCK) for p in range(width)] for s in decode.rows]
)
bad = dataclasses.replace(decode, slot_window=bad_window)
try:
    check_window_intact(bad)
except GateError as e:
    print("check_window_intact caught:", e)
else:
    raise RuntimeError("a window built with the swapped formula should have been caught")

# %% [markdown]
# ## 5. The window, position by position or block by block
#
# `day.window_times` builds a decode step's (rows, width) slot window from real allocator
# tables, interleaved as in section 2 with blocks of 16, two ways. One calls
# `BlockTable.slots(0, width)` for every row, the formula once per slot, and turns the lists
# into a tensor. The other is `plan.slot_window`, the formula once per block as a broadcast.
# Both give the same tensor (asserted). A live run at small sizes (this run's times):

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
for r in day.window_times(rows=(16, 64), widths=(256,), repeats=3):
    print(
        f"{r['rows']:>4} rows x {r['width']} slots: position by position {r['by_position_ms']:.3f} ms, "
        f"block by block {r['by_block_ms']:.3f} ms ({r['by_block_1_thread_ms']:.3f} ms on one thread)"
    )

# %% [markdown]
# The script's run, as committed (`day-15-window.csv`):

# %%
window = read_csv(day.CSV_WINDOW)
show(window)

# %% [markdown]
# Block by block was faster at every size in that run, by 11.5x at 16 rows of 256 slots up to
# 49.3x at 256 rows of 2,048. The run had torch at 2 threads on an AVX-512 CPU, as the CSV's
# cpu column says. At 256 rows of 2,048 slots, building the window one position at a time took
# 74.385 ms, against 1.51 ms for the broadcast. The ratio rises with the window, from 11.5x at
# 4,096 slots to 39.7x at 32,768, and is 48.9x and 49.3x at the two largest. In small windows
# the broadcast's time is mostly a fixed cost: from 4,096 to 16,384 slots its time went from
# 0.043 to 0.104 ms, while going position by position went from 0.495 to 2.39 ms. From 131,072
# to 524,288 slots both grew about as fast as the slots (0.363 to 1.51 ms, 17.756 to 74.385 ms),
# so the ratio stopped moving. The broadcast took about the same time on one thread as on two at
# every size, 0.038 ms against 0.043 at the smallest and 1.564 against 1.51 at the largest: at
# these sizes a second thread does not speed it up.
#
# ## 6. The diagram

# %%
colors = {"A": "tab:blue", "B": "tab:orange", "C": "tab:green", "E": "tab:purple"}
fig, axes = plt.subplots(2, 3, figsize=(19, 11))


def draw_pool(ax, formula, title):
    """The pool as 12 rows of 4 slots, each slot coloured by who the formula puts there."""
    where = day.placements(seqs, formula)
    for slot in range(num_slots):
        b, o = divmod(slot, day.BLOCK)
        who = where.get(slot, [])
        color = "whitesmoke" if not who else colors[who[0][0]] if len(who) == 1 else "red"
        ax.add_patch(plt.Rectangle((o, b), 0.95, 0.9, color=color, alpha=0.85 if who else 1))
        label = " ".join(f"{n}{p}" for n, p in who) or "free"
        ax.text(o + 0.47, b + 0.33, label, ha="center", va="center", fontsize=10 if len(who) < 3 else 8,
                color="white" if who else "gray")  # fmt: skip
        ax.text(o + 0.47, b + 0.7, f"slot {slot}", ha="center", va="center", fontsize=8, color="black")
    ax.set_xlim(0, day.BLOCK)
    ax.set_ylim(day.NUM_BLOCKS, 0)
    ax.set_xticks([k + 0.47 for k in range(day.BLOCK)], [f"offset {k}" for k in range(day.BLOCK)])
    ax.set_yticks([b + 0.45 for b in range(day.NUM_BLOCKS)], [f"block {b}" for b in range(day.NUM_BLOCKS)])
    ax.set_title(title)


draw_pool(axes[0, 0], day.slot_by_hand, "The pool: who is in each slot (A3 = A's position 3)")

ax = axes[0, 1]
for i, (name, s) in enumerate(seqs.items()):
    for j, b in enumerate(s.block_table.blocks):
        ax.add_patch(plt.Rectangle((j, i), 0.95, 0.85, color=colors[name], alpha=0.85))
        first = j * day.BLOCK
        last = min(len(s.token_ids), first + day.BLOCK) - 1
        ax.text(j + 0.47, i + 0.3, f"block {b}", ha="center", va="center", color="white", fontsize=10)
        ax.text(
            j + 0.47, i + 0.62, f"pos {first}-{last}", ha="center", va="center", color="white", fontsize=8
        )
ax.set_xlim(0, 4)
ax.set_ylim(len(seqs), 0)
ax.set_xticks([j + 0.47 for j in range(4)], [f"table entry {j}" for j in range(4)])
ax.set_yticks(
    [i + 0.42 for i in range(len(seqs))], [f"{n} ({len(s.token_ids)} tokens)" for n, s in seqs.items()]
)
ax.set_title("The block tables: entry j holds positions 4j to 4j + 3")

ax = axes[0, 2]
w = decode.slot_window.numpy()
ctx = decode.context_lens.tolist()
visible = np.arange(w.shape[1])[None, :] < np.array(ctx)[:, None]
ax.imshow(visible, cmap=matplotlib.colors.ListedColormap(["lightgray", "lightsteelblue"]), aspect="auto")
for r in range(w.shape[0]):
    for c in range(w.shape[1]):
        style = {"fontweight": "bold", "color": "darkred"} if c == decode.positions[r].item() else {}
        ax.text(c, r, str(w[r, c]), ha="center", va="center", fontsize=8, **style)
ax.set_yticks(
    range(w.shape[0]), [f"row {r}: {s.request_id}, ctx {ctx[r]}" for r, s in enumerate(decode.rows)]
)
ax.set_xlabel("window position (= token position)")
ax.set_title("The decode step's slot_window\n(blue: attended, gray: masked, bold red: the write slot)")

draw_pool(axes[1, 0], swapped, "The swapped formula offset * 4 + block (red: two or more positions)")

ax = axes[1, 1]
names = list(seqs)
x = np.arange(len(names))
for k, (fname, wrong) in enumerate(damage.items()):
    ax.bar(x + (k - 1.5) * 0.2, [wrong[n] for n in names], 0.2, label=fname)
ax.set_xticks(x, names)
ax.set_ylabel("positions that read back a wrong value")
ax.set_title("Write everyone, read back: damage per sequence")
ax.legend(fontsize=8)

ax = axes[1, 2]
for width_, marker in ((256, "o"), (2048, "s")):
    rows_ = [r for r in window if int(r["width"]) == width_]
    n = [int(r["rows"]) for r in rows_]
    ax.plot(n, [float(r["by_position_ms"]) for r in rows_], marker + "-", color="tab:red",
            label=f"position by position, width {width_}")  # fmt: skip
    ax.plot(n, [float(r["by_block_ms"]) for r in rows_], marker + "--", color="tab:blue",
            label=f"block by block (slot_window), width {width_}")  # fmt: skip
    ax.plot(n, [float(r["by_block_1_thread_ms"]) for r in rows_], marker + ":", color="tab:cyan",
            label=f"block by block, one thread, width {width_}")  # fmt: skip
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("rows")
ax.set_ylabel("ms to build the window (best of the run)")
ax.set_ylim(top=100 * max(float(r["by_position_ms"]) for r in window))  # room above the lines for the legend
ax.set_title("Building a step's slot window (day-15-window.csv)")
ax.legend(fontsize=8)

fig.suptitle("Day 15: block tables map positions to slots in a shared pool", fontsize=14)
fig.tight_layout()
png = diagram_path("day15-block-tables.png")
fig.savefig(png, dpi=75)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** computes the same formula on the GPU for every token of a step. The worker keeps a
#   `BlockTable` per KV cache group (`vllm/v1/worker/block_table.py`): a (max requests, max
#   blocks per request) tensor of block ids, filled in from the scheduler's block ids, and
#   `compute_slot_mapping(num_reqs, query_start_loc, positions)`, which turns each token's
#   position into `block_table[req, pos // block_size] * block_size + pos % block_size` (a small
#   Triton kernel in recent versions). The result,
#   `slot_mapping`, is what `reshape_and_cache` (`csrc/cache_kernels.cu`) writes each new key
#   and value through. The attention kernels read through the block table itself, not a
#   per-slot window.
# * **nano-vllm** does it in Python in `ModelRunner.prepare_prefill` and `prepare_decode`
#   (`nanovllm/engine/model_runner.py`): for each sequence it appends
#   `block_table[i] * block_size + offset` for the new tokens to `slot_mapping`, and pads every
#   sequence's block table to the longest one with -1 for the attention kernel.
#   `plan.slot_window` pads with block 0 instead, which `context_lens` masks.
# * **TensorRT-LLM** hands its kernels block offsets rather than slots:
#   `KVCacheManager::getBlockOffsetsOfBatch` fills a tensor of each sequence's block offsets
#   (per pool, for K and for V), and the attention kernels do the multiply-and-add.
# * **llama.cpp** needs no table: each cell of its unified cache records its own position and
#   sequence ids, and a micro-batch's tokens are placed in cells found by `find_slot`. The
#   "slot" of a token is just the index of its cell, and the mask built per step decides which
#   cells each sequence may see.
#
# ## Try it
#
# 1. **Break the package's formula.** In `nanoserve/blocks.py`, make `BlockTable.slots` return
#    `blocks[p // bs] * bs + p % bs + 1`, then run this notebook's section 2 and
#    `pytest tests/test_blocks.py -k slot`: the assert against `slot_by_hand` and
#    `test_slot_arithmetic_worked_examples` must both fail. Undo it.
# 2. **A fifth wrong formula.** Add `"block * block_size + position": lambda t, p, bs: t[p // bs]
#    * bs + p` to `day.FORMULAS` and rerun section 4. Predict first which sequences collide.
#    Check: for every sequence's table it gives the right formula's slot at positions 0-3 and
#    another slot at every later position (compare the two lambdas position by position).
# 3. **Read the padding.** Row 1 of the decode window (B, 10 tokens) is padded past its
#    context with block 0's slots, which hold A's first four positions. Set B's context length
#    to the full width with `dataclasses.replace(decode, context_lens=torch.tensor([13, 16, 12]))`
#    and run `check_plan_addressing` on it: it must fail, saying row 1 sits at position 9 but
#    attends over 16 positions. Without that gate, B would attend over A's keys.

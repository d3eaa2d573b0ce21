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
# # Day 51 — The slot table
#
# Day 50 ended on a rule: a recorded step computes the next step only if every tensor it reads
# is the *same storage* with new numbers written into it. The largest of those tensors is the
# slot window, `(rows, width)`: for each row, the KV slot of every position it attends to.
# Until now `plan_decode` has built it anew every step by gathering block ids from the block
# tables (`nanoserve.plan.slot_window`): new storage each time, so no graph could replay it.
#
# `nanoserve.slots.SlotTable` is one `[max_batch, max_model_len]` int64 tensor, allocated once,
# where row r holds the slots of the sequence that owns row r. Sequences write their new slot in
# place as they grow; a decode step *reads* its window as a slice, `table[:rows + pad, :width]`,
# which is a view on the table's storage. The plan:
#
# 1. why the window must be a prefix slice (a view) and not an indexed gather (a copy),
# 2. the package's table: assign, extend, read; the window is a view and sees later writes,
# 3. release of a middle row: the last row moves into its place so the live rows stay a prefix,
# 4. padding with the sink slot, `address`, and `to` (a reallocation the gates catch),
# 5. the gates of `nanoserve.plan` on a real decode plan read from the table, and one failing on
#    a copy,
# 6. a run with requests joining and leaving, every decode plan gated,
# 7. the benchmark (`days/day51/window.py`): gathering the window against reading it.

# %%
import csv
import dataclasses
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Image, display
from matplotlib.colors import ListedColormap

from nanocourse import REPO, diagram_path
from nanoserve.capture import HostGraph
from nanoserve.errors import GateError
from nanoserve.plan import (
    check_mapping_is_window,
    check_plan_addressing,
    check_window_intact,
    plan_decode,
    slot_window,
)
from nanoserve.slots import SlotTable

sys.path.insert(0, str(REPO / "days" / "day51"))
import window  # the day's script: the notebook prints the table it writes

torch.set_num_threads(1)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# %% [markdown]
# ## 1. A slice is a view, an index is a copy
#
# Slicing the leading rows and columns of a contiguous tensor gives a view: the same storage, a
# different shape and the parent's strides. Picking rows by a list (`t[[1, 0]]`, any order that
# is not a leading run) is an advanced index, and PyTorch answers it with a new tensor. So a
# window that a graph can keep reading must be rows 0..n-1 of the table, in order.

# %%
t = torch.arange(4 * 8).view(4, 8)  # (max_batch, max_model_len)
sliced = t[:2, :5]  # rows 0-1, positions 0-4
picked = t[[1, 0], :5]  # the same rows, chosen by index
print(
    "slice: shape",
    tuple(sliced.shape),
    "strides",
    sliced.stride(),
    "| same storage:",
    same_storage(sliced, t),
)
print(
    "index: shape",
    tuple(picked.shape),
    "strides",
    picked.stride(),
    "| same storage:",
    same_storage(picked, t),
)
t[0, 0] = 100  # a write to the table after both were taken
print("after t[0, 0] = 100: slice sees", sliced[0, 0].item(), "| index sees", picked[1, 0].item())
assert same_storage(sliced, t) and not same_storage(picked, t) and sliced[0, 0] == 100 != picked[1, 0]

# %% [markdown]
# ## 2. The package's table
#
# `SlotTable(max_batch, max_model_len, sink_slot)` starts with every entry at the sink. `assign`
# gives a sequence the next free row (the end of the live prefix) and writes its slots; `extend`
# appends the slot of each new position; `read(rows, width, pad_rows)` returns the window.

# %%
table = SlotTable(max_batch=4, max_model_len=8, sink_slot=99)
print("a ->", table.assign("a", [5, 6, 7]), "| b ->", table.assign("b", [20, 21]))
w = table.read((0, 1), width=4)
print("window (rows 0-1, width 4):", w.tolist())
print("window.data_ptr() == table.address:", w.data_ptr() == table.address)
print(
    "same untyped storage:",
    same_storage(w, table.table),
    "| window._base is table.table:",
    w._base is table.table,
)
copy = w.clone()
table.extend("b", [22])  # b's next position lives in slot 22
print("after extend('b', [22]): window row 1 =", w[1].tolist(), "| a clone taken before =", copy[1].tolist())
print("table:\n", table.table)
assert w.data_ptr() == table.address and w[1, 2].item() == 22 and copy[1, 2].item() == 99

# %% [markdown]
# ## 3. Rows stay a prefix
#
# When a sequence leaves from the middle, the window `table[:n]` would include its dead row. So
# `release` moves the *last* live row into the hole (one row copy, in place) and says who moved
# where; `SlotTable.sync` then sorts the batch by row, so a plan's rows are the table's
# live prefix in order.

# %%
table = SlotTable(max_batch=4, max_model_len=8, sink_slot=99)
for key, slots in [("a", [1, 2]), ("b", [10, 11, 12]), ("c", [30, 31, 32, 33])]:
    table.assign(key, slots)
before = table.table.clone()
print("before: owners", table.owner, "\n", before)
moved = table.release("b")
print("release('b') ->", moved, "| owners", table.owner, "| row_of", table.row_of)
print("after:\n", table.table)
print("release of the last row moves nothing:", table.release("c") is None, "| owners", table.owner)
assert moved == ("c", 2, 1) and before[2].tolist() == [30, 31, 32, 33, 99, 99, 99, 99]

# %% [markdown]
# ## 4. Padding, the sink, and a table that moves
#
# A padded row (Day 52 decides how many) reads a row past the live prefix, and every entry
# there is the sink. The sink's number is the pool's slot count, `num_blocks * block_size`: the
# K/V pools are allocated with one entry more than that, and a block id runs from 0 to
# `num_blocks - 1`, so no block table can ever produce it (section 5 checks the number on a
# real engine). Whatever a padded row reads or writes there belongs to no sequence. `read`
# refuses row sets that are not the live prefix, and an empty selection without padding.
#
# One thing `read` does not check: that the rows asked for are *all* the live rows. The window
# is `table[:len(rows) + pad_rows]`, so with fewer rows than are live, the "padded" rows are
# live sequences' rows, not the sink. The runner always passes every live row, and a warm-up
# (Day 55) reads `rows=()` on a table that is normally empty; with live rows present, the last
# cell shows what a warm-up window would hold. Those rows are masked (context_lens 0) and write
# to the sink through `write_slots`, so nothing is touched, but "a padded row addresses the sink"
# holds only when `len(rows) == num_live`.

# %%
table = SlotTable(max_batch=4, max_model_len=8, sink_slot=99)
table.assign("a", [5, 6, 7])
table.assign("b", [20, 21])
padded = table.read((0, 1), width=4, pad_rows=2)
print("2 live rows + 2 padded, width 4:", padded.tolist())
for rows, pad in [((1,), 0), ((1, 0), 0), ((), 0)]:
    try:
        table.read(rows, width=4, pad_rows=pad)
    except ValueError as e:
        print(f"read({rows}, pad_rows={pad}) -> ValueError: {e}")
warm = table.read((), width=2, pad_rows=4)
print("read((), pad_rows=4) with 2 live rows:", warm.tolist())
assert padded[2:].eq(99).all() and warm[:2].ne(99).all()

# %% [markdown]
# `address` is the table's `data_ptr`: what a recorded step is bound to. `to(device)` always
# copies into new storage, even to the same device, so every window read before it points at
# the old storage, and later writes no longer reach it. A `HostGraph` (Day 50) recorded over
# the old window does not notice: the tensor it holds never moved, so its own address check
# passes and it replays the old numbers. What does notice is the table's own address, compared
# with the one recorded: the cell does that check by hand (Day 55 makes it a gate,
# `check_table_stable`).

# %%
recorded = table.address
old_window = table.read((0, 1), width=4)
graph = HostGraph.record(lambda w: w.clone(), old_window)  # a step that reads the window
table.to("cpu")
table.extend("a", [8])
print("address unchanged after to('cpu'):", table.address == recorded)
print("old window still at the recorded address:", old_window.data_ptr() == recorded)
print("old window row 0:", old_window[0].tolist(), "| the table's row 0 now:", table.table[0, :4].tolist())
replayed = graph.replay()  # no ReplayError: nothing the graph holds has moved
print("the graph replays row 0 as", replayed[0].tolist(), "without raising")
moved_table = table.address != recorded
print("the table's address now differs from the recorded one:", moved_table)
assert moved_table and old_window[0, 3].item() == 99 and table.table[0, 3].item() == 8
assert old_window.data_ptr() == recorded and replayed[0, 3].item() == 99

# %% [markdown]
# ## 5. The gates on a real decode plan
#
# A tiny random Llama behind the engine as it stands today (4 rows, blocks of 4 tokens, a
# 64-token context), with a slot table kept beside it by `window.with_table`: each decode batch
# is synced into the table (`SlotTable.sync`: release, assign, extend), planned by
# `plan_decode` in row order, and handed the window `table.read(...)` instead of the gathered
# one. (From Day 52 the engine's runner keeps the table itself.) Three prompts are prefilled;
# then three gates of `nanoserve.plan` on the next decode plan:
#
# * `check_mapping_is_window`: the plan's slot window is a view on the table from row 0, with
#   the table's strides, and its rows are the table's live rows in order;
# * `check_window_intact`: each real row's window holds its block table's slots for every
#   position it attends to;
# * `check_plan_addressing`: each row writes its new K/V where its window maps its position.

# %%
eng = window.tiny_engine()
st = window.with_table(eng)
for prompt in ([1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]):
    eng.add_request(prompt, window.SamplingParams(max_tokens=8, ignore_eos=True))
eng.step()  # prefill
runner = eng.runner
plan = runner.plan(eng.scheduler.schedule())
print("rows", len(plan.rows), "| window", tuple(plan.slot_window.shape), "| sink", st.sink_slot)
print(f"sink = num_blocks x block_size = {eng.pool.num_blocks} x {eng.config.block_size}")
assert st.sink_slot == eng.pool.num_blocks * eng.config.block_size == eng.pool.sink_slot
print("block tables:", [s.block_table.blocks for s in plan.rows])
print("context_lens", plan.context_lens.tolist(), "| write_slots", plan.write_slots.tolist())
print("slot window:\n", plan.slot_window)
print("window is the table's storage:", plan.slot_window.data_ptr() == st.address)
check_mapping_is_window(plan, st)
check_window_intact(plan)
check_plan_addressing(plan)
print("check_mapping_is_window, check_window_intact, check_plan_addressing: passed")

# %% [markdown]
# The same rows, addressed by `plan_decode`: the numbers agree on every position a row attends
# to (its window is block-granular, 12 wide here, and pads short rows with block 0's slots where
# the table has the sink), but it is a fresh gather. And the table's plan with its window
# `.clone()`d: right numbers, wrong storage. `check_mapping_is_window` refuses both; the two
# gates that look only at numbers pass on them.

# %%
gathered = plan_decode(list(plan.rows), eng.config.block_size)
ctx = plan.context_lens.tolist()
agree = all(
    gathered.slot_window[r, : ctx[r]].tolist() == plan.slot_window[r, : ctx[r]].tolist() for r in range(3)
)
print("plan_decode window:", tuple(gathered.slot_window.shape), "| agrees on attended positions:", agree)
print(gathered.slot_window)
by_blocks = slot_window([s.block_table.blocks for s in plan.rows], eng.config.block_size, "cpu")
print("plan_decode's window is slot_window(block tables):", torch.equal(gathered.slot_window, by_blocks))
cloned = dataclasses.replace(plan, slot_window=plan.slot_window.clone())
failures = {}
for name, bad in [("plan_decode (gathered)", gathered), ("table's window .clone()d", cloned)]:
    check_window_intact(bad)
    check_plan_addressing(bad)
    try:
        check_mapping_is_window(bad, st)
    except GateError as e:
        failures[name] = str(e)
        print(f"{name}: check_mapping_is_window -> GateError: {e}")
assert agree and len(failures) == 2
assert gathered.slot_window[1, 4:].tolist() == [0, 1, 2, 3] * 2  # block 0's slots pad the short row

# %% [markdown]
# ## 6. A run where rows come and go
#
# `window.gated_run` drives eight requests through the engine, one joining every other step,
# with every decode window read from a slot table (`with_table`); it runs the three gates on
# every decode plan and logs every row a release moves. The same requests through an engine
# without the table (plain `plan_decode`) give the tokens to compare with.

# %%
reqs = window.requests()
run = window.gated_run(window.tiny_engine(), reqs)
plain = window.gated_run(window.tiny_engine(), reqs, table=False)
print("requests:", [(len(p), n) for p, n in reqs], "(prompt tokens, new tokens)")
print("decode plans gated:", run["checked"], "| all three gates passed on each")
print("live rows per decode step:", run["live"])
print("window shapes:", run["shapes"])
print("rows moved by release (request, from row, to row):", run["moves"])
print("same tokens as plain plan_decode:", run["tokens"] == plain["tokens"])
assert run["checked"] == len(run["live"]) > 0 and run["moves"] and run["tokens"] == plain["tokens"]

# %% [markdown]
# ## 7. Gathering the window against reading it
#
# `window.window_cost(rows, width)`: `rows` sequences of `width` tokens over scattered blocks of
# 16. Gather is `slot_window` from the block lists (what `plan_decode` does each step); read is
# `SlotTable.read` (what `with_table` hands a plan). Both windows are checked equal first. The
# table is not free: every step writes each row's newest slot (`extend`), timed as `extend_us`.
# This cell runs eight of the CSV's twelve sizes at 15 timed calls each (the script takes 30);
# its timings change from run to run on a shared 2-core CPU, and the sizes and copies are the
# facts it checks against the committed CSV.

# %%
small = window.window_table(rows=(1, 4, 16, 64), widths=(128, 2048), repeats=15)
facts = ["rows", "width", "window_bytes", "gather_copies", "gather_new_bytes", "read_copies"]
facts += ["read_new_bytes", "table_writes_per_step", "same_numbers"]
with open(window.CSV) as f:
    on_disk = {(r["rows"], r["width"]): r for r in csv.DictReader(f)}
for r in small:
    print(
        " | ".join(f"{c}={r[c]}" for c in facts),
        f"| gather {r['gather_us']} us, read {r['read_us']} us, extend {r['extend_us']} us",
    )
    assert {c: str(r[c]) for c in facts} == {c: on_disk[(str(r["rows"]), str(r["width"]))][c] for c in facts}
assert all(r["read_new_bytes"] == 0 and r["gather_new_bytes"] == r["window_bytes"] for r in small)

# %% [markdown]
# ## 8. The diagram

# %%
full = list(csv.DictReader(open(window.CSV)))
fig, axes = plt.subplots(2, 2, figsize=(14, 10))

ax = axes[0, 0]
tab = st.table[:, :32].numpy()
live = st.num_live
sink = st.sink_slot
shown = np.where(tab == sink, np.nan, tab).astype(float)
ax.imshow(np.where(np.isnan(shown), 0, 1)[:, :], cmap=ListedColormap(["#dddddd", "#9ecae1"]), aspect="auto")
for r in range(tab.shape[0]):
    for c in range(tab.shape[1]):
        ax.text(c, r, "s" if tab[r, c] == sink else str(tab[r, c]), ha="center", va="center", fontsize=7)
rows_b, width_b = plan.slot_window.shape
ax.add_patch(plt.Rectangle((-0.5, -0.5), width_b, rows_b, fill=False, ec="tab:red", lw=2.5))
ax.add_patch(plt.Rectangle((-0.5, -0.5), width_b, live, fill=False, ec="tab:blue", lw=1.5, ls="--"))
names = [
    f"row {r} ({plan.rows[r].request_id})" if r < live else f"row {r} (free)" for r in range(tab.shape[0])
]
ax.set_yticks(range(tab.shape[0]), names)
ax.set_xlabel("position (first 32 of max_model_len 64); s = sink slot")
ax.set_title(f"The slot table; red: the plan's window table[:{rows_b}, :{width_b}], a view", fontsize=10)

ax = axes[0, 1]
demo = SlotTable(max_batch=4, max_model_len=6, sink_slot=99)
for key, slots in [("a", [1, 2]), ("b", [10, 11, 12]), ("c", [30, 31, 32, 33])]:
    demo.assign(key, slots)
pre, owners_pre = demo.table.clone().numpy(), list(demo.owner)
demo.release("b")
post, owners_post = demo.table.numpy(), list(demo.owner)
both = np.vstack([pre, np.full((1, 6), -1), post])
colour = np.where(both == 99, 0, np.where(both == -1, 2, 1))
ax.imshow(colour, cmap=ListedColormap(["#dddddd", "#fdd0a2", "white"]), aspect="auto")
for r in range(both.shape[0]):
    for c in range(both.shape[1]):
        if both[r, c] != -1:
            ax.text(c, r, "s" if both[r, c] == 99 else str(both[r, c]), ha="center", va="center", fontsize=9)
labels = [f"before: row {i} ({owners_pre[i] if i < len(owners_pre) else 'free'})" for i in range(4)]
labels += [""] + [f"after: row {i} ({owners_post[i] if i < len(owners_post) else 'free'})" for i in range(4)]
ax.set_yticks(range(len(labels)), labels)
ax.annotate("", xy=(4.5, 6), xytext=(4.5, 2), arrowprops=dict(arrowstyle="->", color="tab:red", lw=2))
ax.text(0, 4, "c moves from row 2 to row 1 (one row copy, in place)", color="tab:red", va="center")
ax.set_xlabel("position")
ax.set_title("release('b'): the last live row fills the hole, rows stay a prefix", fontsize=10)

ax = axes[1, 0]
by_width = {}
for r in full:
    by_width.setdefault(int(r["width"]), []).append(r)
markers = {128: "o", 512: "s", 2048: "^"}
for wdt, rs in by_width.items():
    x = [int(r["window_bytes"]) for r in rs]
    m = markers.get(wdt, "o")
    ax.loglog(x, [float(r["gather_us"]) for r in rs], m + "-", color="tab:red", label=f"gather, width {wdt}")
    ax.loglog(x, [float(r["read_us"]) for r in rs], m + "-", color="tab:green", label=f"read, width {wdt}")
    upkeep = [float(r["extend_us"]) for r in rs]
    ax.loglog(x, upkeep, m + ":", color="tab:gray", label=f"table upkeep (extend per row), width {wdt}")
ax.set_xlabel("window bytes (rows x width x 8)")
ax.set_ylabel("µs per step (the CSV's medians)")
top = max(float(r[c]) for r in full for c in ("gather_us", "extend_us"))
ax.set_ylim(1, 20 * top)  # headroom: the legend sits above every point
ax.set_title("Building the window each step: gather vs read, and the table's upkeep", fontsize=10)
ax.legend(fontsize=7, ncol=1, loc="upper left")

ax = axes[1, 1]
labels = [f"{r['rows']}x{r['width']}" for r in full]
xs = np.arange(len(full))
gather_b = [int(r["gather_new_bytes"]) for r in full]
upkeep_b = [int(r["table_writes_per_step"]) * 8 for r in full]
ax.bar(xs - 0.2, gather_b, 0.4, color="tab:red", label="gather: a new window every step")
ax.bar(
    xs + 0.2, upkeep_b, 0.4, color="tab:green", label="read: 0 new bytes; the table gets rows x 8 B written"
)
ax.set_yscale("log")
ax.set_xticks(xs, labels, rotation=45, ha="right")
ax.set_xlabel("rows x width")
ax.set_ylabel("bytes per step (log)")
ax.set_title("Memory traffic per step: a fresh window vs one new slot per row", fontsize=10)
ax.legend(fontsize=8)

fig.suptitle("Day 51: the slot table; a decode step's slot window is a view on one fixed tensor", fontsize=14)
fig.tight_layout()
png = diagram_path("day51-slots.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** keeps its table per block, not per token. `BlockTable` in
#   `vllm/v1/worker/block_table.py` allocates a `[max_num_reqs, max_num_blocks_per_req]` int32
#   table of block ids once (a `CpuGpuBuffer`, a pinned CPU tensor with a GPU twin) and writes
#   rows in place with `add_row` and `append_row`. Slot numbers are derived each step:
#   `compute_slot_mapping` runs a Triton kernel that turns every scheduled token's position into
#   `block_number * block_size + offset` and writes the result into a persistent `slot_mapping`
#   buffer of `max_num_batched_tokens` entries, filling the unused tail with `PAD_SLOT_ID`
#   (-1, defined in `vllm/v1/attention/backends/utils.py`). Our table stores one slot per
#   token instead, `block_size` times more entries, so a step needs no kernel to expand it, only
#   a slice.
# * **vLLM keeps its rows dense the same way we do.** `InputBatch.condense` in
#   `vllm/v1/worker/gpu_input_batch.py` fills each empty row with the request in the highest
#   occupied row and calls `BlockTable.move_row(src, tgt)` to copy that row's block ids; our
#   `SlotTable.release` is the one-sequence case of it. `BlockTable.swap_row` also exists for
#   reordering the batch.
# * **nano-vllm** gathers, as our `plan_decode` does. `ModelRunner.prepare_block_tables` in
#   `nanovllm/engine/model_runner.py` builds a new `[batch, longest]` tensor padded with -1
#   every step; for a graph replay, `run_model` copies it into the first rows of a
#   `block_tables` buffer that `capture_cudagraph` allocated at
#   `[max_bs, ceil(max_model_len / block_size)]`. The graph sees a fixed address, paid for with
#   a copy each step rather than a view.
# * **llama.cpp** records the mapping from the other side. `llama_kv_cells_unified` in
#   `src/llama-kv-cells.h` keeps, for every cell of the cache, its position (`pos[i]`, -1 when
#   empty) and a bitset of the sequences that use it (`seq[i]`); `mv(isrc, idst)` moves a cell's
#   metadata when the cache is defragmented. Where our table answers "which slot holds position
#   p of row r", a cell answers "which sequences and which position am I".
#
# ## Try it
#
# 1. **One write instead of one per row.** `extend_us` grows with rows because `SlotTable.extend`
#    is one `torch.as_tensor` and one indexed write per sequence. Write
#    `extend_all(table, rows, cols, slots)` that sets `table.table[rows, cols] = slots` in a
#    single call. Check it on `window.make_rows(64, 128, room=1)`: after `extend_all` on one copy
#    and a loop of `extend` on another, `torch.equal` of the two tables must be `True`; then time
#    both at 64 rows the way `window.median_us` does and compare with the CSV's `extend_us`.
#    (Keep `table.lengths` in step yourself, or `extend` will write over your column next time.)
# 2. **Break the row order on purpose.** Build
#    `dataclasses.replace(plan, slot_window=st.table[[1, 0, 2], :12])` from section 5's plan.
#    `check_window_intact(bad)` must now raise `GateError` (row 0's window holds req-1's slots).
#    Then try `st.table[[0, 1, 2], :12]`, the right rows by index: the numbers are right, so
#    only `check_mapping_is_window` refuses it.
# 3. **Break `release`.** In `nanoserve/slots.py`, delete the `if row != last:` block of
#    `release`, so a sequence leaving from the middle leaves a hole, and run
#    `.venv/bin/python -m pytest tests/test_slots.py -q`. Check: `test_release_keeps_rows_a_prefix`
#    and the hypothesis test `test_rows_mirror_the_sequences_after_any_history` fail. Restore the
#    file and both pass again.

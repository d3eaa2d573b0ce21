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
# # Day 52 — Buckets: padded rows and the sink slot
#
# A recorded decode step (Day 54) replays one fixed shape. Eager decode presents every batch at
# its own shape: 3 rows one step, 5 the next, a window as wide as the longest context rounded to
# a block. Today a decode batch is padded up to a shape from a small, closed set, and the padding
# is made harmless.
#
# 1. the closed set: row buckets (powers of two up to `max_batch`) and width buckets (multiples
#    of `width_multiple`), and how many shapes their product is,
# 2. a real decode batch of 3 chat requests on SmolLM2-135M, padded to the 4-row bucket and a
#    width bucket by `plan_decode_bucketed`,
# 3. the padded row touches nothing: the K/V pools before and after the step differ from an
#    unpadded eager step's only at the sink slot, and the real rows' logits match the eager
#    ones to within 1e-3 with the same argmax,
# 4. `check_pad_inert` failing on padded plans built wrong,
# 5. the price: padding waste against the number of shapes (`days/day52/padwaste.py`),
# 6. the diagram.

# %%
import csv
import dataclasses
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display
from matplotlib.colors import ListedColormap

from nanocourse import REPO, diagram_path, engine_config
from nanoserve.buckets import bucket_shape, bucket_up, check_pad_inert, row_buckets, width_buckets
from nanoserve.engine import Engine
from nanoserve.errors import GateError
from nanoserve.models import load_model
from nanoserve.plan import check_mapping_is_window, check_plan_addressing, check_window_intact, plan_decode
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day52"))
import padwaste  # the day's script: the notebook prints the same tables it writes

# One thread: the steps below are small, and on a shared two-core machine two threads spend more
# time waiting for each other than computing.
torch.set_num_threads(1)
MODEL_DIR = fetch_default_model()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
print("model:", MODEL_DIR.name, "| layers", model.cfg.num_layers, "| threads:", torch.get_num_threads())

# %% [markdown]
# ## 1. The closed set of shapes
#
# Rows round up to a power of two, capped at `max_batch` (which joins the set when it is not a
# power of two itself). The width, the longest context in the batch, rounds up to a multiple of
# `width_multiple`, capped at `max_model_len`. Both roundings are one line each; the package's
# `bucket_up` over the bucket tuples must agree with them for every value.

# %%
print("row_buckets(8)    ", row_buckets(8))
print("row_buckets(12)   ", row_buckets(12))
print("row_buckets(256)  ", row_buckets(256))
print("width_buckets(256, 32)", width_buckets(256, 32))
print(
    "width_buckets(8192, 128): ",
    len(width_buckets(8192, 128)),
    "widths,",
    width_buckets(8192, 128)[:3],
    "...",
)
print(
    "bucket_shape(3 rows, width 200, max_batch 256, max_model_len 8192, multiple 128) ->",
    bucket_shape(3, 200, 256, 8192, 128),
)


def rows_by_hand(n, max_batch):
    return min(1 << (n - 1).bit_length(), max_batch)  # the next power of two, capped


def width_by_hand(w, max_len, multiple):
    return min(-(-w // multiple) * multiple, max_len)  # ceil to the multiple, capped


assert all(rows_by_hand(n, 256) == bucket_up(n, row_buckets(256)) for n in range(1, 257))
assert all(rows_by_hand(n, 12) == bucket_up(n, row_buckets(12)) for n in range(1, 13))
assert all(width_by_hand(w, 8192, 128) == bucket_up(w, width_buckets(8192, 128)) for w in range(1, 8193))
print("by hand == bucket_up: rows 1..256, widths 1..8192")

for max_batch, max_len, multiple in ((8, 256, 32), (256, 8192, 128)):
    r, w = row_buckets(max_batch), width_buckets(max_len, multiple)
    print(
        f"max_batch {max_batch}, max_model_len {max_len}, width_multiple {multiple}: "
        f"{len(r)} row buckets x {len(w)} width buckets = {len(r) * len(w)} shapes"
    )
assert len(row_buckets(256)) * len(width_buckets(8192, 128)) == 576

# %% [markdown]
# The serving-size set, 9 x 64 = 576 shapes, is what Day 55 will have to price. The engine in
# this notebook is small: 8 rows, 256 tokens, width multiple 32, so 4 x 8 = 32 shapes.
#
# ## 2. A real decode batch, padded
#
# `engine_config(52, bucket_decode=True)` gives the engine a slot table (Day 51) and the bucket sets;
# its runner then plans decode with `plan_decode_bucketed`. Three chat requests are prefilled in
# one step, and the next batch the scheduler hands out is a decode batch of 3 rows.

# %%
per_token = model.cfg.kv_bytes_per_token(torch.float32)
config = engine_config(
    52,  # the engine as of day 52: prefill-first, gather attention, plain linears
    max_batch=8, max_model_len=256, kv_budget=per_token * 16 * 32, width_multiple=32, bucket_decode=True
)
eng = Engine(model, tok, config)
sink = eng.pool.sink_slot
print(eng.pool.describe())
print(
    f"sink slot: {sink} = {eng.pool.num_blocks} blocks x {eng.pool.block_size} slots | buckets:",
    eng.runner.buckets,
)
assert sink == eng.pool.num_blocks * eng.pool.block_size  # the first number no block can reach
questions = ["What is 2 + 2?", "Name a colour.", "Why is the sky blue?"]
for q in questions:
    eng.add_request([{"role": "user", "content": q}], SamplingParams(max_tokens=8))
eng.step()  # one prefill step for all three; each samples its first token
batch = eng.scheduler.schedule()
print("decode batch:", [s.request_id for s in batch.decode], "| is_decode:", batch.is_decode)
plan = eng.runner.plan(batch)  # plan_decode_bucketed: 3 rows -> the 4-row bucket
for name in ("input_ids", "positions", "write_slots", "context_lens", "logits_at"):
    print(f"  {name:13s} {getattr(plan, name).tolist()}")
print("  slot_window  ", tuple(plan.slot_window.shape), "| real rows:", len(plan.rows))
print("first token each sampled:", [repr(tok.decode([t])) for t in plan.input_ids[:3].tolist()])
assert tuple(plan.slot_window.shape) == (4, 64) and len(plan.rows) == 3

# %% [markdown]
# Three sequences sit at positions 38, 34 and 36, so they attend over 39, 35 and 37 positions.
# The longest, 39, rounds up to the width bucket 64; 3 rows round up to 4. The padded row 3 has
# token 0 at position 0, `context_lens` 0 (so the attention mask hides its whole row) and
# `write_slots` = the sink: its K/V goes to pool entry 496, and since the 31 blocks cover slots
# 0 to 495, no sequence's block table contains that entry.
#
# The window is a view on the slot table (Day 51), not a copy. Row 3 of the table is not owned by
# anyone, so it holds the sink in every column: even before the mask hides it, a padded row
# addresses nothing a sequence owns.

# %%
table = eng.runner.slot_table
print("window is a view on the slot table:", plan.slot_window.data_ptr() == table.address)
for r in range(4):
    row = plan.slot_window[r]
    ctx = plan.context_lens[r].item()
    print(
        f"  row {r}: ctx {ctx:2d} | slots 0..3 {row[:4].tolist()} | at position ctx-1: "
        f"{row[ctx - 1].item() if ctx else '-'} | past ctx: {sorted(set(row[ctx:].tolist()))[:3]}"
    )
eager_plan = plan_decode(batch.decode, config.block_size)  # the same three rows, unpadded
print(
    "eager plan: slot_window",
    tuple(eager_plan.slot_window.shape),
    "| write_slots",
    eager_plan.write_slots.tolist(),
    "| context_lens",
    eager_plan.context_lens.tolist(),
)
assert (plan.slot_window[3] == sink).all() and plan.write_slots[3] == sink and plan.context_lens[3] == 0
assert torch.equal(plan.write_slots[:3], eager_plan.write_slots)

# %% [markdown]
# The eager plan's window is (3, 48): all three rows hold three blocks of 16. Past each real
# row's context the bucketed window holds that row's unwritten table entries (the sink), the
# eager window the rest of the row's last block; either way the mask is what hides them. The
# write slots are the same numbers in both plans.
#
# The gates a captured step will rely on (Day 54) all hold on the padded plan:

# %%
check_pad_inert(plan, sink)  # padded rows: ctx 0 and the sink; real rows: never the sink
check_mapping_is_window(plan, table)  # a view from row 0; rows are the table's live prefix
check_window_intact(plan)  # each real row's window is its block table's slots
check_plan_addressing(plan)  # each real row writes where its window puts its position
print("check_pad_inert, check_mapping_is_window, check_window_intact, check_plan_addressing: pass")

# %% [markdown]
# ## 3. The padded row touches nothing
#
# Copy every layer's K and V pool, run the bucketed step, and list the pool entries that
# changed. Then put the pools back and run the eager, unpadded step on the same three rows. The
# bucketed step changes the three real write slots and the sink; the eager step the three real
# write slots. The difference between the two is the sink entry, and nothing else.

# %%
before = padwaste.snapshot(eng.cache)
bucketed_logits = eng.runner.execute(plan).clone()  # (4, vocab)
after_bucketed = padwaste.snapshot(eng.cache)
padwaste.restore(eng.cache, before)
eager_logits = eng.runner.execute(eager_plan).clone()  # (3, vocab)
after_eager = padwaste.snapshot(eng.cache)

changed_b = padwaste.changed_slots(before, after_bucketed)
changed_e = padwaste.changed_slots(before, after_eager)
print("pool entries the bucketed step changed:", changed_b)
print("pool entries the eager step changed:   ", changed_e)
print(
    "bucketed minus eager:",
    sorted(set(changed_b) - set(changed_e)),
    "= the sink" if set(changed_b) - set(changed_e) == {sink} else "",
)
assert changed_e == plan.write_slots[:3].tolist() and changed_b == changed_e + [sink]

LOGIT_BOUND = 1e-3
dlogit = (bucketed_logits[:3] - eager_logits).abs().max().item()
print(f"real rows: max |Δ logits| bucketed vs eager < {LOGIT_BOUND:g}: {dlogit < LOGIT_BOUND}")
print("argmax equal on every real row:", torch.equal(bucketed_logits[:3].argmax(-1), eager_logits.argmax(-1)))
print(
    "padded row's logits are finite:",
    bool(torch.isfinite(bucketed_logits[3]).all()),
    "(computed, then dropped)",
)
assert dlogit < LOGIT_BOUND and torch.equal(bucketed_logits[:3].argmax(-1), eager_logits.argmax(-1))
padwaste.restore(eng.cache, before)

# %% [markdown]
# The check is "within 1e-3", not "equal", on purpose: a matmul over 4 rows need not add its
# terms in the order one over 3 rows does, so the last bits of the logits (and of the K/V
# written at the three real slots) may differ between the two shapes. Bucketed against eager
# decode is held to the rule any two batch shapes have been held to since Day 32: the same
# tokens, or a near-tie shown to be one. The padded row runs a full forward on token 0 and its
# logits are dropped: padding spends compute and changes no real row's answer.
#
# ## 4. Padded plans built wrong
#
# `check_pad_inert` has three clauses: a padded row attends over nothing, a padded row writes to
# the sink, a real row never writes to the sink. Each of these plans breaks one.


# %%
def broken(plan, **changes):
    """A copy of plan with some per-row entries replaced: {field: (row, value)}."""
    fields = {}
    for name, (row, value) in changes.items():
        t = getattr(plan, name).clone()
        t[row] = value
        fields[name] = t
    return dataclasses.replace(plan, **fields)


wrong = {
    "pad row writes to slot 0": broken(plan, write_slots=(3, 0)),
    "pad row attends over 1 position": broken(plan, context_lens=(3, 1)),
    "real row 1 writes to the sink": broken(plan, write_slots=(1, sink)),
}
for what, bad in wrong.items():
    try:
        check_pad_inert(bad, sink)
        print(f"{what}: passed (it should not)")
    except GateError as e:
        print(f"{what}: GateError: {e}")

# %% [markdown]
# The first one is not a theoretical worry. Slot 0 belongs to somebody: the slot table says
# which sequence owns it and at what position. Run that plan and that sequence's stored K/V is
# overwritten by the padded row's throwaway. Then run the step again, correctly, over the
# damaged pool: the owner's logits move, and nothing in the output says why.

# %%
owner_row, owner_pos = (table.table[: table.num_live] == 0).nonzero()[0].tolist()
owner = table.owner[owner_row]
print(
    f"slot 0 is position {owner_pos} of {owner.request_id} (slot-table row {owner_row}), "
    f"token {tok.decode([owner.token_ids[owner_pos]], skip_special_tokens=False)!r}"
)
eng.runner.execute(wrong["pad row writes to slot 0"])
after_wrong = padwaste.snapshot(eng.cache)
print("pool entries the wrong plan changed:", padwaste.changed_slots(before, after_wrong))
k_moved = (after_wrong[0][0][0] - before[0][0][0]).abs().max().item()
print(f"{owner.request_id}'s layer-0 K at position {owner_pos} was overwritten:", k_moved > 0)
assert padwaste.changed_slots(before, after_wrong) == [0] + plan.write_slots[:3].tolist()

# the same step again, eager and correct, over the damaged pool: only slot 0 is still wrong
damaged_logits = eng.runner.execute(eager_plan).clone()  # (3, vocab)
moved = (damaged_logits - eager_logits).abs().amax(dim=-1)  # (3,) per row
print(f"{owner.request_id}'s next-token logits moved by more than 0.1:", moved[owner_row].item() > 0.1)
print(
    f"{owner.request_id}'s greedy token changed:",
    damaged_logits[owner_row].argmax().item() != eager_logits[owner_row].argmax().item(),
)
print("the other rows' logits moved at all:", bool((moved[torch.arange(3) != owner_row] > 0).any()))
padwaste.restore(eng.cache, before)

# %% [markdown]
# Its greedy token survived this time, which is the worst way for it to go: a check on tokens
# would pass, and every later step of that sequence attends to a corrupted first position. Only
# the gate, which looks at the plan rather than the output, sees it before it happens.
#
# ## 5. What padding costs, and what it buys
#
# The day's script draws 400 decode batches per regime (seeded) on a 256-row, 8192-token engine
# and pads each to its bucket under every granularity: rows as powers of two (nanoserve), as 1,
# 2, 4 then multiples of 8, or every integer; widths at multiples of 1 (no width padding) up to
# 1024. *busy* batches have 1 to 256 rows with contexts up to 2,048 tokens; *light* ones 1 to 16
# rows with contexts up to 512. Waste is the padded share of what the step computes.

# %%
results = padwaste.measure()
tables = {
    "day-52-padwaste.csv": padwaste.width_table(results),
    "day-52-rowwaste.csv": padwaste.row_table(results),
}
for name, rows in tables.items():
    cols = list(rows[0])
    print(name)
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    with open(REPO / "days" / "day52" / name) as f:
        assert [{k: str(v) for k, v in r.items()} for r in rows] == list(csv.DictReader(f)), (
            "rerun padwaste.py"
        )
    print()
at = {(w.regime, w.rows, w.width_multiple): w for w in results}
default = at["busy", "pow2", 128]
print(
    f"nanoserve's serving default (pow2 rows, multiple 128): {default.shapes} shapes, "
    f"busy waste {default.cell_waste:.1%} of cells ({default.row_waste:.1%} of rows)"
)

# %% [markdown]
# Row padding dominates. With batch sizes spread evenly, a power-of-two bucket is on average a
# quarter padding, whatever the width multiple, and a padded row is a whole forward (every
# matmul of every layer), not just attention cells. Width padding in the busy regime stays
# under 6% even at a multiple of 1024, because a batch of a hundred rows almost always has one
# long context; in the light regime it is the width multiple that hurts, and at 1024 (wider than
# any context drawn) most of the rectangle is padding.
#
# Against that, shapes. The CSVs hold the width sweep for power-of-two rows and the row waste
# of each row set; the cell below puts the three row sets side by side at the serving multiple,
# 128, where the capture list would have to hold `shapes` graphs.

# %%
print("rows  | row buckets | shapes | busy row waste | busy cell waste | light cell waste")
for kind in padwaste.ROW_KINDS:
    b, li = at["busy", kind, 128], at["light", kind, 128]
    print(
        f"{kind:5s} | {b.row_buckets:11d} | {b.shapes:6,d} | {b.row_waste:14.1%} | "
        f"{b.cell_waste:15.1%} | {li.cell_waste:16.1%}"
    )
x8 = at["busy", "x8", 128]
print(f"x8 against pow2: {x8.shapes / default.shapes:.1f}x the shapes, busy cell waste {x8.cell_waste:.1%}")
assert (x8.shapes, round(x8.cell_waste, 4)) == (2240, 0.0563)
assert at["light", "x8", 128].cell_waste == at["light", "pow2", 128].cell_waste  # rows <= 16: same buckets

# %% [markdown]
# Steps of 8 cut busy cell waste from 27.4% to 5.6% for 3.9 times the shapes; every integer gets
# it down to the width padding alone, 3.1%, for 28 times. In the light regime, where a batch
# never has more than 16 rows, 1, 2, 4, 8, 16 are the buckets of both row sets, so x8 changes
# nothing there.

# %% [markdown]
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(15, 10.5))

# (a) the padded decode step of section 2: what each cell of the (4, 64) window is
ax = axes[0, 0]
rows_b, width_b = plan.slot_window.shape
cells = torch.zeros(rows_b, width_b, dtype=torch.long)  # 0: masked (past the row's context)
for r in range(rows_b):
    ctx = plan.context_lens[r].item()
    cells[r, :ctx] = 1  # visible
    if r < len(plan.rows):
        cells[r, ctx - 1] = 2  # this step's token: written to write_slots[r], then read
    else:
        cells[r] = 3  # padded row: window all sink, nothing visible, writes to the sink
cmap = ListedColormap(["#dddddd", "#4c8bd6", "#f28e2b", "#c44e52"])
ax.imshow(cells, cmap=cmap, vmin=0, vmax=3, aspect="auto", interpolation="nearest")
e_rows, e_width = eager_plan.slot_window.shape
ax.add_patch(plt.Rectangle((-0.5, -0.5), e_width, e_rows, fill=False, ls="--", lw=2, ec="black"))
for r in range(rows_b):
    label = (
        f"{plan.rows[r].request_id}: ctx {plan.context_lens[r].item()}"
        if r < len(plan.rows)
        else (f"padded: ctx 0, writes sink {sink}")
    )
    ax.text(width_b - 1, r, label, ha="right", va="center", fontsize=9, color="white" if r == 3 else "black")
ax.set_yticks(range(rows_b))
ax.set_xlabel("window column (position)")
ax.set_ylabel("row")
handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in cmap.colors] + [
    plt.Line2D([], [], ls="--", color="black")
]
ax.legend(
    handles,
    [
        "masked (past context)",
        "visible",
        "this step's token",
        "padded row (sink)",
        f"eager window ({e_rows} x {e_width})",
    ],
    loc="lower center",
    fontsize=9,
    ncol=3,
)
ax.set_ylim(rows_b + 0.9, -0.5)  # a free band under the rows for the legend
ax.set_title(f"3 sequences padded to the ({rows_b}, {width_b}) bucket")

# (b) row waste by batch size, for each row set
ax = axes[0, 1]
sizes = range(1, 257)
for kind, color in (("pow2", "#c44e52"), ("x8", "#4c8bd6")):
    rset = padwaste.row_set(kind, 256)
    ax.plot(
        sizes,
        [1 - n / bucket_up(n, rset) for n in sizes],
        color=color,
        lw=1,
        label=f"{kind}: {len(rset)} buckets, busy mean {at['busy', kind, 1].row_waste:.1%}",
    )
    ax.axhline(at["busy", kind, 1].row_waste, color=color, ls="--", lw=1)
ax.set_xscale("log", base=2)
ax.set_xlabel("real rows in the batch (log2)")
ax.set_ylabel("padded rows / bucket rows")
ax.set_title("Row padding: a sawtooth, a quarter on average for powers of two")
ax.legend(fontsize=9)

# (c) width and cell waste against the width multiple
ax = axes[1, 0]
ms = [m for m in padwaste.WIDTH_MULTIPLES if m > 1]
for regime, color in (("busy", "#4c8bd6"), ("light", "#f28e2b")):
    ax.plot(
        ms, [at[regime, "pow2", m].width_waste for m in ms], "o-", color=color, label=f"{regime}: width waste"
    )
    ax.plot(
        ms,
        [at[regime, "pow2", m].cell_waste for m in ms],
        "s--",
        color=color,
        label=f"{regime}: cell waste (pow2 rows too)",
    )
ax.set_xscale("log", base=2)
ax.set_xticks(ms, [str(m) for m in ms])
ax.set_xlabel("width_multiple")
ax.set_ylabel("padded share")
ax.set_ylim(0, 0.75)
ax.set_title("Width padding grows with the multiple; row padding is the floor of cell waste")
ax.legend(fontsize=9)

# (d) the trade-off: shapes to capture against cell waste
ax = axes[1, 1]
for kind, marker in (("pow2", "o"), ("x8", "^"), ("every", "s")):
    for regime, color in (("busy", "#4c8bd6"), ("light", "#f28e2b")):
        pts = [at[regime, kind, m] for m in padwaste.WIDTH_MULTIPLES]
        ax.plot(
            [p.shapes for p in pts],
            [p.cell_waste for p in pts],
            marker=marker,
            color=color,
            ls="-",
            lw=0.8,
            ms=5,
            label=f"{regime}, rows {kind}",
        )
ax.annotate(
    f"nanoserve default (pow2, 128):\n{default.shapes} shapes, {default.cell_waste:.1%} waste",
    (default.shapes, default.cell_waste),
    xytext=(-20, 90),
    textcoords="offset points",
    arrowprops=dict(arrowstyle="->"),
    fontsize=9,
)
ax.annotate(
    f"rows x8, 128:\n{x8.shapes:,} shapes, {x8.cell_waste:.1%} waste",
    (x8.shapes, x8.cell_waste),
    xytext=(-90, 40),
    textcoords="offset points",
    arrowprops=dict(arrowstyle="->"),
    fontsize=9,
)
ax.set_xscale("log")
ax.set_xlabel("shapes in the closed set (rows x widths, log)")
ax.set_ylabel("cell waste")
ax.set_title("Fewer shapes cost more padding (points: width multiple 1..1024)")
ax.legend(fontsize=8, ncol=2)

fig.suptitle("Day 52: decode batches padded to a closed set of (rows, width) shapes", fontsize=14)
fig.tight_layout()
png = diagram_path("day52-buckets.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** pads a batch along one axis only, its token count. The list of captured sizes is
#   `CompilationConfig.cudagraph_capture_sizes` (`vllm/config/compilation.py`); left unset, it
#   is `[1, 2, 4]`, then every multiple of 8 below 256, then steps of 16 up to
#   `max_cudagraph_capture_size`, which defaults to `min(max_num_seqs * 2, 512)`. Up to 256 that
#   is our `x8` row set, not powers of two. `get_cudagraph_sizes` in
#   `vllm/v1/worker/gpu/cudagraph_utils.py` maps every count from 1 to the largest size onto the
#   smallest captured size at or above it; a batch past the largest runs eager
#   (`CUDAGraphMode.NONE`).
# * **vLLM has no width buckets.** Its graphs are keyed by `BatchDescriptor(num_tokens=...)`:
#   the context length of each request is data (`seq_lens`, the block table) read by the
#   attention kernel, not a tensor shape, so a longer context needs no new graph. Ours is a
#   shape because our attention gathers a `(rows, width)` window with `index_select`.
# * **vLLM's padding is a skip, not a sink.** Padded token slots hold `PAD_SLOT_ID` (-1,
#   `vllm/v1/attention/backends/utils.py`), and `_prepare_pos_seq_lens_kernel` in
#   `vllm/v1/worker/gpu/input_batch.py` sets the unused `seq_lens` entries to 0 ("for full CUDA
#   graphs"), our `context_lens` 0. nano-vllm does the same: `run_model`
#   (`nanovllm/engine/model_runner.py`) fills its `slot_mapping` buffer with -1 and zeroes
#   `context_lens` before copying the real rows in, and `store_kvcache_kernel`
#   (`nanovllm/layers/attention.py`) returns early when the slot is -1. We write the padded row's
#   K/V for real, into an entry nobody reads, so our write needs no branch.
# * **nano-vllm's row set**: `capture_cudagraph` records batch sizes
#   `[1, 2, 4, 8] + list(range(16, max_bs + 1, 16))` with `max_bs = min(max_num_seqs, 512)`, and
#   `run_model` replays the graph of `next(x for x in self.graph_bs if x >= bs)`, running eager
#   for prefill, for `enforce_eager`, and above 512 rows.
#
# ## Try it
#
# 1. **nano-vllm's row set, priced.** Add a `"x16"` kind to `padwaste.row_set` returning
#    `(1, 2, 4, 8)` plus every multiple of 16 up to `max_batch`, and run
#    `padwaste.waste(padwaste.decode_batches("busy"), "busy", "x16", 128)`. Check: 20 row
#    buckets, so `shapes == 1280`, and a busy `row_waste` between x8's 2.6% and pow2's 25.1%.
# 2. **A width multiple for short contexts.** From `padwaste.measure()` (or the CSV), find the
#    largest width multiple whose light-regime width waste stays under 5%. Check: you get 32
#    (3.6%), and 64 is already 7.2%. Then work out why 16 costs nothing over eager here (section 2's
#    eager window is whole 16-slot blocks).
# 3. **Break the sink on purpose.** In `nanoserve/plan.py`, `plan_decode_bucketed` pads
#    `write_slots` with `slot_table.sink_slot` when there are no persistent buffers (this
#    notebook's engine). Change that to `0` and rerun from section 2: the assert on
#    `plan.write_slots[3] == sink` fails, and `check_pad_inert(plan, sink)` raises
#    `padded row 3 is not inert`. Run the bucketed step anyway (section 3's first cell) and the
#    changed pool entries start with slot 0, req-0's `<|im_start|>`. Restore the line.

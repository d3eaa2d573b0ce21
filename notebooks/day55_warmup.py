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
# # Day 55 — The capture list moves to startup
#
# Yesterday's engine recorded a decode graph at the moment a batch first showed a new shape, so
# the requests in that batch sat through the recording, and sat through another one each time
# their contexts grew into a wider bucket. Today those recordings happen before the engine
# accepts anything: for each shape in a list, `nanoserve.warmup` makes up a step that belongs
# to no request and runs it through the ordinary runner, which records it.
#
# What may such a step be? A graph holds on to the storage it ran on, so the step cannot be
# built from scratch tensors and discarded: it must read the slot table and the persistent
# buffers that real steps will read later, and write into the same K/V pools, which may
# already hold other sequences' keys and values. Day 52 has the piece that makes that safe. A
# padded row attends over zero tokens and puts its K/V in the sink slot, an index no block
# owns. A step built from nothing but such rows can go through the live table, buffers and
# pools without changing anything a request owns.
#
# 1. `warmup_plan` and `warmup_batch`: a warm step, tensor by tensor,
# 2. Day 54's six preconditions on it, and on warm plans built wrong,
# 3. `Engine.warm_decode` on SmolLM2: what changed in the pools, the eight warm gates, tokens
#    against a plain engine, and each gate failing,
# 4. the slot table's address, the one Day 54 did not watch,
# 5. `days/day55/warmbench.py`: recordings in front of a request, what each way of recording
#    costs over a process lifetime, and a memory budget read as a width,
# 6. the diagram.

# %%
import csv
import sys
import time

import matplotlib
import matplotlib.transforms
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, engine_config
from nanoserve.buckets import check_pad_inert
from nanoserve.capture import check_addresses_stable, check_replay_rows
from nanoserve.engine import Engine
from nanoserve.errors import GateError
from nanoserve.inputs import PersistentInputs
from nanoserve.models import load_model
from nanoserve.plan import check_mapping_is_window, check_plan_addressing, check_window_intact, plan_decode
from nanoserve.sampling import SamplingParams
from nanoserve.slots import SlotTable
from nanoserve.tokenizer import Tokenizer
from nanoserve.warmup import (
    check_all_warm,
    check_no_cold_captures,
    check_table_stable,
    check_warm_budget,
    check_warm_graphs_unbound,
    check_warm_rows_empty,
    check_warm_touches_nothing,
    check_warm_writes_sink,
    warm_budget_bytes,
    warm_shapes,
    warmup_batch,
    warmup_plan,
)
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day55"))
import warmbench  # the day's script: the notebook prints the tables it writes

MODEL_DIR = fetch_default_model()
t0 = time.perf_counter()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
print(f"SmolLM2-135M-Instruct, fp32, loaded in {time.perf_counter() - t0:.1f} s")


def smol_engine(**switches) -> Engine:
    cfg = engine_config(
        55,  # the engine as of day 55: prefill-first, gather attention, plain linears
        max_batch=4, max_model_len=128, kv_budget="32MiB", width_multiple=32, **switches,
    )
    return Engine(model, tok, cfg)


def fails(label, gate, *args):
    """Run a gate that must refuse; print its sentence."""
    try:
        gate(*args)
    except GateError as e:
        print(f"{label:<40} -> {gate.__name__}: {e}")
        return True
    raise AssertionError(f"{gate.__name__} passed on {label}")


# %% [markdown]
# ## 1. What a warm batch is
#
# The engine for the whole notebook: the Day 51-54 switches on, 4 rows, a 128-token context and
# width buckets of 32. Its buckets are rows {1, 2, 4} by widths {32, 64, 96, 128}: 12 shapes.
# `warmup_plan(shape, slot_table, inputs)` returns the plan of one such shape with an empty row
# tuple. It does not go through `plan_decode`, which rejects an empty batch and says what to
# call instead:

# %%
warm = smol_engine(bucket_decode=True, persist_inputs=True, capture_decode=True)
runner, sink = warm.runner, warm.pool.sink_slot
try:
    plan_decode([], warm.config.block_size)
except ValueError as e:
    print("plan_decode([]):", e)
print("shape set:", warm_shapes(4, 128, 32))
assert len(warm_shapes(4, 128, 32)) == 12

# %% [markdown]
# The plan for the largest shape, (4, 128). All four rows are padding: token 0 at position 0,
# the K/V write aimed at the sink (index 720 here, one past the last slot a block can own), and
# a context length of 0, so attention has nothing to read. `rows` is `()`.

# %%
plan = warmup_plan((4, 128), runner.slot_table, runner.inputs)
print("rows:", plan.rows)
print("input_ids:   ", plan.input_ids.tolist())
print("positions:   ", plan.positions.tolist())
print("write_slots: ", plan.write_slots.tolist(), f"(sink_slot = {sink})")
print("context_lens:", plan.context_lens.tolist())
print("slot_window: ", tuple(plan.slot_window.shape), "every entry", plan.slot_window.unique().tolist())
print("logits_at:   ", plan.logits_at.tolist())
assert plan.rows == () and set(plan.write_slots.tolist()) == {sink} and not plan.context_lens.any()

# %% [markdown]
# Nothing above was allocated for the warm-up. The slot window is a view of the top-left
# 4 x 128 corner of Day 51's slot table, and the four per-row tensors are views of the first four
# entries of Day 53's buffers. This is why a graph recorded from the plan can later serve real
# steps: at replay it reads whatever the current real step has just written into the same
# bytes.

# %%
inputs, table = runner.inputs, runner.slot_table
windows = {
    "slot_window": (plan.slot_window, table.table),
    "input_ids": (plan.input_ids, inputs.input_ids),
    "positions": (plan.positions, inputs.positions),
    "write_slots": (plan.write_slots, inputs.write_slots),
    "context_lens": (plan.context_lens, inputs.context_lens),
}
for name, (view, real) in windows.items():
    same = view.data_ptr() == real.data_ptr()
    storage = view.untyped_storage().data_ptr() == real.untyped_storage().data_ptr()
    print(
        f"{name:<13} {tuple(view.shape)!s:<9} same data_ptr as the real buffer: {same}, "
        f"same storage: {storage}"
    )
    assert same and storage
print(f"slot table at {table.address:#x}, {tuple(table.table.shape)}")

# %% [markdown]
# `warmup_batch` pairs the plan with the cache object the model talks to, a `BatchedCacheRows`
# bound to a plan without rows. Attention through it returns exact zeros, since no row has any
# context. (`ensure_pools` allocates every layer's K and V pool now; left alone, the cache
# allocates a layer's pools on its first write.)

# %%
warm.cache.ensure_pools()
plan, rows = warmup_batch((4, 128), runner.slot_table, runner.inputs, warm.cache)
q = torch.linspace(-1, 1, 4 * model.cfg.num_heads * model.cfg.head_dim).view(4, model.cfg.num_heads, -1)
out = rows.attention(0, q)
print(type(rows).__name__, "bound to the warm plan:", rows.plan is plan, " attention:", tuple(out.shape))
print("attention output all zero:", bool((out == 0).all()))
assert (out == 0).all()

# %% [markdown]
# ## 2. Day 54's six preconditions, on a warm plan
#
# The six gates run unchanged, and all six pass. None was written with warm-ups in mind: each
# either walks the plan's real rows or compares them with the table's live rows, and a warm plan
# has no real rows, so there is nothing to reject. For `check_replay_rows` the cell records one
# graph from the warm plan and holds it against a real one-row decode step of a second engine:
# a graph whose frozen tuple is `()` has no rows that could disagree with anybody's.

# %%
with torch.inference_mode():
    g = runner.record(plan)  # one graph, recorded from the warm plan
check_pad_inert(plan, sink)  # padded rows inert; "no real row writes the sink": no real rows
check_mapping_is_window(plan, table)  # no rows: nothing to match against the live prefix
check_window_intact(plan)  # loops over no rows
check_plan_addressing(plan)  # loops over no rows
check_addresses_stable(inputs, inputs.addresses)
print("frozen rows of the warm graph:", g.args[0].rows)
runner.graphs.clear()  # the warm-up proper is section 3's

probe = smol_engine(bucket_decode=True, persist_inputs=True)
probe.add_request("Hello!", SamplingParams(max_tokens=3))
probe.step()  # prefill
real = probe.runner.plan(probe.scheduler.schedule())
check_replay_rows(g, real)
print("the six pass on the warm plan; check_replay_rows passes for a real step over", len(real.rows), "row")

# %% [markdown]
# Passing on an empty plan is not the same as not checking. Two warm plans built wrong, and the
# same gates refuse them. The first has a real sequence pushed into its row tuple: that "real"
# row now stores its K/V in the sink, and the plan names an owner the table does not have. The
# second aims padded row 1 at slot 0, which belongs to whatever sequence holds block 0. Since a
# warm plan's tensors are the persistent buffers themselves, the next `warmup_plan` call
# overwrites the damage.

# %%
bad = warmup_plan((4, 128), table, inputs)
bad.rows = (real.rows[0],)
assert fails("a warm plan with a row assigned", check_pad_inert, bad, sink)
assert fails("a warm plan with a row assigned", check_mapping_is_window, bad, table)
bad = warmup_plan((4, 128), table, inputs)
bad.write_slots[1] = 0
assert fails("a warm plan writing to slot 0", check_pad_inert, bad, sink)
plan = warmup_plan((4, 128), table, inputs)  # repaired: the buffers rewritten
check_pad_inert(plan, sink)

# %% [markdown]
# ## 3. Warming the engine
#
# `Engine.warm_decode` makes sure the pools exist, asks `warm_shapes` for the list, largest
# shape first, and records one graph per shape from a warm plan. The order is for CUDA, where
# all captures draw on one shared memory pool: once the largest is recorded, every smaller one
# fits in memory the pool already holds. To test the claim that a warm-up leaves live data
# alone, the cell first fills every K and V pool with a fixed pattern that stands in for other
# sequences' K/V, keeps a copy, warms, and compares entry by entry.

# %%
with torch.inference_mode():
    for i, pool in enumerate(warm.cache.k + warm.cache.v):  # a pattern no warm-up would write
        pool.copy_(torch.sin(torch.arange(pool.numel(), dtype=pool.dtype) * 0.37 + i).view(pool.shape))
before_k = [k.clone() for k in warm.cache.k]
before_v = [v.clone() for v in warm.cache.v]
address = table.address

report = warm.warm_decode()
print(report.describe())
print(f"{report.seconds / report.graphs * 1000:.1f} ms a graph (a HostGraph recording is one forward)")
print("recorded, in order:", report.shapes)
changed = sorted(
    {
        i
        for a, b in zip(before_k + before_v, warm.cache.k + warm.cache.v)
        for i in (a != b).flatten(1).any(1).nonzero().flatten().tolist()
    }
)
print("pool entries the warm-up changed, any layer, K or V:", changed, f"(the sink is {sink})")
assert changed == [sink] and report.shapes[0] == (4, 128) and report.graphs == 12
assert runner.lazy is False  # once a list is recorded, a shape outside it runs eagerly

# %% [markdown]
# Across 30 layers, K and V alike, the one entry that changed is the sink. The day's eight gates
# then run on what the warm-up left behind; the right-hand column is the broken input each is
# shown refusing further down.
#
# | gate | the fact it checks | refused below on |
# |---|---|---|
# | `check_warm_rows_empty` | the warm plan names no sequence | a warm plan given a row |
# | `check_warm_writes_sink` | every row writes to the sink and has context 0 | a warm row aimed at slot 0 |
# | `check_warm_touches_nothing` | no pool entry below the sink changed | slot 17 of layer 3 altered |
# | `check_table_stable` | the slot table is where the graphs saw it | a table moved by `SlotTable.to` |
# | `check_warm_graphs_unbound` | every graph froze the empty row tuple | graphs of a never-warmed engine |
# | `check_no_cold_captures` | nothing was recorded after the warm-up | that engine's 2 recordings |
# | `check_all_warm` | each shape of the list has its graph | a list with `(8, 128)` added |
# | `check_warm_budget` | the widest shape's scores fit the memory probed | a budget 1 byte short |
#
# The budget is read as a server would read it, here the host's available memory (free device
# memory on CUDA); a step's scores are rows x heads x width fp32 numbers.

# %%
shapes = warm_shapes(4, 128, 32)
check_warm_rows_empty(plan)
check_warm_writes_sink(plan, sink)
check_warm_touches_nothing(before_k, warm.cache.k, sink)
check_warm_touches_nothing(before_v, warm.cache.v, sink)
check_table_stable(table, address)
check_warm_graphs_unbound(runner.graphs)
check_all_warm(shapes, runner.graphs)
heads = model.cfg.num_heads
check_warm_budget(shapes, warm_budget_bytes("cpu"), heads)
print(
    f"widest shape's scores: 4 x {heads} x 128 x 4 = {4 * heads * 128 * 4:,} bytes, within the probed budget"
)
with torch.inference_mode():  # the pattern out again, in place: the graphs' storage stays put
    for pool in warm.cache.k + warm.cache.v:
        pool.zero_()

# %% [markdown]
# Then requests: Day 54's three chat prompts, once through the warmed engine and once through a
# plain engine (no buckets, no persistent inputs, no capture). Before each decode step of the
# warmed engine the wrapper looks up the step's graph, which must exist, and holds its frozen
# rows against the step's.

# %%
PROMPTS = [[{"role": "user", "content": q}] for q in ("What is 2 + 2?", "Name a colour.", "Say hi.")]
PARAMS = SamplingParams(max_tokens=32, ignore_eos=True)
execute, replays = runner.execute, []


def watched(p):
    if p.is_decode:
        check_replay_rows(runner.graphs[tuple(p.slot_window.shape)], p)
        replays.append(tuple(p.slot_window.shape))
    return execute(p)


runner.execute = watched
warm_out = warm.generate(PROMPTS, PARAMS, use_tqdm=False)
plain_out = smol_engine().generate(PROMPTS, PARAMS, use_tqdm=False)
for w, p in zip(warm_out, plain_out):
    print(f"identical: {w.token_ids == p.token_ids}  {w.text[:56]!r}")
print(
    f"{len(replays)} decode steps, shapes used {sorted(set(replays))}, cold captures {runner.cold_captures}"
)
check_no_cold_captures(runner.cold_captures)
assert [w.token_ids for w in warm_out] == [p.token_ids for p in plain_out]

# %% [markdown]
# Now each of the eight refusing a wrong input. The two inputs about how graphs came to exist
# come from an engine that is never warmed, so it records as it goes (Day 54's behaviour); it
# runs the tiny random-weight model of `warmbench.py`.

# %%
bad = warmup_plan((2, 64), table, inputs)
bad.rows = ("somebody",)
assert fails("a warm plan with a row", check_warm_rows_empty, bad)
bad.write_slots[1] = 0
assert fails("a warm row writing to slot 0", check_warm_writes_sink, bad, sink)
warmup_plan((2, 64), table, inputs)  # buffers repaired
after = [k.clone() for k in before_k]
after[3][17, 0, 0] += 1.0
assert fails("slot 17 of layer 3 changed", check_warm_touches_nothing, before_k, after, sink)
moved = SlotTable(4, 128, sink)
moved_at = moved.address
moved.to("cpu")  # always new storage
assert fails("a slot table moved after recording", check_table_stable, moved, moved_at)
tiny = warmbench.tiny_model()


def tiny_engine() -> Engine:
    """2 rows, 48 tokens, width multiple 16, capture on: the tiny model's engine."""
    per_block = tiny.cfg.kv_bytes_per_token(torch.float32) * 16
    cfg = engine_config(
        55,  # the engine as of day 55: prefill-first, gather attention, plain linears
        max_batch=2,
        max_model_len=48,
        kv_budget=per_block * 8,
        width_multiple=16,
        bucket_decode=True,
        persist_inputs=True,
        capture_decode=True,
    )
    return Engine(tiny, None, cfg)


lazy_eng = tiny_engine()  # captures lazily: it is never warmed
lazy_eng.generate([list(range(1, 17))], SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
assert fails("graphs captured mid-run", check_warm_graphs_unbound, lazy_eng.runner.graphs)
assert fails("a run that captured lazily", check_no_cold_captures, lazy_eng.runner.cold_captures)
assert fails("a list with one shape never recorded", check_all_warm, shapes + [(8, 128)], runner.graphs)
assert fails("a budget below the widest shape", check_warm_budget, shapes, 4 * heads * 128 * 4 - 1, heads)

# %% [markdown]
# ## 4. The slot table's address
#
# Day 54's `check_addresses_stable` watches the five persistent buffers. The graphs read one
# more tensor, the slot table, through their windows, and on Day 54 nothing watched where that
# table lived, although `SlotTable.to` always gives it new storage. `check_table_stable` is the
# gate for it. The bytes each gate watches, on this engine and at 256 rows by 8192 tokens:


# %%
def guarded_bytes(max_batch, max_model_len):
    buffers = PersistentInputs(max_batch, sink_slot=0)
    slots = SlotTable(max_batch, max_model_len, sink_slot=0)
    small = sum(b.numel() * b.element_size() for b in buffers.buffers())
    return small, slots.table.numel() * slots.table.element_size()


sizes = {"this engine (4 x 128)": guarded_bytes(4, 128), "serving (256 x 8192)": guarded_bytes(256, 8192)}
for label, (small, big) in sizes.items():
    print(
        f"{label:<22} check_addresses_stable: {small:>7,} bytes (5 buffers)   "
        f"check_table_stable: {big:>10,} bytes"
    )

# %% [markdown]
# Neither can stand in for the other. On a throwaway tiny engine: warm it, move its slot table,
# and ask both.

# %%
t_eng = tiny_engine()
t_eng.warm_decode()
addrs, table_at = t_eng.runner.inputs.addresses, t_eng.runner.slot_table.address
t_eng.runner.slot_table.to("cpu")
check_addresses_stable(t_eng.runner.inputs, addrs)
print("check_addresses_stable after the table moved: passes")
assert fails("the same moved table", check_table_stable, t_eng.runner.slot_table, table_at)

# %% [markdown]
# ## 5. The benchmark: `warmbench.py`
#
# **Recordings in front of a request.** Two requests share one 16-token prompt on the tiny
# random-weight model, with width buckets of 32 and a context limit of prompt plus generated
# tokens, raised to 64 where that is less so that every run spans two buckets or more. Each
# length runs twice: recording lazily, where the graphs recorded mid-run (`cold_lazy`) should be
# `lazy_captures`, and after `warm_decode`, where they should be 0 (`cold_warmed`). `cold_table`
# asserts the two runs produce the same tokens.

# %%
cold = warmbench.cold_table()
facts = ["generated", "cold_lazy", "predicted", "cold_warmed", "warm_graphs"]
print(" | ".join(facts))
for row in cold:
    print(" | ".join(str(row[c]) for c in facts))
with open(warmbench.HERE / "day-55-warmbench.csv") as f:
    committed = list(csv.DictReader(f))
assert [[str(r[c]) for c in facts] for r in cold] == [[r[c] for c in facts] for r in committed]
assert all(r["cold_lazy"] == r["predicted"] and r["cold_warmed"] == 0 for r in cold)
print("the script's run:", committed[0]["cpu"])  # warm_ms: the committed CSV's, not this kernel's clock
for row in committed:
    print(f"generated {row['generated']:>3}: warmed {row['warm_graphs']:>2} graphs in {row['warm_ms']} ms")

# %% [markdown]
# The warm list is larger than the lazy count (4 to 10 graphs against 1 to 5) because it holds
# every shape up to the context limit, the 1-row shapes included, while the two requests decode
# in step in the 2-row bucket and only ever present the widths they grow through. The times are
# the committed CSV's, written by the script on an AVX-512 CPU with bf16 instructions at 2
# threads (its `cpu` column; an AMD EPYC): the tiny model's lists of 4 to 10 graphs took 1.5 to
# 3.3 ms to record, the longer lists the longer times, each recording one forward through the
# model's two small layers.

# %% [markdown]
# **What each way of recording costs, at serving size.** 256 rows, 8192 tokens, width buckets of
# 128: 9 row buckets by 64 widths, 576 shapes. Every price assumes 50 ms per recording, a guess
# at a CUDA capture that this CPU does not measure. Per request length the table gives
#
# * `lazy_graphs` and `stall_s`: the widths one request of that length walks through at one row
#   count, and what the first such request waits for them;
# * `lazy_rows8_s` and `lazy_all_rows_s`: what lazy recording pays over the life of the process
#   if requests of that length turn up at every row count up to 8, or at all nine;
# * `warm_full_s`, `warm_rows8_s`, `warm_rows8_ctx2048_s`: startup for the full list, for the
#   list cut to rows <= 8, and cut to rows <= 8 and widths <= 2048.

# %%
pricing = warmbench.pricing_table()
print(" | ".join(pricing[0]))
for row in pricing:
    print(" | ".join(str(v) for v in row.values()))
with open(warmbench.HERE / "day-55-pricing.csv") as f:
    assert [{k: str(v) for k, v in r.items()} for r in pricing] == [
        {k: r[k] for k in pricing[0]} for r in csv.DictReader(f)
    ]
trims = ({}, {"max_rows": 8}, {"max_rows": 8, "max_width": 2048})
lists = [len(warm_shapes(256, 8192, 128, **kw)) for kw in trims]
print("shapes in the three lists:", lists)
assert lists == [576, 256, 64]
last = pricing[-1]  # 8192 tokens: traffic that reaches every width
assert last["lazy_all_rows_s"] == last["warm_full_s"] and last["lazy_rows8_s"] == last["warm_rows8_s"]
assert pricing[2]["lazy_rows8_s"] == pricing[2]["warm_rows8_ctx2048_s"]  # 2048 tokens, rows <= 8

# %% [markdown]
# Read the table by rows, not by the first and last column. A recorded graph stays for the life
# of the process however it was recorded, so a lazily recording server does not charge 3.2 s to
# every 8192-token request: it charges each shape's 50 ms once, to whichever request reaches
# that shape first, and every later request at that shape replays. Setting the full list's
# 28.8 s of startup against one request's 3.2 s would weigh a cost paid once per process
# against a cost paid once per process *for one row count*. The like-for-like figures are the
# lifetime sums. Where traffic reaches every shape, lazy recording adds up to exactly the
# full list's 28.8 s (`lazy_all_rows_s` at 8192 tokens); where it stays at 8 rows or fewer, to
# the 8-row list's 12.8 s; at 2048 tokens and 8 rows, to the 64-shape list's 3.2 s. Per shape the
# two ways cost the same.
#
# So warming does not make the recordings cheaper. It changes who waits for them (the boot
# instead of a client) and what gets recorded: a warm list pays for every shape in it, including
# shapes this deployment's traffic never reaches, while lazy recording only ever pays for shapes
# that were used. That is the argument for trimming the list to the traffic: the rows the
# scheduler will actually run and the context the deployment actually serves.

# %% [markdown]
# **A memory budget, read as a width.** All captures draw on one pool, so the pool needs what its
# single largest capture needs, and a step's scores grow as rows x heads x width. The question a
# budget answers is therefore how wide the widest shape may be: `width_ceiling` solves for it at
# 256 rows and 32 heads, and `warm_shapes(max_width=...)` drops every shape past it.

# %%
budget = warmbench.budget_table()
print(" | ".join(budget[0]))
for row in budget:
    print(" | ".join(str(v) for v in row.values()))
with open(warmbench.HERE / "day-55-budget.csv") as f:
    assert [{k: str(v) for k, v in r.items()} for r in budget] == list(csv.DictReader(f))

# %% [markdown]
# ## 6. The diagram

# %%
fig = plt.figure(figsize=(15, 11))
outer = fig.add_gridspec(2, 2, hspace=0.3, wspace=0.25)

# left top: what a warm batch is
ax = fig.add_subplot(outer[0, 0])
ax.axis("off")
ax.set_title("a warm batch: warmup_plan((4, 128), slot_table, inputs)", fontsize=12)
ax.text(
    0.0, 0.95, "no plan_decode behind it (plan_decode([]) refuses an empty batch);\n"
    "five views of the buffers real steps use, and rows = ()",
    fontsize=10, color="dimgray", transform=ax.transAxes, va="top",
)  # fmt: skip
cells = [
    ["slot_window", "(4, 128)", f"all {sink} (the sink)", "slot_table.table[:4, :128]"],
    ["input_ids", "(4,)", "0  0  0  0", "inputs.input_ids[:4]"],
    ["positions", "(4,)", "0  0  0  0", "inputs.positions[:4]"],
    ["write_slots", "(4,)", f"{sink} x 4 (the sink)", "inputs.write_slots[:4]"],
    ["context_lens", "(4,)", "0  0  0  0 (masked)", "inputs.context_lens[:4]"],
    ["rows", "()", "empty", "no sequence to freeze"],
]
t = ax.table(
    cellText=cells,
    colLabels=["field", "shape", "values", "window on (same data_ptr)"],
    cellLoc="left",
    colWidths=[0.21, 0.13, 0.28, 0.38],
    bbox=[0, 0.0, 1, 0.8],
)
t.auto_set_font_size(False)
t.set_fontsize(10)
for (r, c), cell in t.get_celld().items():
    if r == 0:
        cell.set_facecolor("#dde6f0")
    elif r == 6:
        cell.set_facecolor("#fff1cc")
    elif c == 3:
        cell.set_facecolor("#e3f2e1")

# right top: six preconditions, then the two address gates in bytes
right = outer[0, 1].subgridspec(2, 1, height_ratios=[1.25, 1], hspace=0.45)
ax = fig.add_subplot(right[0])
ax.axis("off")
ax.set_title("Day 54's six preconditions on the warm plan: unchanged, all pass", fontsize=12)
six = [
    ["check_pad_inert", "pass", "pads inert; no real row at the sink"],
    ["check_mapping_is_window", "pass", "no rows to match the live prefix"],
    ["check_window_intact", "pass", "loops over no rows"],
    ["check_plan_addressing", "pass", "loops over no rows"],
    ["check_addresses_stable", "pass", "warm plan wrote into them"],
    ["check_replay_rows", "pass", "froze (): no batch to mistake"],
]
t = ax.table(
    cellText=six,
    colLabels=["gate", "warm", "why it passes"],
    cellLoc="left",
    colWidths=[0.41, 0.08, 0.51],
    bbox=[0, 0, 1, 1],
)
t.auto_set_font_size(False)
t.set_fontsize(9)
for (r, c), cell in t.get_celld().items():
    cell.set_facecolor("#dde6f0" if r == 0 else ("#e3f2e1" if c == 1 else "white"))
ax = fig.add_subplot(right[1])
labels = list(sizes)
xs = range(len(labels))
small = [sizes[k][0] for k in labels]
big = [sizes[k][1] for k in labels]
ax.bar([i - 0.2 for i in xs], small, 0.4, label="check_addresses_stable: 5 input buffers", color="tab:blue")
ax.bar([i + 0.2 for i in xs], big, 0.4, label="check_table_stable: the slot table", color="tab:orange")
for i in xs:
    ax.text(i - 0.2, small[i] * 1.4, f"{small[i]:,} B", ha="center", fontsize=9)
    ax.text(i + 0.2, big[i] * 1.4, f"{big[i]:,} B", ha="center", fontsize=9)
ax.set_yscale("log")
ax.set_ylim(50, 5e9)
ax.set_xticks(list(xs), labels)
ax.set_ylabel("bytes guarded (log)")
ax.set_title("bytes each address gate watches", fontsize=11)
ax.legend(loc="upper left", fontsize=9)

# left bottom: cold column against the prediction
ax = fig.add_subplot(outer[1, 0])
xs = range(len(cold))
lazy_bars = [r["cold_lazy"] for r in cold]
warm_bars = [r["cold_warmed"] for r in cold]
ax.bar([i - 0.27 for i in xs], lazy_bars, 0.27, label="cold captures, lazy", color="tab:red")
ax.bar(
    list(xs),
    [r["predicted"] for r in cold],
    0.27,
    label="lazy_captures(n, 32, prompt_len=16)",
    color="tab:gray",
)
ax.bar([i + 0.27 for i in xs], warm_bars, 0.27, label="cold captures after warm_decode", color="tab:green")
for i, r in enumerate(cold):
    ax.text(i + 0.27, 0.1, "0", ha="center", color="tab:green", fontsize=11)
    ax.text(i, r["predicted"] + 0.2, f"warm list:\n{r['warm_graphs']} graphs", ha="center", fontsize=9)
ax.set_xticks(list(xs), [str(r["generated"]) for r in cold])
ax.set_xlabel("tokens generated (tiny model, 2 requests, one prompt of 16 tokens, widths of 32)")
ax.set_ylabel("graphs recorded in front of a request")
ax.set_ylim(0, 7.5)
ax.set_title("warmbench: the cold column is lazy_captures, and 0 once warmed", fontsize=12)
ax.legend(loc="upper left", fontsize=9)

# right bottom: recording paid once per shape per process, and the budget as a width ceiling
right = outer[1, 1].subgridspec(2, 1, height_ratios=[1.6, 1], hspace=0.6)
ax = fig.add_subplot(right[0])
xs = range(len(pricing))
series = [
    ("stall_s", "first request, one row count", "tab:red"),
    ("lazy_rows8_s", "lazy, lifetime: rows 1-8 all reached", "tab:orange"),
    ("lazy_all_rows_s", "lazy, lifetime: all 9 row counts reached", "tab:brown"),
]
for j, (col, label, color) in enumerate(series):
    ax.bar([i + (j - 1) * 0.27 for i in xs], [float(r[col]) for r in pricing], 0.27, label=label, color=color)
edge = matplotlib.transforms.blended_transform_factory(ax.transAxes, ax.transData)
for col, name, style, va in (
    ("warm_full_s", "warm: full list, 576", "-", "bottom"),
    ("warm_rows8_s", "warm: rows <= 8, 256", "--", "top"),
    ("warm_rows8_ctx2048_s", "warm: rows <= 8, width <= 2048, 64", ":", "top"),
):
    v = float(pricing[0][col])
    ax.axhline(v, color="tab:purple", ls=style, lw=1.2)
    ax.text(1.01, v, f"{name}: {v:.1f} s", fontsize=8, color="tab:purple", va=va, transform=edge)
ax.set_yscale("log")
ax.set_ylim(0.02, 3e3)
ax.set_xticks(list(xs), [f"{r['generated']} tokens" for r in pricing])
ax.set_ylabel("seconds of recording (log)")
ax.set_xlabel("request length (256 rows, 8192 context, width multiple 128, 50 ms a graph)")
ax.set_title("each shape is recorded once per process: lazy totals meet the lists", fontsize=11)
ax.legend(loc="upper left", fontsize=7.5, ncol=1)
ax = fig.add_subplot(right[1])
names = [f"{b['budget_mb']:,} MB" for b in budget]
ax.bar(names, [b["widest_capture"] for b in budget], color="tab:orange", width=0.5)
for i, b in enumerate(budget):
    inside = b["widest_capture"] > 5000
    y = b["widest_capture"] / 2 if inside else b["widest_capture"] + 400
    text = f"width <= {b['widest_capture']:,}\n{b['shapes_that_fit']} of {b['of']} shapes"
    ax.text(i, y, text, ha="center", va="center" if inside else "bottom", fontsize=9)
ax.axhline(8192, color="gray", ls="--", lw=1)
ax.set_ylim(0, 11000)
ax.set_xlabel("graph pool budget (fp32 scores, 32 heads, 256 rows)")
ax.set_ylabel("widest capture, tokens")
ax.set_title("widest shape a budget allows (dashed: max_model_len 8192)", fontsize=11)

fig.suptitle("Day 55: the capture list moves to startup", fontsize=15)
png = diagram_path("warm-capture-list.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** does the same three things in the same order, in `Worker`
#   (`vllm/v1/worker/gpu_worker.py`). `determine_available_memory` runs
#   `model_runner.profile_run()`, a forward over dummy inputs, to find peak memory, and sizes the
#   KV cache from what `gpu_memory_utilization` leaves; `compile_or_warm_up_model` then runs
#   `_dummy_run` for compile sizes outside the capture list and calls
#   `model_runner.capture_model()` unless `enforce_eager` is set (`--enforce-eager` on the
#   command line). `GPUModelRunner.capture_model` (`vllm/v1/worker/gpu_model_runner.py`)
#   records the large shapes first, so that the small ones reuse the pool the large ones
#   allocated, logs the time and the GiB it took (free memory before minus after), and then
#   calls `set_cudagraph_capturing_enabled(False)` so that any later capture is an error: the
#   stance our `check_no_cold_captures` takes as a gate.
# * Its list is one-dimensional. `CompilationConfig.cudagraph_capture_sizes`
#   (`vllm/config/compilation.py`) holds token counts; when unset it is generated as
#   `[1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_cudagraph_capture_size + 1, 16))`,
#   with `max_cudagraph_capture_size` defaulting to `min(max_num_seqs * 2, 512)`, and the
#   docstring gives startup time as the reason for the cap. With no width axis the list stays at
#   a few dozen graphs; our two axes make a product, which is why this notebook had to price
#   trimming at all.
# * vLLM's dummy batches are not empty the way ours are: `_dummy_run(num_tokens, ...)` spreads
#   the tokens over `num_reqs` made-up requests with real query lengths, and for full graphs
#   builds attention metadata from zeroed dummy block tables (`for_cudagraph_capture=True`).
#   **nano-vllm** (`nanovllm/engine/model_runner.py`) records from zeroed buffers as well:
#   `capture_cudagraph` allocates `slot_mapping`, `context_lens` and `block_tables` with
#   `torch.zeros`, so a capture stores its K/V at slot 0. That is harmless there because it
#   happens in `ModelRunner.__init__`, right after `warmup_model()` (a dummy prefill that
#   measures peak memory) and `allocate_kv_cache()`, before any request exists. Our warm batch
#   writes only the sink, which is what let section 3 warm over pools full of live-looking data
#   and find nothing changed. nano-vllm walks `reversed(self.graph_bs)`, biggest batch first,
#   and hands the first graph's `graph.pool()` to every later `torch.cuda.graph(...)`.
# * **SGLang**'s `CudaGraphRunner` (`python/sglang/srt/model_executor/cuda_graph_runner.py`)
#   builds its batch sizes in `get_batch_sizes_to_capture` (trimmed by `--cuda-graph-max-bs`),
#   captures them in reversed order for memory sharing through a module-level
#   `global_graph_memory_pool`, and its `can_run` sends larger batches down the eager path;
#   `--disable-cuda-graph` turns capture off.
#
# ## Try it
#
# 1. **Trim the list and predict what runs eagerly.** On a fresh
#    `smol_engine(bucket_decode=True, persist_inputs=True, capture_decode=True)`, call
#    `warm_decode(max_rows=4, max_width=64)` and serve the three prompts of section 3. Predict
#    first: the list is `warm_shapes(4, 128, 32, max_rows=4, max_width=64)`, 6 shapes; the
#    longest context reaches 69 on the last of the 31 decode steps, so the steps whose longest
#    context passes 64 need the `(4, 96)` shape the list lacks. The check: `report.graphs == 6`,
#    `runner.cold_captures == 0` (nothing is recorded after a warm-up) and
#    `runner.eager_steps == 5`, with tokens still equal to the plain engine's.
# 2. **Break the warm-up on purpose.** After `warm.cache.ensure_pools()`, copy the K pools
#    (`before = [k.clone() for k in warm.cache.k]`), build `plan = warmup_plan((4, 128), table,
#    inputs)`, aim one row at a real slot with `plan.write_slots[0] = 5`, and record it with
#    `runner.record(plan)`. The checks: `check_warm_writes_sink(plan, sink)` refuses the plan
#    ("warm rows [0] write outside the sink ..."), and after the recording
#    `check_warm_touches_nothing(before, warm.cache.k, sink)` names slot 5 of layer 0.
# 3. **Redo the fair comparison for another deployment.** For 4096-token requests arriving at
#    every row count up to 8, compute the lazy lifetime cost from `lazy_captures(4096, 128)`
#    and the four row buckets, and the startup cost of
#    `warm_shapes(256, 8192, 128, max_rows=8, max_width=4096)` with `warmup_seconds(..., 0.05)`.
#    The check: `math.isclose` says they are equal, 6.4 s each; then count how much of the full
#    list's 28.8 s such a deployment would spend on shapes it never uses.

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
# Day 54 recorded each decode graph on the first step that needed it, in front of the requests
# that were waiting on that step, and did so again every time the contexts grew into a new width
# bucket. Today the recordings move to startup: `nanoserve.warmup` drives one made-up batch
# per shape through the same runner before any request arrives.
#
# The whole question is what that made-up batch may be. A graph binds the addresses it was
# recorded with, so the batch has to go through the real slot table, the real input buffers and
# the real K/V pool, and it must not disturb any of them. The answer is a step whose rows are
# all padding (Day 52): context 0, K/V written to the sink slot.
#
# 1. `warmup_plan` and `warmup_batch`: what a warm batch is, tensor by tensor,
# 2. Day 54's six preconditions on it (they pass because there is nothing to check), and on a
#    warm plan built wrongly,
# 3. `Engine.warm_decode` on SmolLM2: the eight warm gates, tokens against eager, nothing cold,
# 4. the two address gates side by side, and what each one guards in bytes,
# 5. `days/day55/warmbench.py`: the cold column, startup against stall, and the budget,
# 6. the diagram.

# %%
import csv
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanoserve.buckets import check_pad_inert
from nanoserve.capture import check_addresses_stable, check_replay_rows
from nanoserve.config import EngineConfig
from nanoserve.course import REPO, diagram_path
from nanoserve.engine import Engine
from nanoserve.errors import GateError
from nanoserve.inputs import PersistentInputs
from nanoserve.model import load_model
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

torch.manual_seed(0)
MODEL_DIR = fetch_default_model()
t0 = time.perf_counter()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
print(f"SmolLM2-135M-Instruct, fp32, loaded in {time.perf_counter() - t0:.1f} s")


def smol_engine(**switches) -> Engine:
    cfg = EngineConfig(max_batch=4, max_model_len=128, kv_budget="32MiB", width_multiple=32, **switches)
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
# An engine with the Day 51-54 switches on, 4 rows and 128 tokens of context, width multiple 32:
# its closed shape set is rows {1, 2, 4} x widths {32, 64, 96, 128}, 12 shapes. `warmup_plan`
# builds the addressing of one shape over no sequences at all. There is no `plan_decode` behind
# it; `plan_decode` refuses an empty batch and says where to go instead:

# %%
warm = smol_engine(bucket_decode=True, persist_inputs=True, capture_decode=True)
runner, sink = warm.runner, warm.pool.sink_slot
try:
    plan_decode([], warm.config.block_size)
except ValueError as e:
    print("plan_decode([]):", e)
print("shape set:", warm_shapes(4, 128, 32))

# %% [markdown]
# The warm plan for the biggest shape, (4, 128). Every row is padding: token 0 at position 0,
# K/V written to the sink (one past the last slot any block maps), context 0 so attention sees
# nothing. The row tuple is empty.

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
# None of these tensors is new. Each is a window on storage a real decode step writes through:
# the slot window is the top-left corner of Day 51's slot table, the other four are the first
# rows of Day 53's persistent buffers. That is what lets a graph recorded on this plan compute
# real steps later: it will read whatever the next real step writes into the same storage.

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
# `warmup_batch` adds the cache bound to that plan (a `BatchedCacheRows` whose plan has no
# rows): the object the model writes its K/V to and reads attention from. Attention over it is
# exactly zero, because every row's context is empty.

# %%
warm.cache.ensure_pools()
plan, rows = warmup_batch((4, 128), runner.slot_table, runner.inputs, warm.cache)
q = torch.randn(4, model.cfg.num_heads, model.cfg.head_dim)
out = rows.attention(0, q)
print(type(rows).__name__, "bound to the warm plan:", rows.plan is plan, " attention:", tuple(out.shape))
print("attention output all zero:", bool((out == 0).all()))
assert (out == 0).all()

# %% [markdown]
# ## 2. Day 54's six preconditions, on a warm plan
#
# The same six gates, unchanged. Each passes, and none of them knows what a warm-up is: each
# loops over the plan's real rows, or compares them with something, and there are none.
# `check_replay_rows` is checked with a graph recorded from this warm plan against a real step:
# a graph that froze the empty tuple cannot be wrong about whose step it replays.

# %%
with torch.inference_mode():
    g = runner.record(plan)  # one graph, recorded from the warm plan
check_pad_inert(plan, sink)  # padded rows inert; "no real row writes the sink": no real rows
check_mapping_is_window(plan, table)  # () is a prefix of the table's owners
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
# Vacuous is not switched off. A warm plan built wrongly fails the same gates: one with a
# sequence in its row tuple (its one "real" row writes to the sink, and the table has no such
# owner), and one whose padded row writes into slot 0, which belongs to whichever sequence holds
# block 0. A warm plan's tensors are the persistent buffers, so the breakage is repaired by the
# next `warmup_plan`, which rewrites them.

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
# `Engine.warm_decode` allocates the K/V pools, builds the shape list (biggest first: every
# CUDA capture shares one memory pool, sized by its largest member), and records one graph per
# shape from a warm plan. To see that it touches nothing, the pools are first filled with
# seeded noise standing in for live sequences' K/V, and copied.

# %%
gen = torch.Generator().manual_seed(55)
with torch.inference_mode():
    for pool in warm.cache.k + warm.cache.v:
        pool.copy_(torch.randn(pool.shape, generator=gen))
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

# %% [markdown]
# The eight warm gates. Four are about the warm-up itself (no rows, writes only the sink, no
# real slot changed, the slot table did not move), two about the graphs (all from the warm-up,
# none recorded after it), two about the list (complete, and within a memory budget). The
# budget is probed the way a server would, as free host memory here, and the widest shape's
# attention scores (rows x heads x width fp32 numbers) must fit in it.

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
with torch.inference_mode():  # the noise out again, in place: the graphs' storage stays where it is
    for pool in warm.cache.k + warm.cache.v:
        pool.zero_()

# %% [markdown]
# Now serve. Three chat prompts through the warmed engine and through a plain one (no buckets,
# no persistent inputs, no capture). Every decode step of the warm engine is a replay; the
# wrapper checks each replay's frozen rows against the step's.

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
# And each of the eight failing on an input built the wrong way. The bound graphs and the cold
# captures come from a lazily capturing engine (Day 54's behaviour) on the tiny random model
# that `warmbench.py` uses.

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
    cfg = EngineConfig(
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
# ## 4. The two address gates
#
# Day 54's `check_addresses_stable` compares the addresses of the persistent input buffers.
# The slot table is read by the same graphs through a window, and nothing on Day 54 watched it;
# `SlotTable.to` always reallocates. `check_table_stable` is the second gate. What each guards,
# for this engine and at serving size (256 rows, 8192 tokens):


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
# The first gate cannot see the second one's failure. On a throwaway tiny engine: record a
# graph, move the slot table, and ask both.

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
# **The cold column.** The tiny random-weight model, 2 requests off one 16-token prompt, width
# multiple 32, `max_model_len` = prompt + generated but at least 64 (two width buckets, as
# in the seed's run). Lazily, a run records one graph per width bucket its contexts cross,
# which is `lazy_captures`; after `warm_decode`, none. (The warm list here is every shape up
# to `max_model_len`, both row buckets; the tokens of the two runs are asserted equal inside
# `cold_table`.)

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
for row in cold:
    print(f"generated {row['generated']:>3}: warmed {row['warm_graphs']:>2} graphs in {row['warm_ms']} ms")

# %% [markdown]
# **Startup against stall, at serving size.** 256 rows, 8192 tokens, width multiple 128: 9 row
# buckets x 64 width buckets = 576 shapes. Priced at 50 ms a recording (an assumed per-graph
# cost for a CUDA capture, not measured here), a lazily capturing server makes a request that
# generates 8192 tokens wait 64 recordings, 3.2 s in all. Warming the full list costs 28.8 s of
# startup; trimmed to 8 rows it is 12.8 s, and to 8 rows and 2048 tokens 3.2 s.

# %%
pricing = warmbench.pricing_table()
print(" | ".join(pricing[0]))
for row in pricing:
    print(" | ".join(str(v) for v in row.values()))
with open(warmbench.HERE / "day-55-pricing.csv") as f:
    assert [{k: str(v) for k, v in r.items()} for r in pricing] == list(csv.DictReader(f))
print(
    "shapes in the three lists:",
    [
        len(warm_shapes(256, 8192, 128, **kw))
        for kw in ({}, {"max_rows": 8}, {"max_rows": 8, "max_width": 2048})
    ],
)

# %% [markdown]
# **A budget is a width ceiling.** A decode step's attention scores are rows x heads x width
# fp32 numbers, and a shared pool is as big as its biggest member, so a memory budget does not
# shorten the list so much as cap its widest shape: `width_ceiling` inverts the product at 256
# rows and 32 heads, and `warm_shapes(max_width=...)` applies it.

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
    "five tensors that are windows on the real buffers, and an empty row tuple",
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
    ["check_mapping_is_window", "pass", "() is a prefix of the table's owners"],
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
ax.set_title("the two address gates side by side", fontsize=11)
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
ax.set_xlabel("tokens generated (2 rows off a 16-token prompt, width multiple 32)")
ax.set_ylabel("graphs recorded in front of a request")
ax.set_ylim(0, 7.5)
ax.set_title("warmbench: the cold column is lazy_captures, and 0 once warmed", fontsize=12)
ax.legend(loc="upper left", fontsize=9)

# right bottom: startup against stall, and the budget as a width ceiling
right = outer[1, 1].subgridspec(2, 1, height_ratios=[1.3, 1], hspace=0.6)
ax = fig.add_subplot(right[0])
lists = [
    ("full list, 576 shapes", float(pricing[0]["warm_full_s"])),
    ("rows <= 8: 256 shapes", float(pricing[0]["warm_rows8_s"])),
    ("rows <= 8, width <= 2048: 64 shapes", float(pricing[0]["warm_rows8_ctx2048_s"])),
]
ax.barh(range(3), [v for _, v in lists], color=["tab:purple", "tab:blue", "tab:cyan"])
for i, (name, v) in enumerate(lists):
    ax.text(v + 0.4, i, f"{name}: {v:.1f} s", va="center", fontsize=9)
for r, style in zip(pricing, (":", "-.", "--", "-")):
    label = f"lazy stall, {r['generated']} tokens: {r['stall_s']} s"
    ax.axvline(float(r["stall_s"]), color="tab:red", ls=style, lw=1.2, label=label)
ax.set_yticks([])
ax.set_ylim(4.3, -0.5)  # inverted, with a free row at the bottom for the legend
ax.set_xlim(0, 60)
ax.set_xlabel("seconds at 50 ms a graph (256 rows, 8192 tokens, width multiple 128)")
ax.set_title("startup cost of the list against one request's lazy stall", fontsize=11)
ax.legend(loc="lower right", fontsize=8, ncol=2)
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
ax.set_xlabel("graph pool budget (256 rows, 32 heads, fp32 scores)")
ax.set_ylabel("widest capture, tokens")
ax.set_title("the budget read as a width ceiling (dashed: max_model_len 8192)", fontsize=11)

fig.suptitle("Day 55: the capture list moves to startup", fontsize=15)
png = diagram_path("warm-capture-list.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))

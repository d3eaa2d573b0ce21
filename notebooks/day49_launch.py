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
# # Day 49 — Launch-bound decode: Python and per-op overhead
#
# Day 48 profiled one decode step of SmolLM2-135M and counted over two thousand aten ops called
# from Python per step, the same number at batch 1 and 8. Every one of them has a fixed price
# before any arithmetic happens: the Python call, argument parsing, the dispatcher, output
# allocation. On a GPU there is one more: the kernel launch, after which the GPU runs the kernel
# while the CPU prepares the next. When the kernels are shorter than the CPU's time to issue
# them, the GPU waits on the CPU and the step is *launch-bound*: it costs ops x price per op,
# not bytes / bandwidth.
#
# This CPU has no launches, but it has the same fixed price per op, paid in line with the
# arithmetic. Today shrinks the model under a fixed op count until the arithmetic is gone and
# only the price per op is left:
#
# 1. a ladder of models: SmolLM2-135M and three random-weight Llamas of the same family,
# 2. the benchmark (`days/day49/launchbench.py`): step time, op counts, the work floor,
# 3. counting the ops of a decode step: a fixed number per layer,
# 4. the gate: the same op sequence whatever the batch (and where that fails: prefill),
# 5. the price of one op, and the step as work plus ops,
# 6. the diagram.

# %%
import csv
import sys
import time
from collections import Counter

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path
from nanoserve.errors import GateError

sys.path.insert(0, str(REPO / "days" / "day49"))
import launchbench as lb  # the day's script: the notebook prints the table it writes

t0 = time.perf_counter()
models = {name: lb.make_model(name) for name in lb.SHAPES}
print(f"built {len(models)} models in {time.perf_counter() - t0:.1f} s; threads: {torch.get_num_threads()}")

# %% [markdown]
# ## 1. The ladder
#
# The default model with its weights, then three random-weight Llamas of the same shape family
# (grouped-query attention, SwiGLU MLP, tied head). The first three have 30 layers and so the
# same code path layer for layer; the last keeps the shapes of the third and has 4 layers.
# `mflop` is one decode step's matrix work for one row: 2 x the multiply-adds of every matrix.

# %%
print(
    f"{'model':14s}{'hidden':>7s}{'mlp':>6s}{'layers':>7s}{'heads':>7s}{'vocab':>7s}{'params':>13s}{'MB':>9s}{'MFLOP/row':>11s}"
)
for name, m in models.items():
    c = m.cfg
    params = sum(p.numel() for p in m.parameters())
    print(
        f"{name:14s}{c.hidden_size:7d}{c.intermediate_size:6d}{c.num_layers:7d}"
        f"{f'{c.num_heads}/{c.num_kv_heads}':>7s}{c.vocab_size:7d}{params:13,d}"
        f"{lb.weight_bytes(m) / 1e6:9.2f}{lb.step_flops(c, 1) / 1e6:11.2f}"
    )
assert sum(p.numel() for p in models[lb.DEFAULT].parameters()) == 134_515_008

# %% [markdown]
# ## 2. The benchmark
#
# `launchbench.bench` runs each model at each batch through an `Engine`: prefill, two warm-up
# decode steps, timed ones (the fastest is kept: on a shared machine the fastest is the one
# least disturbed), then one profiled decode step. `launchbench.profile_step` runs that step
# under `torch.profiler` with the runner's `execute` (the model's forward) wrapped in a label,
# and counts the aten ops called from Python in the whole step (`py_calls`), those inside the
# forward (`fwd_calls`: what a recorded graph would replay with one launch), and every aten op
# including the ones an op calls inside itself (`aten_calls`).
#
# Against each step, a floor: the least time its work could take on this CPU, its weights read
# once at the measured read bandwidth or its FLOPs at the measured matmul rate, whichever is
# slower (`Peaks.floor_s`). The notebook runs batch 1 and 8; the committed CSV adds batch 32.

# %%
# NBVAL_IGNORE_OUTPUT
peaks = lb.measure_peaks()
print(f"this CPU: read {peaks.gb_s:.1f} GB/s, fp32 matmul {peaks.gflop_s:.0f} GFLOP/s")

# %%
kept = {}
t0 = time.perf_counter()
rows = lb.bench(models, peaks, batches=(1, 8), steps=5, keep=kept, profiles=1)
print(f"{len(rows)} runs in {time.perf_counter() - t0:.1f} s")
facts = ["model", "batch", "params_m", "weight_mb", "mflop", "py_calls", "fwd_calls", "aten_calls"]
print(" | ".join(facts))
for r in rows:
    print(" | ".join(str(r[c]) for c in facts))
with open(lb.CSV) as f:
    committed = [r for r in csv.DictReader(f) if int(r["batch"]) in (1, 8)]
assert [[str(r[c]) for c in facts] for r in rows] == [[r[c] for c in facts] for r in committed], "rerun"

# %% [markdown]
# The times of this notebook's own run (nbval does not compare them). They are whatever the
# machine gave while the notebook ran: when other jobs share its two cores, a step can take many
# times what the CSV's quiet run took, and a small model can come out slower than a large one.
# Sections 5 and 6 read the CSV for that reason.

# %%
# NBVAL_IGNORE_OUTPUT
timing = ["step_ms", "op_ms", "floor_ms", "over_floor_pct", "us_per_call"]
print(f"{'model':14s}{'batch':>6s}" + "".join(f"{c:>16s}" for c in timing))
for r in rows:
    print(f"{r['model']:14s}{r['batch']:6d}" + "".join(f"{r[c]:16.2f}" for c in timing))

# %% [markdown]
# ## 3. Counting the ops of a decode step
#
# The three 30-layer models dispatch the same number of ops from Python at both batches (the
# `py_calls` column above), though their weights span 538 MB to 6 MB; the 4-layer model
# dispatches far fewer. Two counts of different depth give the rule: a fixed number per layer,
# plus a few for the embedding and the head, plus what the engine does outside the forward (the
# plan's tensors, the sampler).

# %%
a, b = kept["h64-l30", 1], kept["h64-l4", 1]
per_layer = (a.fwd_calls - b.fwd_calls) // 26
fixed = b.fwd_calls - 4 * per_layer
print(
    f"forward ops = {fixed} + {per_layer} x layers; outside the forward: {a.py_calls - a.fwd_calls} per step"
)
assert all(o.fwd_calls == fixed + per_layer * models[n].cfg.num_layers for (n, _), o in kept.items())
assert len({o.py_calls - o.fwd_calls for o in kept.values()}) == 1
assert len({r["py_calls"] for r in rows if r["layers"] == 30}) == 1  # every width, every batch

# %% [markdown]
# What one layer dispatches, by name (the difference of the two counts, over 26 layers): seven
# calls per matrix (`linear`'s slab split around one `bmm`), a paged attention of twenty calls,
# two norms, the rotation, the residual adds.

# %%
layer = Counter(a.forward_ops)
layer.subtract(Counter(b.forward_ops))
layer = {
    k.removeprefix("aten::"): v // 26 for k, v in sorted(layer.items(), key=lambda kv: (-kv[1], kv[0])) if v
}
print(layer)
assert sum(layer.values()) == per_layer

# %% [markdown]
# The nested count (`aten_calls`) is the one that moves with the batch: above batch 1 every
# matrix adds the 4 ops of a copy (the slabs `linear` computes no longer view back into rows, so
# its `reshape` copies; Day 48's table has it stage by stage).
#
# ## 4. The gate: the same ops, whatever the batch
#
# A CUDA graph (Days 50-55) records a step's kernels once and replays them with one launch.
# That only works if the step's op list does not depend on the data: `check_same_op_sequence`
# holds two forwards to the same ops in the same order. Every decode step of the 30-layer models
# passes it, across batch sizes and across widths: the shapes differ, the list does not.

# %%
ref = kept[lb.DEFAULT, 1].forward_ops
for (name, batch), ops in kept.items():
    if models[name].cfg.num_layers == 30:
        lb.check_same_op_sequence(ref, ops.forward_ops)
        print(
            f"decode {name} batch {batch}: {len(ops.forward_ops)} ops, "
            f"the same sequence as {lb.DEFAULT} batch 1"
        )

# %% [markdown]
# A prefill step fails it. The paged prefill (`BatchedPagedKVCache._prefill_attention`)
# attends row by row, each row's ragged chunk against its own window, so its op list grows with
# the number of rows: one recording could not replay a prefill of 2 prompts and one of 3. This
# is why graphs are for decode.

# %%
prefill = {}
for n_rows in (2, 3):
    eng = lb.build_engine(models["h64-l4"], n_rows)
    prefill[n_rows] = lb.profile_step(eng)  # a fresh engine's first step is its prefill
print("are the prefill steps decode steps:", [p.is_decode for p in prefill.values()])
print("prefill forward ops, 2 rows and 3 rows:", len(prefill[2].forward_ops), len(prefill[3].forward_ops))
try:
    lb.check_same_op_sequence(prefill[2].forward_ops, prefill[3].forward_ops)
    raised = False
except GateError as e:
    raised = True
    print("GateError:", e)
assert raised

# %% [markdown]
# ## 5. The price of one op
#
# Two measurements. The first calls `x + y` on two 64-element tensors in a Python loop: the
# arithmetic is 64 additions, so the time is what dispatching an op costs. The second is the
# engine's own: h64-l30 at batch 1 dispatches as many ops as the default model over 3 MFLOPs of
# work, so its step time less its floor, over its op count, is the price per op as the engine
# pays it (the plan, sampling and the Python between ops included).

# %%
# NBVAL_IGNORE_OUTPUT
x, y = torch.ones(64), torch.ones(64)
for _ in range(200):
    x + y
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(1000):
        x + y
    best = min(best, (time.perf_counter() - t0) / 1000)
print(f"x + y on 64 floats: {best * 1e6:.2f} µs a call")
tiny = next(r for r in rows if r["model"] == "h64-l30" and r["batch"] == 1)
price_ms = (tiny["step_ms"] - tiny["floor_ms"]) / tiny["py_calls"]
print(
    f"h64-l30, batch 1: {tiny['step_ms']:.2f} ms for {tiny['py_calls']} ops -> {price_ms * 1e3:.2f} µs an op"
)

# %% [markdown]
# A step's time as a sum of two prices: its work at the floor, and its ops at that price. Fitted
# on one row, the sum is a prediction for the others. Where the prediction falls short of the
# measured step, the kernels themselves run slower than the floor (batch 8 matmuls through
# `linear`'s slab path, the attention gather). Where the ops' price alone comes out above 100%
# of the step, the prediction is wrong the other way: that model's ops cost less than the price
# fitted on h64-l30.

# %%
# NBVAL_IGNORE_OUTPUT
over = []
for r in rows:
    ops_ms = r["py_calls"] * price_ms
    print(
        f"{r['model']:13s} batch {r['batch']}: measured {r['step_ms']:7.2f} ms; "
        f"floor {r['floor_ms']:6.2f} ms "
        f"+ ops {ops_ms:5.2f} ms = {r['floor_ms'] + ops_ms:6.2f} ms; the ops' price is "
        f"{100 * ops_ms / r['step_ms']:.0f}% of the step"
    )
    if ops_ms > r["step_ms"]:
        over.append(f"{r['model']} batch {r['batch']}")
print("priced above the whole step in this run:", ", ".join(over) or "none")

# %% [markdown]
# How a price per op can mislead. It is one number taken from one timing: the fastest of a
# few steps of h64-l30. Whatever slowed that step (another job's threads taking a core, say) is
# divided by its op count and charged to every op of every other model; and whatever slowed
# another model's step and not that one lands in the gap between prediction and measurement.
# An op does not have one price either: it depends on the op and on the size of its tensors,
# which is why the same 30 layers cost more per op at batch 8 than at batch 1.
#
# The committed CSV is the script's run on a quiet machine (ten timed steps per row instead of
# five; its `cpu` column names the CPU). Its batch-1 rows, each priced on its own, show where a
# step's time above its floor is the ops' price and where it is something else:

# %%
with open(lb.CSV) as f:
    script_rows = [r for r in csv.DictReader(f) if r["batch"] == "1"]
script_price = {
    r["model"]: (float(r["step_ms"]) - float(r["floor_ms"])) / int(r["py_calls"]) for r in script_rows
}
print(script_rows[0]["cpu"])
for r in script_rows:
    print(
        f"{r['model']:13s}: ({r['step_ms']} - {r['floor_ms']}) ms over {r['py_calls']} ops = "
        f"{script_price[r['model']] * 1e3:.1f} µs an op"
    )
ratio = script_price["h64-l4"] / script_price["h64-l30"]
print(f"h64-l4 against h64-l30 in the script's run: {ratio:.2f} of the price")

# %% [markdown]
# The same sum as above, step = floor + ops x price, now on every row of the CSV, with the price
# of its h64-l30 batch-1 row; then what the default model's floors say about that run's peaks,
# and what shrinking the weights bought at batch 1.

# %%
p30 = script_price["h64-l30"]
with open(lb.CSV) as f:
    all_rows = list(csv.DictReader(f))
for r in all_rows:
    step, floor, ops = float(r["step_ms"]), float(r["floor_ms"]), int(r["py_calls"]) * p30
    print(
        f"{r['model']:13s} batch {r['batch']:>2s}: {step:6.2f} ms; floor {floor:5.2f} + ops {ops:4.2f} "
        f"= {floor + ops:5.2f} ms, {step - floor - ops:5.2f} ms left; the ops are {100 * ops / step:3.0f}%"
    )
big = {r["batch"]: r for r in all_rows if r["model"] == lb.DEFAULT}
print(
    f"{lb.DEFAULT} floors: {float(big['1']['weight_mb']) / float(big['1']['floor_ms']):.1f} GB/s read "
    f"(batch 1), {float(big['32']['mflop']) / float(big['32']['floor_ms']):.0f} GFLOP/s (batch 32)"
)
small = next(r for r in script_rows if r["model"] == "h64-l30")
print(
    f"{lb.DEFAULT} to h64-l30, batch 1: {float(big['1']['weight_mb']) / float(small['weight_mb']):.0f} "
    f"times less weight, a step {float(big['1']['step_ms']) / float(small['step_ms']):.1f} times shorter"
)

# %% [markdown]
# ## 6. The diagram
#
# Drawn from the committed CSV (batch 1 and 8), the script's quiet run, with the per-op price
# of its h64-l30 row; this notebook's own times move with whatever else the machine is running.

# %%
fig, axes = plt.subplots(2, 2, figsize=(14, 10.5))
names = list(models)
colors = dict(zip(names, ["tab:blue", "tab:orange", "tab:green", "tab:red"]))
ints = {"hidden", "layers", "vocab", "batch", "py_calls", "fwd_calls", "aten_calls"}
with open(lb.CSV) as f:  # the script's run: every time in the diagram is the CSV's
    csv_rows = [
        {k: v if k in ("model", "cpu") else int(v) if k in ints else float(v) for k, v in r.items()}
        for r in csv.DictReader(f)
    ]
by = {(r["model"], r["batch"]): r for r in csv_rows}
csv_price_ms = script_price["h64-l30"]  # (step - floor) / py_calls of h64-l30, batch 1, in the CSV

ax = axes[0, 0]
for batch, marker in ((1, "o"), (8, "s")):
    rs = [by[n, batch] for n in names]
    ax.plot(
        [r["weight_mb"] for r in rs],
        [r["step_ms"] for r in rs],
        marker + "-",
        label=f"measured, batch {batch}",
    )
    ax.plot([r["weight_mb"] for r in rs], [r["floor_ms"] for r in rs], marker + ":", color="gray", alpha=0.7)
for n in names:
    r = by[n, 1]
    ax.annotate(n, (r["weight_mb"], r["step_ms"]), fontsize=8, xytext=(5, 5), textcoords="offset points")
r30 = by["h64-l30", 1]
ax.axhline(
    r30["py_calls"] * csv_price_ms,
    color="tab:purple",
    ls="--",
    lw=1,
    label=f"{r30['py_calls']} ops x {csv_price_ms * 1e3:.1f} µs",
)
ax.plot([], [], "k:", label="work floor (bytes or FLOPs)")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("weights read per step (MB, log)")
ax.set_ylabel("decode step (ms, log)")
ax.set_title("Shrinking the model: step time stops falling at the ops' price")
ax.legend(fontsize=8, loc="lower right")

ax = axes[0, 1]
for i, n in enumerate(names):
    r = by[n, 1]
    ops_ms = r["py_calls"] * csv_price_ms
    work = min(r["floor_ms"], r["step_ms"])
    rest = max(r["step_ms"] - work - ops_ms, 0.0)
    ax.barh(i, work, color="tab:blue", label="work floor" if i == 0 else None)
    ax.barh(
        i,
        min(ops_ms, r["step_ms"] - work),
        left=work,
        color="tab:orange",
        label="ops x price per op" if i == 0 else None,
    )
    ax.barh(
        i, rest, left=work + ops_ms, color="tab:gray", label="the rest (slower kernels)" if i == 0 else None
    )
    ax.text(r["step_ms"] * 1.02, i, f"{r['step_ms']:.1f} ms, {r['py_calls']} ops", va="center", fontsize=8)
ax.set_yticks(range(len(names)), names)
ax.invert_yaxis()
ax.set_xlim(0, max(by[n, 1]["step_ms"] for n in names) * 1.45)
ax.set_xlabel("ms per decode step, batch 1")
ax.set_title("Batch 1: what the step time is made of")
ax.legend(fontsize=8, loc="lower right")

ax = axes[1, 0]
xs = range(len(names))
fwd = [by[n, 8]["fwd_calls"] for n in names]
outside = [by[n, 8]["py_calls"] - by[n, 8]["fwd_calls"] for n in names]
nested = [by[n, 8]["aten_calls"] for n in names]
ax.bar([x - 0.2 for x in xs], fwd, 0.4, color="tab:blue", label="called from Python: in the forward")
ax.bar(
    [x - 0.2 for x in xs],
    outside,
    0.4,
    bottom=fwd,
    color="tab:orange",
    label="called from Python: plan, sample",
)
ax.bar([x + 0.2 for x in xs], nested, 0.4, color="tab:gray", label="every aten op, nested included")
for x, n in zip(xs, names):
    r = by[n, 8]
    ax.text(x - 0.2, r["py_calls"] + 80, str(r["py_calls"]), ha="center", fontsize=8)
    ax.text(x + 0.2, r["aten_calls"] + 80, str(r["aten_calls"]), ha="center", fontsize=8)
ax.set_xticks(list(xs), [f"{n}\n{by[n, 8]['layers']} layers" for n in names])
ax.set_ylabel("aten ops in one decode step (batch 8)")
ax.set_title(f"Ops per step: {fixed} + {per_layer} x layers in the forward, whatever the width")
ax.legend(fontsize=8, loc="upper right")
ax.set_ylim(0, max(nested) * 1.25)

ax = axes[1, 1]
for n in names:
    rs = [by[n, b] for b in (1, 8)]
    ax.plot([1, 8], [r["step_ms"] / r["batch"] for r in rs], "o-", color=colors[n], label=n)
ops30 = by["h64-l30", 1]["py_calls"] * csv_price_ms
ax.plot(
    [1, 8],
    [ops30, ops30 / 8],
    "k--",
    lw=1,
    label=f"{by['h64-l30', 1]['py_calls']} ops x {csv_price_ms * 1e3:.1f} µs, shared by the rows",
)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks([1, 8], ["1", "8"])
ax.set_xlabel("batch (rows per step)")
ax.set_ylabel("ms per generated token (step / batch, log)")
ax.set_title("Batching shares the ops' price among the rows")
ax.set_ylim(top=ax.get_ylim()[1] * 8)  # room above the lines for the legend
ax.legend(fontsize=8, loc="upper right")

fig.suptitle(
    "Day 49: decode on a shrinking Llama, fp32, 2 threads on an AVX-512 CPU (the script's run, the CSV):"
    " the price per op sets the floor",
    fontsize=13,
)
fig.tight_layout()
png = diagram_path("day49-launch.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** has a switch for exactly today's cost: `--enforce-eager` (`enforce_eager` in its
#   model config, off by default) runs every step eagerly, one launch per op, instead of
#   replaying CUDA graphs; newer versions document that it turns off `torch.compile` as well.
#   A run with it against a run without it is vLLM's version of this day's measurement. Its
#   older runner (`execute_model` in `vllm/worker/model_runner.py`) says in a comment that CUDA
#   graphs are only supported for decode and sends a step with any prefill to the eager model,
#   the conclusion of section 4; decode batches are padded up to a captured size
#   (`_get_graph_batch_size`: 1, 2, 4, then multiples of 8).
# * **nano-vllm** has the same switch, `enforce_eager` in `nanovllm/config.py`: its
#   `ModelRunner.run_model` runs the model eagerly for a prefill, when `enforce_eager` is set,
#   or for more than 512 rows, and replays a graph otherwise. Its `example.py` runs eager and its
#   `bench.py` runs with graphs.
# * **llama.cpp** runs no Python per op. `llm_graph_context` (`src/llama-graph.cpp`) builds a
#   step as a `ggml_cgraph`, a list of nodes (`build_lora_mm` adds a `ggml_mul_mat`,
#   `build_ffn` the MLP's nodes, and reshapes and views are nodes too, `ggml_reshape_3d`,
#   `ggml_view_3d`), and a backend walks that list in C++. Views stay in the list as nodes with
#   no kernel of their own; the CUDA backend's graph code passes over them with
#   `ggml_cuda_is_view_or_noop` (reshape, transpose, view, permute, none), the counterpart of
#   our 46 view ops per layer, which a GPU would not launch either.
#   Building the list is itself a per-step cost, so `llm_graph_result::can_reuse` keeps the
#   previous step's graph when its inputs still fit the new batch (for attention, the same
#   number of tokens, `self_k_idxs->ne[0] == ubatch.n_tokens`): a shape check in the role of
#   our `check_same_op_sequence`.
#
# ## Try it
#
# 1. **Predict a model's op count.** Add a fifth rung with 8 layers,
#    `lb.SHAPES["h64-l8"] = lb._family(64, 192, 8, 4, 2, 16, 512)`, and measure it at batch 1:
#    `r = lb.measure(lb.make_model("h64-l8"), "h64-l8", 1, peaks, keep=kept)`. Before running,
#    write down `fixed + per_layer * 8` and that plus the ops outside the forward. Check:
#    `assert kept["h64-l8", 1].fwd_calls == fixed + 8 * per_layer` and
#    `r["py_calls"] == fixed + 8 * per_layer + (a.py_calls - a.fwd_calls)`.
# 2. **Break the count on purpose.** Put `torch.set_num_threads(1)` in the first cell and
#    re-run. `linear` then skips its slab split (one `F.linear` call per matrix instead of 7),
#    so predict each 30-layer model's `py_calls`: 6 x 121 matrices fewer. Check: the assert
#    against the committed CSV in section 2 fails with `rerun`, and
#    `kept[lb.DEFAULT, 1].py_calls` is the CSV's `py_calls` less 6 calls for each of the 121 matrices.
# 3. **Price an op from two depths.** The one-row price of section 5 charges every op with
#    whatever else was in that row. Fit it instead from the two h64 models, whose layers are
#    identical: `(step - floor)` of h64-l30 less that of h64-l4, over the difference in
#    `py_calls`. Check: on the committed CSV's batch-1 rows the two estimates agree to within
#    a few percent; on this run's `rows`, if they differ by more than a third, one of the two
#    timings was disturbed: re-run `lb.bench` for those two models and watch them converge.

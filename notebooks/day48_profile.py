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
# # Day 48 — Profiling one decode step
#
# Phase 5 starts by looking before optimizing. The engine of Day 47 decodes; today the question
# is where the milliseconds of one decode step go, on the default model (SmolLM2-135M, fp32) on
# this CPU. Day 12 priced a step by the bytes it must read; today `torch.profiler` says what
# actually runs.
#
# 1. what a step must read: every weight once, 538 MB,
# 2. one decode step through the engine, and its plan,
# 3. the profiler's raw view: aten ops by self time,
# 4. from ops to stages: labels around the package's functions, and two gates,
# 5. the stage table at batch 1 and batch 8 (`days/day48/profile_step.py`),
# 6. bytes against time: the bandwidth each matrix achieves,
# 7. the diagram.
#
# Counts (ops per step, bytes, FLOPs) are facts of the code path and are compared when this
# notebook is re-run. Times are of two kinds. The CSV's were written by the script on a quiet
# machine, whose `cpu` column names it; section 6 prints what they add up to. The notebook's own
# are measured live whenever it runs, in cells marked as measurement only, and on a machine that
# other jobs are sharing they can be many times the CSV's.

# %%
import csv
import sys
import time
import warnings

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path
from nanoserve.bench import read_bandwidth_gbs
from nanoserve.errors import GateError
from nanoserve.models import load_model
from nanoserve.weights import fetch_default_model

warnings.filterwarnings("ignore", message=".*record_function.*")
sys.path.insert(0, str(REPO / "days" / "day48"))
import profile_step as ps  # the day's script: the notebook prints the table it writes

t0 = time.perf_counter()
model = load_model(fetch_default_model())  # nanoserve.models.Llama, fp32, CPU
print(f"loaded in {time.perf_counter() - t0:.1f} s; threads: {torch.get_num_threads()}")
cfg = model.cfg

# %% [markdown]
# ## 1. What one decode step must read
#
# A decode step computes one token per row, and every row multiplies by every matrix of the
# model, so every weight byte is read once per step however many rows there are. The head is
# the embedding (tied): the embedding table is read whole by the head, and only a few rows of it
# by the input gather. At batch 1 the step is a sequence of matrix-vector products, which do two
# FLOPs per four-byte weight: nowhere near what the cores can compute, so the floor is the time
# to stream 538 MB.

# %%
mats = {
    "qkv_proj": (cfg.num_layers, model.blocks[0].qkv),
    "o_proj": (cfg.num_layers, model.blocks[0].o),
    "mlp_gate_up": (cfg.num_layers, model.blocks[0].gate_up),
    "mlp_down": (cfg.num_layers, model.blocks[0].down),
    "head": (1, model.head),
}
for name, (n, w) in mats.items():
    print(f"{name:12s} {n:2d} x {str(tuple(w.shape)):13s} = {n * w.numel() * 4 / 1e6:7.2f} MB")
norm_bytes = (2 * cfg.num_layers + 1) * cfg.hidden_size * 4
total = ps.weight_bytes(model)
print(f"norms        {2 * cfg.num_layers + 1} x (576,)       = {norm_bytes / 1e6:7.2f} MB")
print(f"every weight, once: {total:,} bytes")
assert total == 134_515_008 * 4 == sum(n * w.numel() * 4 for n, w in mats.values()) + norm_bytes

# %% [markdown]
# The read bandwidth torch gets on this machine (the best of a few sums over 256 MB) turns those
# bytes into a floor for the step. Section 6 also needs what the cores compute at best, so the
# same cell times a square 1024 x 1024 fp32 matmul (best of five). Both are this run's numbers
# on a shared machine.

# %%
# NBVAL_IGNORE_OUTPUT
bandwidth = read_bandwidth_gbs(256)
print(f"read bandwidth {bandwidth:.1f} GB/s -> streaming the weights takes {total / bandwidth / 1e6:.1f} ms")
sq_a, sq_b = torch.randn(1024, 1024), torch.randn(1024, 1024)
sq_a @ sq_b
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    sq_a @ sq_b
    best = min(best, time.perf_counter() - t0)
matmul_gflop_s = 2 * 1024**3 / best / 1e9
print(f"fp32 matmul 1024 x 1024: {matmul_gflop_s:.0f} GFLOP/s")

# %% [markdown]
# ## 2. One decode step through the engine
#
# `profile_step.build_engine` gives an `Engine` 8 requests of 16 random tokens each; one step
# prefills them all (128 tokens fit the step's budget), and from then on every step is a decode
# step: 8 rows, one new token each. Its plan is what `ModelRunner.execute` runs: the newest token
# and its position per row, the slot each row's K/V goes to, and a (rows, W) slot window the
# attention gathers from; W is 32 (two blocks of 16) from position 16 to 31.

# %%
engine = ps.build_engine(model, 8)
engine.step()  # prefill
batch = engine.scheduler.schedule()
plan = engine.runner.plan(batch)
print("decode step:", plan.is_decode, "| rows:", len(plan.rows))
print("input_ids:", tuple(plan.input_ids.shape), "positions:", plan.positions.tolist())
print("write_slots:", plan.write_slots.tolist())
print("slot_window:", tuple(plan.slot_window.shape), "context_lens:", plan.context_lens.tolist())
logits = engine.runner.execute(plan)
print("logits:", tuple(logits.shape), logits.dtype)
assert plan.is_decode and tuple(plan.slot_window.shape) == (8, 32)

# %% [markdown]
# That took the step apart by hand; below, `engine.step()` runs it whole. A fresh engine
# replays the same prompts (the generator is seeded), so its steps are the same steps.
#
# ## 3. The profiler's raw view
#
# `torch.profiler` records every aten op the step dispatches, with its self time (its own time,
# less the ops it calls). Here is one decode step at batch 8, without any labels:

# %%
engine = ps.build_engine(model, 8)
for _ in range(3):  # the prefill, then two decode steps to warm up
    engine.step()
ps.warm_profiler()
with ps.cpu_profile() as prof:  # torch.profiler.profile(activities=[ProfilerActivity.CPU])
    engine.step()
events = [e for e in prof.events() if e.name.startswith("aten::")]
from_python = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
count = {}
for e in events:
    count[e.name] = count.get(e.name, 0) + 1
print(f"aten ops in one decode step: {len(events):,}, of which {len(from_python):,} called from Python")
for name in (
    "aten::bmm",
    "aten::index_select",
    "aten::scaled_dot_product_attention",
    "aten::rms_norm",
    "aten::as_strided",
    "aten::transpose",
    "aten::view",
):
    print(f"  {name:36s} {count[name]:5,d} calls")
# every block runs four matrices, two norms, one attention; plus the head and the final norm
assert count["aten::bmm"] == 4 * cfg.num_layers + 1 and count["aten::rms_norm"] == 2 * cfg.num_layers + 1
assert count["aten::index_select"] == 2 * cfg.num_layers  # the K and the V gather of each layer

# %% [markdown]
# Sorted by self time, the table below is this run's measurement (it varies with the machine's
# load, so nbval does not compare it). `bmm`, the matrices, comes first with the largest share
# of the op self time. Below it are the K/V gather (`index_select`), the attention kernel and the
# copies, then a long tail of small calls, many of them the views counted above, most too short
# to reach the twelve rows shown. How large the second and third rows are depends on the load:
# an op that has to wait for a core is charged the wait.

# %%
# NBVAL_IGNORE_OUTPUT
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=44))

# %% [markdown]
# ## 4. From ops to stages
#
# An op's name does not say which part of the model called it: `bmm` is the QKV projection, the
# output projection, both MLP matrices and the head. `profile_step.stage_labels` wraps the
# package's own functions (`model.linear`, `rms_norm`, `apply_rope`, the cache's `write` and
# `attention`, the block and model forwards, the sampler, the scheduler, the planner) in
# `torch.profiler.record_function` labels for the duration of the profile, and each op belongs to
# its nearest label. `linear` learns which matrix it was given by the weight's identity, from a
# stage map:

# %%
names = ps.matrix_stages(model)
print("matrices in the stage map:", len(names), "=", 4, "x", cfg.num_layers, "+ the head")
print("stages of a step:", ", ".join(ps.STAGES))
ps.check_weights_accounted(model, names)
print("check_weights_accounted: every weight byte belongs to a stage")

# %% [markdown]
# Two gates guard the profile. `check_weights_accounted`: the stage map plus the norms cover
# every weight byte; a map built by walking the model's named parameters, say, never sees the
# head, because the tied head is the embedding and `named_parameters` lists a shared tensor
# once, under its first name. The 113 MB matrix that is read every step would then sit under
# `unlabelled_matrix`:

# %%
walked = {}
for pname, p in model.named_parameters():
    for key, stage in (
        ("qkv", "qkv_proj"),
        (".o", "o_proj"),
        ("gate_up", "mlp_gate_up"),
        ("down", "mlp_down"),
    ):
        if pname.endswith(key):
            walked[id(p)] = stage
    if pname == "head":
        walked[id(p)] = "head"
print("parameters named 'head' in named_parameters():", sum(n == "head" for n, _ in model.named_parameters()))
try:
    ps.check_weights_accounted(model, walked)
    raised = False
except GateError as e:
    raised = True
    print("GateError:", e)
assert raised

# %% [markdown]
# `check_decode_only`: every profiled step was a decode step. Profiling a fresh engine's first
# step profiles its prefill (16 tokens a row, a per-row attention loop), which is another
# workload altogether:

# %%
fresh = ps.build_engine(model, 1)
wrong = ps.profile_steps(fresh, 1, timed_first=False)  # no step taken first: this is the prefill
try:
    ps.check_decode_only(wrong)
    raised = False
except GateError as e:
    raised = True
    print("GateError:", e)
assert raised

# %% [markdown]
# ## 5. The stage table
#
# `profile_step.profile_decode(model, batch, steps)` builds the engine, prefills, takes two
# decode steps, then profiles `steps` more with the labels on. Per stage: the aten ops it calls
# from Python (`py_calls`) and all of them, nested included (`aten_calls`), the three busiest by
# count, and the MFLOPs and MB the step's arithmetic says it does and reads. The counts are per
# step, and the same on every run.

# %%
profiles = {}
for b in ps.BATCHES:
    profiles[b] = ps.profile_decode(model, b, steps=2, names=names)
    ps.check_decode_only(profiles[b])
table = [r for b in ps.BATCHES for r in ps.rows(profiles[b], cfg)]  # one row per (batch, stage)
wide = ps.table(profiles, cfg)  # the CSV's shape: one row per stage, a column per batch
facts = ["stage", "ops", "py_calls"] + [
    f"{c}_b{b}" for c in ("aten_calls", "mflop", "mb_read") for b in ps.BATCHES
]
print(" | ".join(facts))
for r in wide:
    print(" | ".join(str(r[c]) for c in facts))
with open(ps.CSV) as f:
    committed = list(csv.DictReader(f))
assert [[str(r[c]) for c in facts] for r in wide] == [[r[c] for c in facts] for r in committed], "rerun"
for b in ps.BATCHES:
    s = ps.summary(profiles[b])
    print(f"batch {b}: {s['py_calls']:,} aten ops called from Python a step, {s['aten_calls']:,} in all")

# %% [markdown]
# What the counts say, before any clock (the asserts below hold them):
#
# * A step calls the same number of aten ops from Python at batch 1 and 8, and about three
#   times as many in all. RMSNorm is one call from Python and 24 inside it (61 norms); a paged
#   attention is 20 calls per layer (the gather, the mask, SDPA, the zeroing of empty rows).
# * Each matrix is 7 calls from Python: `linear` splits the weight into one slab per thread and
#   runs one `bmm`, then views the slabs back together. At batch 8 that last reshape has to copy
#   (the rows are no longer one contiguous line), which adds 4 nested ops per matrix.
# * Every matrix stage reads the same MB at batch 1 and 8 and does 8 times the FLOPs.

# %%
by_stage = {r["stage"]: r for r in wide}
L = cfg.num_layers
matrices = {"qkv_proj": L, "o_proj": L, "mlp_gate_up": L, "mlp_down": L, "head": 1}
assert by_stage["norm"]["py_calls"] == 2 * L + 1 and by_stage["norm"]["aten_calls_b1"] == 24 * (2 * L + 1)
assert by_stage["attention"]["py_calls"] == 20 * L
for stage, n in matrices.items():
    r = by_stage[stage]
    assert r["py_calls"] == 7 * n and r["aten_calls_b8"] - r["aten_calls_b1"] == 4 * n
    assert r["mb_read_b1"] == r["mb_read_b8"] and abs(r["mflop_b8"] - 8 * r["mflop_b1"]) < 1
print("per norm 24 nested ops, per layer 20 attention calls, per matrix 7 calls (+4 at batch 8): as stated")
#
# The times (measured; they differ from run to run):

# %%
# NBVAL_IGNORE_OUTPUT
timing = ["op_ms", "ms", "share", "gb_s"]
print(f"{'stage':13s}" + "".join(f"{f'{c} b={b}':>13s}" for b in ps.BATCHES for c in ("ms", "share")))
for s in ps.STAGES:
    by_b = {r["batch"]: r for r in table if r["stage"] == s}
    print(f"{s:13s}" + "".join(f"{by_b[b]['ms']:13.2f}{by_b[b]['share']:12.1f}%" for b in ps.BATCHES))
for b in ps.BATCHES:
    s = ps.summary(profiles[b])
    print(
        f"batch {b}: wall {s['wall_ms']:.1f} ms a step under the profiler "
        f"({s['plain_wall_ms']:.1f} ms without); "
        f"aten op self time {s['op_ms']:.1f} ms; everything else {s['python_ms']:.1f} ms"
    )

# %% [markdown]
# ## 6. Bytes against time
#
# For the five matrix stages the step's arithmetic gives the bytes read; divided by the stage's
# time, that is the bandwidth each achieves, to set against the read bandwidth measured above.
# At batch 1 a matrix stage is a stream of weights through the cores; at batch 8 the same bytes
# carry 8 times the FLOPs, so each batch's last line also sets the matrices' FLOP rate against
# the square matmul timed in section 1. A stage well below both the read bandwidth and that
# rate is limited by neither: it is losing time somewhere else.

# %%
# NBVAL_IGNORE_OUTPUT
for b in ps.BATCHES:
    rs = [r for r in table if r["batch"] == b and r["stage"] in ps.MATRIX_STAGES]
    mb = sum(r["mb_read"] for r in rs)
    ms = sum(r["ms"] for r in rs)
    wall = ps.summary(profiles[b])["wall_ms"]
    print(
        f"batch {b}: matrices read {mb:.0f} MB in {ms:.1f} ms = {mb / ms:.1f} GB/s "
        f"({100 * mb / ms / bandwidth:.0f}% of the {bandwidth:.1f} GB/s read bandwidth); "
        f"the whole step {total / 1e6 / wall:.1f} GB/s"
    )
    for r in rs:
        print(f"    {r['stage']:12s} {r['mb_read']:7.2f} MB  {r['ms']:6.2f} ms  {r['gb_s']:5.1f} GB/s")
    gflop = sum(r["mflop"] for r in rs) / 1e3
    print(
        f"  the matrices did {gflop:.2f} GFLOP: {gflop / ms * 1e3:.0f} GFLOP/s, against "
        f"{matmul_gflop_s:.0f} GFLOP/s for the square 1024 matmul above"
    )

# %% [markdown]
# Those are this notebook's times. The CSV's, written by the script on the quiet machine its
# `cpu` column names, add up as follows: per batch, the profiled step (every stage), the five
# matrices together, and one RMSNorm.

# %%
print(committed[0]["cpu"])
for b in ps.BATCHES:
    step_ms = sum(float(r[f"ms_b{b}"]) for r in committed)
    mat = [r for r in committed if r["stage"] in ps.MATRIX_STAGES]
    mat_ms = sum(float(r[f"ms_b{b}"]) for r in mat)
    mat_mb = sum(float(r[f"mb_read_b{b}"]) for r in mat)
    mat_gflop = sum(float(r[f"mflop_b{b}"]) for r in mat) / 1e3
    norm_us = 1e3 * float(next(r for r in committed if r["stage"] == "norm")[f"ms_b{b}"]) / (2 * L + 1)
    print(
        f"CSV batch {b}: step {step_ms:.2f} ms profiled; matrices {mat_mb:.1f} MB in {mat_ms:.2f} ms "
        f"({100 * mat_ms / step_ms:.0f}% of the step) = {mat_mb / mat_ms:.1f} GB/s, "
        f"{mat_gflop / mat_ms * 1e3:.0f} GFLOP/s; one norm {norm_us:.1f} µs"
    )
csv_step = {b: sum(float(r[f"ms_b{b}"]) for r in committed) for b in ps.BATCHES}
print(f"CSV: batch 8's step, 8 tokens, takes {csv_step[8] / csv_step[1]:.2f} times batch 1's, 1 token")

# %%
mb_b1 = {r["stage"]: r["mb_read"] for r in table if r["batch"] == 1 and r["stage"] in ps.MATRIX_STAGES}
mb_b8 = {r["stage"]: r["mb_read"] for r in table if r["batch"] == 8 and r["stage"] in ps.MATRIX_STAGES}
print("matrix MB read per step, batch 1 == batch 8:", mb_b1 == mb_b8, f"({sum(mb_b1.values()):.1f} MB)")
print("weight bytes not in a matrix stage (norms):", total - round(sum(mb_b1.values()) * 1e6))
assert mb_b1 == mb_b8

# %% [markdown]
# ## 7. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(14, 10.5))
b8 = {r["stage"]: r for r in table if r["batch"] == 8}
p8 = profiles[8]

ax = axes[0, 0]
stages = list(ps.STAGES)
op = [p8.op_us[s] / 1e3 / p8.steps for s in stages]
py = [max(b8[s]["ms"] - o, 0.0) for s, o in zip(stages, op)]
ys = range(len(stages))
ax.barh(ys, op, color="tab:blue", label="aten op self time")
ax.barh(ys, py, left=op, color="tab:orange", label="Python between ops (label self time)")
ax.set_yticks(list(ys), stages)
ax.invert_yaxis()
ax.set_xlabel("ms per decode step")
wall8 = ps.summary(p8)["wall_ms"]
ax.set_title(f"Batch 8, this notebook's run: time per stage ({wall8:.0f} ms step, profiled)")
ax.legend(loc="lower right", fontsize=8)

ax = axes[0, 1]
top = sorted(p8.op_self_us.items(), key=lambda kv: -kv[1])[:12]
ax.barh(range(len(top)), [us / 1e3 / p8.steps for _, us in top], color="tab:purple")
short = lambda n: n.removeprefix("aten::").replace(
    "_scaled_dot_product_flash_attention_for_cpu", "sdpa (flash, cpu)"
)  # noqa: E731
ax.set_yticks(range(len(top)), [f"{short(n)} ({p8.op_count[n] // p8.steps})" for n, _ in top])
ax.invert_yaxis()
ax.set_xlabel("self CPU ms per decode step")
ax.set_title("Batch 8, this notebook's run: aten ops by self time (calls per step)")

# the bottom panels draw the script's run (the CSV, a quiet machine), against the read bandwidth
# Day 12's roofline measured on the same machine (fp32, 2 threads); the top ones this notebook's
with open(REPO / "days" / "day12" / "day-12-roofline.csv") as f:
    day12_gb_s = next(
        float(r["bandwidth_gb_s"])
        for r in csv.DictReader(f)
        if r["dtype"] == "float32" and r["threads"] == "2"
    )
csv_ms = {(r["stage"], b): float(r[f"ms_b{b}"]) for r in committed for b in ps.BATCHES}
csv_mb = {(r["stage"], b): float(r[f"mb_read_b{b}"]) for r in committed for b in ps.BATCHES}

ax = axes[1, 0]
colors = {1: "tab:green", 8: "tab:red"}
for b in ps.BATCHES:
    ss = ps.BANDWIDTH_STAGES
    xy = ([csv_mb[s, b] for s in ss], [csv_ms[s, b] for s in ss])
    ax.scatter(*xy, color=colors[b], s=40, label=f"batch {b}")
    for s in ss:  # mlp_down and head sit close together: one label on each side
        left = s == "mlp_down"
        at, off = (csv_mb[s, b], csv_ms[s, b]), (-4 if left else 4, 2)
        ax.annotate(s, at, fontsize=7, xytext=off, textcoords="offset points", ha="right" if left else "left")
xs = [1, 300]
ax.plot(xs, [x / day12_gb_s for x in xs], "k--", lw=1, label=f"read bandwidth, Day 12: {day12_gb_s:.1f} GB/s")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("MB read per step (weights; K/V for attention)")
ax.set_ylim(bottom=0.5)
ax.set_ylabel("ms per step (the script's run, CSV)")
ax.set_title("Bytes against time (CSV): above the line is slower than streaming")
ax.legend(fontsize=8)

ax = axes[1, 1]
groups = {
    "matrices": ps.MATRIX_STAGES,
    "attention + K/V write": ("attention", "kv_write"),
    "norm, rope, act, glue, embed": ("norm", "rope", "mlp_act", "block_glue", "embed"),
    "engine: schedule, plan, sample, append, other": (
        "schedule",
        "plan",
        "sampling",
        "append",
        "engine_other",
    ),
}
gcolors = ["tab:blue", "tab:red", "tab:gray", "tab:orange"]
for i, b in enumerate(ps.BATCHES):
    left = 0.0
    step_ms = sum(csv_ms[s, b] for s in ps.STAGES)
    for (g, members), c in zip(groups.items(), gcolors):
        w = sum(csv_ms[s, b] for s in members)
        ax.barh(i, w, left=left, color=c, label=g if i == 0 else None)
        if w > 0.06 * step_ms:
            ax.text(left + w / 2, i, f"{w:.1f}", ha="center", va="center", fontsize=9, color="white")
        left += w
ax.set_yticks(range(len(ps.BATCHES)), [f"batch {b}" for b in ps.BATCHES])
ax.set_xlabel("ms per decode step, profiled (the script's run, CSV)")
ax.set_title("Batch 1 against batch 8 (CSV): the same bytes, 8 tokens")
ax.legend(fontsize=8, loc="upper right")
ax.set_ylim(-0.6, len(ps.BATCHES) + 0.9)

fig.suptitle(
    "Day 48: one decode step of SmolLM2-135M (fp32, 2 threads, AVX-512 CPU) under torch.profiler\n"
    "top: this notebook's run; bottom: the script's run (the CSV)",
    fontsize=14,
)
fig.tight_layout(rect=(0, 0, 1, 0.96))
png = diagram_path("day48-profile.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** profiles with the same `torch.profiler`. Setting `VLLM_TORCH_PROFILER_DIR` makes
#   its workers record traces into that folder, and `LLM.start_profile()` /
#   `LLM.stop_profile()` bracket the part of a run to record (its example is
#   `examples/offline_inference/simple_profiling.py`; the traces open in Perfetto). For a
#   table like ours it has `layerwise_profile` in `vllm/profiler/layerwise_profile.py`: a
#   `torch.profiler.profile` with CPU and CUDA activities, `record_shapes`, `with_stack` and
#   `with_modules=True`, whose results (`LayerwiseProfileResults`) rebuild the `nn.Module` tree
#   from the profiler's events and add up each module's CUDA kernel time
#   (`print_model_table`, `print_summary_table`). It groups by module, and our matrices are not
#   modules: they are five calls of one function, `linear`, told apart by the weight's identity,
#   so we label calls with `record_function` instead. It sums GPU kernel time; we have only
#   CPU time, where an op's self time includes its dispatch.
# * **llama.cpp** ships `llama-bench` (`tools/llama-bench`): prompt-processing (`-p`) and
#   text-generation (`-n`) tests, each repeated `-r` times (5 by default), reported as mean
#   tokens/s with a standard deviation, and over lists of settings such as thread counts
#   (`-t 1,2,4`); its README notes that tokenization and sampling are not in the timings. It
#   answers "how fast is a step" for a whole step; the breakdown by stage is what we add here,
#   and we keep the fastest step rather than the mean.
# * **nano-vllm** has no profiler; its `bench.py` times one `generate` over 256 random requests
#   and prints a single throughput line.
#
# ## Try it
#
# 1. **Break the stage map on purpose.** Build `broken = dict(names)` and
#    `del broken[id(model.head)]`, then call `ps.check_weights_accounted(model, broken)`.
#    Check: `GateError` saying 113,246,208 bytes are read by an unlabelled matrix. Then profile
#    with it anyway, `p = ps.profile_decode(model, 1, steps=1, names=broken)`, and look at
#    `ps.rows(p, cfg)`: the `head` row has 0 calls and 0 ms, and its milliseconds have moved
#    into `engine_other`, the row that is wall time minus every labelled stage. That silent move
#    is what the gate is for.
# 2. **Reproduce the counts at a batch the table does not have.** Before running
#    `p4 = ps.profile_decode(model, 4, steps=1, names=names)`, predict
#    `ps.summary(p4)["py_calls"]` and `ps.summary(p4)["aten_calls"]` from the two printed in
#    section 5. Check: `py_calls` equals batch 1's and batch 8's, and `aten_calls` equals batch
#    8's (the copy in `linear` appears as soon as there is more than one row).
# 3. **One thread.** `torch.set_num_threads(1)`, then profile batch 1 again. `linear` then calls
#    `F.linear` once per matrix instead of splitting the weight into slabs. Check:
#    `p.py_calls["qkv_proj"] == 30`, `p.py_calls["head"] == 1`, and the step's `py_calls` is
#    6 calls fewer for each of the 121 matrices. Put `torch.set_num_threads(2)` back
#    before re-running the rest.

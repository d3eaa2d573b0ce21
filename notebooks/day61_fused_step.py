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
# # Day 61 — One decode step in one call: the per-op overhead, counted and removed
#
# A decode step of SmolLM2-135M is a long list of small torch operations: per block a norm, a
# product, a rotary, a K/V write, attention, another product, a residual, and so on, 30 times,
# then the head. Each of them is dispatched from Python, and each pays a microsecond or more
# before any arithmetic starts: day 49 timed a step of a 30-layer model only 64 wide, nearly all
# overhead, at 1.5 µs an op. With fp32 weights the step has to read 538 MB, and the overhead
# hides behind that read. With day 60's Q4_1 blocks it reads 97 MB, the read shrinks by more
# than five times, and the same list of ops costs what it cost before: now the overhead is of
# the same size as the work.
#
# The engine's answer is `Llama.fused_decode`: the whole decode step written out in C++
# (csrc/quant.cpp) and called once. `engine_config(61, decode_step="fused")` turns it on;
# `"auto"` picks it for quantized weights. Prefill and mixed steps stay on the torch ops.
#
# 1. the ops of one engine decode step, counted, and their price against the weights' read,
# 2. the same count for the fused step, and a batch-1 step timed both ways, fp32 and Q4_1,
# 3. batch 4 and 16 from `days/day61/fusedbench.py`: ms a step and ms a token,
# 4. day 60's comparison with llama.cpp again, now with the fused step, from the script's CSV,
# 5. `torch.compile` on the ops path, from the script's CSV,
# 6. equality: one step's logits fused against ops on the same plan and pools, and greedy tokens,
# 7. a fused step that writes the K/V one slot off, caught by the logits check,
# 8. the diagram.

# %%
import csv
import dataclasses
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, engine_config, read_csv, top2_gap
from nanoserve.bench import cpu_line
from nanoserve.models import describe_weights, load_model, model_weight_bytes, quantize_model
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day61"))
import fusedbench  # the day's script: the notebook calls its helpers and reads its CSVs

torch.manual_seed(0)
print(cpu_line())
MODEL_DIR = fetch_default_model()
t0 = time.perf_counter()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
print(f"SmolLM2-135M-Instruct, {describe_weights(model)}, loaded in {time.perf_counter() - t0:.1f} s")
with open(REPO / "days" / "day61" / "day-61-fused.csv") as f:
    CSV = list(csv.DictReader(f))


def csv_row(weights, rows, step):
    return next(r for r in CSV if (r["weights"], int(r["rows"]), r["step"]) == (weights, rows, step))


# %% [markdown]
# ## 1. What a decode step is, counted
#
# `fusedbench.decoding_engine` builds an engine whose requests are past their prompts, so its
# next `step()` is a decode step. `fusedbench.OpCount` is a `TorchDispatchMode` that counts
# every aten op dispatched while it is on. Here it counts one step of one row on the ops path,
# fp32 weights, linears plain (not oneDNN-packed, because the fused step reads the plain layout
# and the two should compare the same weights).

# %%
ops_engine = fusedbench.decoding_engine(model, tok, "ops", 1)
with fusedbench.OpCount() as counted:
    ops_engine.step()
top = sorted(counted.ops.items(), key=lambda kv: -kv[1])[:8]
print(f"one decode step, ops path: {counted.total} aten ops")
print("most frequent:", ", ".join(f"{name} {n}" for name, n in top))
assert counted.total == int(csv_row("fp32", 1, "ops")["ops_step"])

# %% [markdown]
# The script counted the same number (the assert holds it against the CSV), and the count does
# not depend on the weights' values, only on the code path, the layers and the thread count.
# Priced at day 49's step time per op of its 30-layer model 64 wide at batch 1 (`us_per_call`
# in day 49's CSV, measured on the same 2-core machine), and set against what reading the
# weights once costs at the read bandwidth this day's script measured:

# %%
day49 = read_csv(REPO / "days" / "day49" / "day-49-launch.csv")
price_us = float(next(r for r in day49 if (r["model"], r["batch"]) == ("h64-l30", "1"))["us_per_call"])
bandwidth = float(CSV[0]["bandwidth_gbs"])
print(f"day 49's price per op: {price_us} µs; read bandwidth in this script's run: {bandwidth} GB/s")
print(CSV[0]["cpu"])
for weights in ("fp32", "q4_1"):
    r = csv_row(weights, 1, "ops")
    mb, n = float(r["weight_mb"]), int(r["ops_step"])
    read_ms, overhead_ms = mb / bandwidth, n * price_us * 1e-3
    print(
        f"{weights:>5}: {mb:6.1f} MB of weights -> {read_ms:5.2f} ms to read;  "
        f"{n} ops x {price_us} µs = {overhead_ms:4.2f} ms  (overhead / read = {overhead_ms / read_ms:.2f})"
    )

# %% [markdown]
# The Q4_1 step has fewer ops (its linears are one native call each, where the plain fp32 linear
# is several aten ops), but its read shrank far more. At day 49's price per op the overhead is
# 0.23 of the read with fp32 weights and 0.80 of it with Q4_1. That price was taken on tensors
# 64 wide, and this script's own price per removed op for Q4_1 (sections 2 and 3: 2.2 µs at one
# and at four rows, 2.8 at 16) is above it, so on this model the overhead outgrows the read.
#
# ## 2. The fused step: what is left, and one row timed both ways
#
# The same count on an engine with `decode_step="fused"`. Inside the native call C++ still
# dispatches a few aten ops of its own (the output tensors it allocates, for one), and around it
# the runner and the engine keep theirs (sampling the next token, the plan's tensors).
# `fusedbench.count_step` counts the whole step and the forward alone.

# %%
fused_engine = fusedbench.decoding_engine(model, tok, "fused", 1)
print(fused_engine.paths_line())
for name, eng in (("ops", fusedbench.decoding_engine(model, tok, "ops", 1)), ("fused", fused_engine)):
    whole, forward = fusedbench.count_step(eng)
    print(
        f"{name:>5}: {whole:5d} aten ops a step, {forward:5d} of them in the forward, "
        f"{whole - forward} around it"
    )
    assert (whole, forward) == (
        int(csv_row("fp32", 1, name)["ops_step"]),
        int(csv_row("fp32", 1, name)["ops_forward"]),
    )

# %% [markdown]
# A batch-1 step timed live, the two engines taking turns, best of five (machines of this kind
# are noisy, so these move from run to run; the table below is the script's run, taken the same way with
# more steps).

# %%
best = fusedbench.best_steps({"ops": ops_engine, "fused": fused_engine}, 5)
print(
    f"fp32, 1 row: ops {best['ops'] * 1e3:.1f} ms, fused {best['fused'] * 1e3:.1f} ms "
    "(their ratio moves with the load; the table's are from one run)"
)
del ops_engine, fused_engine

COLS = (
    "weights",
    "rows",
    "step",
    "ops_step",
    "weight_mb",
    "step_ms",
    "token_ms",
    "weights_ms",
    "us_per_removed_op",
)


def show(rows):
    print("  ".join(f"{c:>17}" if i > 2 else f"{c:>7}" for i, c in enumerate(COLS)))
    for r in rows:
        cells = [r[c] + (" ms" if c.endswith("_ms") else " µs" if c.startswith("us_") else "") for c in COLS]
        print("  ".join(f"{v:>17}" if i > 2 else f"{v:>7}" for i, v in enumerate(cells)))


show([r for r in CSV if r["rows"] == "1"])

# %% [markdown]
# `us_per_removed_op` is the step time the fused step saved divided by the ops it removed: what
# each op cost in the script's run. `weights_ms` is the weights' megabytes over the measured read
# bandwidth, the floor for a step that reads every weight once.
#
# ## 3. More rows
#
# A decode step reads the weights once for all its rows, so the read is shared and the per-row
# costs grow: the products do more arithmetic per byte read and the attention reads more K/V.
# The op count stays nearly flat as rows are added, so the overhead the fused step removes is
# shared too.

# %%
show([r for r in CSV if r["rows"] != "1"])
for weights in ("q4_1", "fp32"):
    for rows in (1, 4, 16):
        o, f = csv_row(weights, rows, "ops"), csv_row(weights, rows, "fused")
        print(f"{weights:>5} {rows:2d} rows: ops / fused = {float(o['step_ms']) / float(f['step_ms']):.2f}")

# %% [markdown]
# For Q4_1 the fused step's lead shrinks as rows are added, 1.48x at one row, 1.28x at four and
# 1.10x at 16, because the overhead it removes is shared by more tokens. For fp32 it is 1.71x at
# one row and 2.02x at four, and at 16 rows the two steps take the same time (0.99x). With fp32
# weights the fused step also swaps torch's matrix kernel for its own, so its time is not the ops
# step's minus the overhead: the two changes mix, and at 16 rows they cancel in this run.

# %% [markdown]
# ## 4. Against llama.cpp, one row
#
# Day 60 set its engine (torch-ops step) beside llama.cpp at batch 1: greedy decode of
# `nanoserve.bench.DECODE_PROMPT`, 64 tokens past the prompt, on the default GGUF. The script
# runs that comparison again with both steps (`--llama-server BIN --llama-bench BIN`, writing
# `day-61-peer.csv`): the file's Q4_1 blocks with fp32 and with int8 activations, each on the ops
# and the fused step, four engines taking three turns and each keeping its best rate (prefill
# taken out), then llama-server and llama-bench on the same file. `fused_vs_ops` says where the
# fused step's tokens part from the ops step's with the same weights and activations, and
# `top2_gap_there` how far apart the ops model's top two logits were at that token. The
# notebook reads the CSV; the run needs llama.cpp's binaries.

# %%
peer = read_csv(REPO / "days" / "day61" / "day-61-peer.csv")
cols = ["variant", "step", "tok_s", "vs_llama_server", "tokens_vs_llama_server", "fused_vs_ops"]
cols += ["top2_gap_there"]
print(" | ".join(cols))
for r in peer:
    print(" | ".join(r[c] for c in cols))
print(peer[0]["cpu"])
peer_rate = {(r["variant"], r["step"]): float(r["tok_s"]) for r in peer}
for acts in ("fp32", "int8"):
    ops, fused = peer_rate[(f"q4_1/{acts}", "ops")], peer_rate[(f"q4_1/{acts}", "fused")]
    print(f"q4_1/{acts}: fused / ops = {fused / ops:.2f}")
    assert fused > ops, f"q4_1/{acts}: the fused step is not faster than the ops step"
parts = {(r["variant"], r["step"]): r["fused_vs_ops"] for r in peer}
assert parts[("q4_1/fp32", "ops")] == parts[("q4_1/fp32", "fused")] == "equal"  # fp32 activations
int8 = next(r for r in peer if (r["variant"], r["step"]) == ("q4_1/int8", "fused"))
assert int8["fused_vs_ops"] == "equal" or float(int8["top2_gap_there"]) < 0.1  # a near tie, if anywhere

# %% [markdown]
# The fused step lifts both kinds of activation: with fp32 activations from 175.1 to 255.6 tok/s
# (1.46x), with int8 activations from 231.4 to 385.0 (1.66x). llama-server decoded at 204.4
# tok/s (llama-bench, which decodes from an empty context, at 215.9). Only one row of ours is
# behind llama-server, Q4_1 with fp32 activations on the ops step (0.86x); the fused step with
# int8 activations, the arithmetic llama.cpp itself uses for these blocks, is 1.88x. The run
# was on a 2-core AVX-512 EPYC with 2 threads, as the `cpu` line says.
#
# The tokens: every row of ours parts from llama-server at index 0. Day 60 showed why: on this
# prompt the fp32 model's first token is a contest ("A" at 0.249 against "When" at 0.194), and
# llama-server takes the other side. Between our own steps, fp32 activations give the same 64
# tokens on both: the two steps sum the same products in other orders, and over these 64 tokens
# the last-place differences that leaves never tipped a token. With int8 activations the steps
# part at index 41, where the top two logits were 0.039 apart (the same index at which day 60's
# q4_1/int8 parted from the fp32 model). Rounding an activation to int8 is a step function: a
# sum that lands a hair differently because the fused step adds in another order can move one
# activation a whole int8 step, and at a gap of 0.039 that is enough to swap the top two.

# %% [markdown]
# ## 5. The compiler's way, from the script
#
# `torch.compile` (inductor, default mode) is the other way to remove per-op cost: trace the ops
# into graphs and generate fused C++ for them. The script tried it on the ops path's forward at
# batch 1, fp32; `torch._dynamo.explain` counted the graphs and breaks first. The notebook only
# reads the CSV (explaining and compiling take a while on 2 cores).

# %%
with open(REPO / "days" / "day61" / "day-61-compile.csv") as f:
    compiled = next(csv.DictReader(f))
for key, value in compiled.items():
    if key == "cpu":
        print(value)
        continue
    unit = " ms" if key.endswith("_ms") else " s" if key.endswith("_s") else ""
    print(f"{key:>13}: {value}{unit}")

# %% [markdown]
# Dynamo found 24 graphs and 23 breaks; the first, in sorted order, is a call it may not trace
# (the pybind attention kernel). The first call took 18.8 s, and the compiled forward then ran
# in 19.09 ms against 19.22 eager, with logits within 2.2e-05 of eager's: between the breaks there
# is too little left to fuse for the per-op cost to go. The fused step needs no such per-shape
# setup: it is one C++ function built once per machine and source (`nanoserve.kernels`, on
# first use), and any batch or width runs through it.
#
# ## 6. The same step, two ways: logits and tokens
#
# The test in tests/test_quant.py does this on a tiny model; here it is SmolLM2. Two requests are
# prefilled, the next decode plan is built, the pools are copied, the fused step runs, the pools
# are put back, and the ops path runs on the same plan and pools. The tolerance is set from what
# the two differ by: the order of the sums differs (C++ loops against oneDNN/ATen kernels), so
# the difference is rounding, around 1e-5 here; 1e-4 leaves room for that and not for a real bug.

# %%
from nanoserve.plan import plan_decode

TOL = 1e-4


def same_step(model, wrong=None):
    """Max |fused - ops| over one decode step's logits on the same plan and pools."""
    eng = fusedbench.decoding_engine(model, tok, "fused", 2)
    plan = plan_decode(eng.scheduler.schedule().decode, eng.config.block_size, "cpu")
    with torch.inference_mode():
        k, v = [t.clone() for t in eng.cache.k], [t.clone() for t in eng.cache.v]
        fused = model.fused_decode(wrong(plan) if wrong else plan, eng.cache)
        for i in range(len(k)):
            eng.cache.k[i].copy_(k[i]), eng.cache.v[i].copy_(v[i])
        ops = model(plan.input_ids, plan.positions, eng.cache.view(plan), logits_at=plan.logits_at)
    return (fused - ops).abs().max().item(), fused.shape


diff_fp32, shape = same_step(model)
print(f"fp32: logits {tuple(shape)}, max |fused - ops| = {diff_fp32:.0e}")
assert diff_fp32 < TOL

# %% [markdown]
# Greedy tokens from two engines, one fused and one on ops, on three chat prompts. Where they
# part, the near-tie rule of tests/test_engine.py applies: allowed only where the ops model's two
# best logits are within 1e-4 of each other (none are needed here).

# %%
PROMPTS = [[{"role": "user", "content": q}] for q in fusedbench.QUESTIONS[:3]]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def tokens_both_ways(model):
    from nanoserve.engine import Engine

    outs = {}
    for step in ("ops", "fused"):
        config = engine_config(
            61, max_batch=4, decode_step=step, linear="plain", max_model_len=256, kv_budget=2**26
        )
        eng = Engine(model, tok, config)
        outs[step] = [o.token_ids for o in eng.generate(PROMPTS, PARAMS, use_tqdm=False)]
    ties = 0
    for prompt, ref, got in zip(PROMPTS, outs["ops"], outs["fused"]):
        if ref != got:
            k = next(i for i, (a, b) in enumerate(zip(ref, got)) if a != b)
            with torch.inference_mode():
                gap = top2_gap(model, tok.encode_chat(prompt) + ref[:k])
            assert gap < 1e-4, f"tokens differ at {k} with a top-2 gap of {gap:.2e}"
            ties += 1
    return outs, ties


def equal(outs):
    return sum(a == b for a, b in zip(outs["ops"], outs["fused"]))


outs, ties = tokens_both_ways(model)
for p, toks in zip(PROMPTS, outs["fused"]):
    print(f"{p[0]['content']!r:<18} -> {tok.decode(toks)!r}")
print(f"fp32: fused tokens equal the ops tokens on {equal(outs)} of 3 prompts, near-ties {ties}")

# %% [markdown]
# The same two checks with Q4_1 weights. To keep the notebook fast the fp32 model is quantized in
# place here with `quantize_model` (block matrices in Q4_1, the embedding and tied head in Q8_0,
# the mix of llama.cpp's Q4_1 files; the script loads the GGUF's own blocks, which is slower to
# parse). Both give 96.6 MB of weights.

# %%
t0 = time.perf_counter()
quantize_model(model, "q4_1")
print(f"quantized in {time.perf_counter() - t0:.1f} s: {describe_weights(model)}")
assert round(model_weight_bytes(model) / 1e6, 1) == float(csv_row("q4_1", 1, "ops")["weight_mb"])
diff_q4, shape = same_step(model)
print(f"q4_1: logits {tuple(shape)}, max |fused - ops| = {diff_q4:.0e}")
assert diff_q4 < TOL
outs, ties = tokens_both_ways(model)
print(f"q4_1: fused tokens equal the ops tokens on {equal(outs)} of 3 prompts, near-ties {ties}")
for name, eng in (
    ("ops", fusedbench.decoding_engine(model, tok, "ops", 1)),
    ("fused", fusedbench.decoding_engine(model, tok, "fused", 1)),
):
    whole, forward = fusedbench.count_step(eng)
    print(f"q4_1 {name:>5}: {whole:5d} aten ops a step, {forward:5d} in the forward")
    assert whole == int(csv_row("q4_1", 1, name)["ops_step"])

# %% [markdown]
# ## 7. A fused step built wrong
#
# The fused step writes each row's new K/V at the plan's `write_slots` and then attends over the
# row's slot window, which ends at that slot. A version that writes one slot further on leaves
# the last window entry holding whatever was there (zeros here) and puts the new key and value
# where no window reads them. The logits check catches it.


# %%
def one_slot_off(plan):
    return dataclasses.replace(plan, write_slots=plan.write_slots + 1)


diff_wrong, _ = same_step(model, wrong=one_slot_off)
try:
    assert diff_wrong < TOL, f"max |fused - ops| = {diff_wrong:.2f}, above the tolerance {TOL:.0e}"
    raise RuntimeError("the off-by-one K/V write went unnoticed")
except AssertionError as e:
    print("caught: K/V written one slot off ->", e)

# %% [markdown]
# ## 8. The diagram
#
# Per weights and path, ms a token split into the weights' read at the measured bandwidth
# (shared among the rows) and everything else, at 1 row and at 16 rows.

# %%
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
for ax, rows in zip(axes, (1, 16)):
    labels, read, rest = [], [], []
    for weights in ("fp32", "q4_1"):
        for step in ("ops", "fused"):
            r = csv_row(weights, rows, step)
            per_read = float(r["weights_ms"]) / rows
            labels.append(f"{weights}\n{step}")
            read.append(per_read)
            rest.append(max(float(r["token_ms"]) - per_read, 0.0))
    ax.bar(labels, read, color="#4c72b0", label="weights' bytes at the read bandwidth")
    ax.bar(labels, rest, bottom=read, color="#dd8452", label="the rest (ops, arithmetic, K/V)")
    for i, (a, b) in enumerate(zip(read, rest)):
        ax.text(i, a + b, f"{a + b:.1f}", ha="center", va="bottom", fontsize=9)
    ax.set_title(f"{rows} row{'s' if rows > 1 else ''} a step: ms a token")
    ax.set_ylabel("ms a token")
axes[0].legend(fontsize=8, loc="upper right")
fig.suptitle(f"SmolLM2-135M decode, ops vs fused (2 threads, {bandwidth} GB/s read)")
fig.tight_layout()
png = diagram_path("day61-fused_step.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM and SGLang** face the same per-step overhead on a GPU, where each op that computes
#   is a kernel launch. Day 49 counted 2,154 ops issued from Python in one decode step of this
#   model and reckoned on paper, without a GPU to measure, that a GPU would spend most of such a
#   step waiting on the CPU (quoted). Both record the decode forward as CUDA graphs for a list
#   of batch sizes at startup (vLLM's `cudagraph_capture_sizes` in its compilation config,
#   SGLang's `--cuda-graph-max-bs`) and replay one graph a step; our days 51-56 built that idea
#   for the CPU with `HostGraph`.
#   A graph removes the launches but keeps the kernels; fusing them is a separate step.
# * **llama.cpp** builds a ggml compute graph for each batch (`llama_build_graph` in older
#   trees, per-architecture builders such as `build_llama` since) and runs it on the CPU backend
#   with `ggml_graph_compute` over one `ggml_threadpool`: no interpreter between nodes, and the
#   node kernels read the Q4_1/Q8_0 blocks directly. The fused step here is that design with the
#   graph unrolled by hand for one model family.
# * **torch.compile / inductor** traces the torch ops into FX graphs and, on CPU, generates C++
#   with OpenMP loops (the `cpp` backend), fusing the elementwise glue (norms, SiLU, residuals)
#   into a few kernels. On the ops path here it breaks the graph at the calls into our pybind
#   kernels, among other places; section 5's CSV counts the breaks.
# * **TensorRT-LLM** compiles the model into an engine of fused kernels (fused QKV with rotary,
#   fused attention, fused MLP activations, and a GEMM plus bias plus activation plugin) and, on
#   top, can capture the generation step in CUDA graphs.
#
# ## Try it
#
# 1. Read the script's table (`CSV`) for q4_1 and predict before looking: does the ops step
#    dispatch more ops at 16 rows than at 4? Check that `ops_step` of the two ops rows is equal
#    while `step_ms` more than doubles, and find the first row count at which `speedup` falls
#    under 1.2.
# 2. Break the rotary instead of the K/V write: set `model.cos = torch.roll(model.cos, 1, 0)`
#    (and `sin`), reset `model._fused = None`, and run `same_step(model)`: the assert of section 6
#    must fail with a difference above `TOL`.
# 3. Count the ops of one *prefill* step of a fused engine with `fusedbench.OpCount` and check that
#    it equals the ops engine's (prefill stays on torch ops).

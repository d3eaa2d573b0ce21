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
# # Day 12 — Measuring decode: tokens/s, bytes per token, the bandwidth roofline
#
# Day 11's cache made a decode step cost the same at every position. Today the question is what
# that cost is made of, and how close our loop comes to the least it could be. At batch 1 a
# decode step multiplies one row by every weight matrix of the model: one multiply-add per
# weight, 134 million of them, for which every one of the 538 MB of fp32 weights has to come in
# from memory, since they are many times larger than the CPU's caches. Each weight is used once
# and thrown away, so the step is paced by memory, and a machine that reads B bytes a second
# cannot decode faster than B divided by the bytes a token reads. That ceiling is the roofline.
#
# 1. the bytes a token reads, counted from the model (and a count that gets it wrong),
# 2. this machine: its CPU, and its read bandwidth at 1 and 2 threads,
# 3. the roofline, and the decode rate measured against it, fp32 and bf16, 1 and 2 threads
#    (`days/day12/roofline.py`),
# 4. the two claims in `nanoserve.models.linear`'s docstring, checked,
# 5. the tables and the diagram.
#
# The counts are facts and nbval compares them. Every rate and time measured live is this
# notebook's own run, on whatever machine runs it, printed in cells nbval does not compare; the
# script's committed CSVs name the machine that measured them in their `cpu` column.

# %%
import csv
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv
from nanoserve.bench import cpu_line, read_bandwidth_gbs
from nanoserve.models import BF16_UPCAST_ROWS, load_model
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day12"))
import roofline  # the day's script: the notebook runs the same functions at a smaller size

MODEL_DIR = fetch_default_model()
t0 = time.perf_counter()
model = load_model(MODEL_DIR)  # fp32
b16 = load_model(MODEL_DIR, dtype=torch.bfloat16)
print(f"loaded fp32 and bf16 in {time.perf_counter() - t0:.1f} s")
cfg = model.cfg

# %% [markdown]
# ## 1. What one token reads
#
# Walk the forward and note every tensor it reads for one token. The embedding lookup reads one
# row; the head multiplies by the whole embedding again (the weights are tied, so it is the same
# tensor); every block reads its two norm vectors and its four matrices. Counted in a few lines:

# %%
row_bytes = cfg.hidden_size * 4
per_block = {name: p.numel() * 4 for name, p in model.blocks[0].named_parameters()}
head = model.head.numel() * 4
final_norm = model.norm.numel() * 4
by_hand = row_bytes + cfg.num_layers * sum(per_block.values()) + final_norm + head
print(f"embedding lookup: one row, {row_bytes:,} bytes")
print("one block:", {k: f"{v:,}" for k, v in per_block.items()}, f"= {sum(per_block.values()):,} bytes")
print(
    f"{cfg.num_layers} blocks: {cfg.num_layers * sum(per_block.values()):,}; final norm {final_norm:,}; "
    f"head (the embedding, whole): {head:,}"
)
print(f"total read for one token: {by_hand:,} bytes")
weights = roofline.weight_bytes(model)
print(f"roofline.weight_bytes(model): {weights:,} bytes ({weights / 1e6:.1f} MB)", end="; ")
print(f"bf16: {roofline.weight_bytes(b16):,}")
assert (
    by_hand == weights + row_bytes
    and weights == 134_515_008 * 4
    and roofline.weight_bytes(b16) * 2 == weights
)

# %%
prompt_len = 51  # the decode prompt below, bench.DECODE_PROMPT in the chat template
kv_last = (prompt_len + roofline.TOKENS) * cfg.kv_bytes_per_token(torch.float32)
print(f"head: {head / weights:.1%} of the weights")
print(
    f"K/V read at the last of {roofline.TOKENS} decode steps after a {prompt_len}-token prompt: "
    f"{kv_last / 1e6:.1f} MB, {kv_last / weights:.1%} of the weights"
)
assert kv_last / weights < 0.02

# %% [markdown]
# A count that walks the state dict gets the total wrong, because the state dict names the
# tied tensor twice, as `embed` and as `head`. A gate that compares a count with the distinct
# storages the model holds catches it:

# %% [markdown]
# The script's count, `weight_bytes`, is every distinct parameter once: 538.1 MB in fp32, half
# in bf16. It leaves out the one embedding row (2 KB) because the head reads that row anyway,
# and it leaves out the K/V cache, which is small next to the weights at these lengths (next
# cell), so the roofline is weights only. The head alone is a fifth of it: one (49,152 x 576)
# matrix, read in full for every token to score every vocabulary entry.


# %%
def check_weight_bytes(counted: int, model) -> None:
    """A byte count must equal the bytes of the distinct storages the model holds."""
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.state_dict().values()
    }
    if counted != sum(storages.values()):
        raise AssertionError(
            f"counted {counted:,} bytes; the model's storages hold {sum(storages.values()):,}"
        )


naive = sum(t.numel() * t.element_size() for t in model.state_dict().values())
print(
    "state dict keys that share a storage:",
    [k for k, t in model.state_dict().items() if t.data_ptr() == model.embed.data_ptr()],
)
check_weight_bytes(weights, model)
print(f"weight_bytes passes: {weights:,}")
try:
    check_weight_bytes(naive, model)
except AssertionError as e:
    print("state-dict count caught:", e)
else:
    raise RuntimeError("the tied head counted twice should have been caught")
print(f"counting the head twice would put the roofline {1 - weights / naive:.0%} too low")

# %% [markdown]
# ## 2. This machine
#
# The numbers below mean little without the machine, so the script prints it first
# (`nanoserve.bench.cpu_line`): torch's kernel level, the CPU's vector and bf16 flags, and
# whether oneDNN has bf16 instructions to use.

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
print(f"torch {torch.__version__}")
try:
    l3 = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
except OSError:
    l3 = "unknown"
print(f"last-level cache: {l3}, against {weights / 2**20:.0f} MiB of fp32 weights")

# %% [markdown]
# The read bandwidth is measured the way torch sees memory: sum a tensor much larger than the
# last-level cache and divide its bytes by the time. In a few lines, then the package's
# `read_bandwidth_gbs` (512 MB, the best of five sums), at each thread count:

# %%
# NBVAL_IGNORE_OUTPUT
x = torch.ones(256 * 2**20 // 4)  # 256 MB of fp32
x.sum()  # the first pass touches the pages
best = float("inf")
for _ in range(5):
    t0 = time.perf_counter()
    x.sum()
    best = min(best, time.perf_counter() - t0)
print(f"by hand, 256 MB, {torch.get_num_threads()} threads: {x.numel() * 4 / best / 1e9:.1f} GB/s")
del x
bandwidth = {}
for threads in (1, 2):
    torch.set_num_threads(threads)
    bandwidth[threads] = read_bandwidth_gbs()
    print(f"read_bandwidth_gbs at {threads} thread(s): {bandwidth[threads]:.1f} GB/s")
torch.set_num_threads(2)

# %% [markdown]
# ## 3. The roofline, and decode against it
#
# Divide the bandwidth by the bytes a token reads: that is the most tokens a second this
# machine could decode at batch 1, whatever the code. `roofline.roofline` measures the real
# rate with the package's `decode_rate`: greedy tokens from the eager loop, timing n tokens and
# 1 token and dividing the difference, so the prefill of the prompt drops out. The script runs
# 128 tokens per configuration, three rounds; the notebook 16 tokens, one round.

# %%
t0 = time.perf_counter()
rows = roofline.roofline(MODEL_DIR, tokens=16, models={"float32": model, "bfloat16": b16})
print(f"{len(rows)} configurations in {time.perf_counter() - t0:.1f} s")
facts = ["dtype", "threads", "weight_mb", "tokens"]
print(" | ".join(facts))
for r in rows:
    print(" | ".join(str(r[c]) for c in facts))
with open(roofline.CSV_ROOFLINE) as f:
    committed = list(csv.DictReader(f))
assert [[str(r[c]) for c in facts[:3]] for r in rows] == [[r[c] for c in facts[:3]] for r in committed]

# %%
# NBVAL_IGNORE_OUTPUT
for r in rows:
    print(
        f"{r['dtype']:>9}, {r['threads']} thread(s): {r['tok_s']:5.1f} tok/s "
        f"against a roofline of {r['roofline_tok_s']:5.1f} tok/s "
        f"({r['bandwidth_gb_s']} GB/s / {r['weight_mb']} MB): {r['fraction']:.0%} of it, "
        f"{r['achieved_gb_s']} GB/s of weights streamed"
    )

# %% [markdown]
# The script's run, 128 tokens per configuration and the best of three rounds, as committed
# (`day-12-roofline.csv`, read back, not recomputed):

# %%
shown = [c for c in committed[0] if c != "cpu"]  # the cpu column is the same on every row: printed once
print(" | ".join(shown))
for r in committed:
    print(" | ".join(r[c] for c in shown))
print("measured on", committed[0]["cpu"])
by = {
    (r["dtype"], r["threads"]): {k: float(v) for k, v in r.items() if k not in ("dtype", "cpu")}
    for r in committed
}
for t in ("1", "2"):
    f32, b16r = by["float32", t], by["bfloat16", t]
    print(
        f"{t} thread(s): bf16 / fp32 roofline {b16r['roofline_tok_s'] / f32['roofline_tok_s']:.2f}x,",
        f"measured rate {b16r['tok_s'] / f32['tok_s']:.2f}x",
    )
for dt in ("float32", "bfloat16"):
    one, two = by[dt, "1"], by[dt, "2"]
    print(
        f"{dt}: 2 threads / 1, measured rate {two['tok_s'] / one['tok_s']:.2f}x,",
        f"read bandwidth {two['bandwidth_gb_s'] / one['bandwidth_gb_s']:.2f}x",
    )

# %% [markdown]
# That run was measured on a 2-core AVX-512 CPU with bf16 instructions, 2 threads, as the
# `measured on` line says. fp32 decoded at 0.39 of its roofline on one thread and 0.5 on two:
# 50.0 tokens a second on 2 threads, which streams 26.9 GB/s of weights while the read test
# reached 53.7. bf16 halves the bytes and its roofline doubles, to 202.2 tokens a second on 2
# threads, but it reached a smaller fraction of it (0.27 and 0.31): the measured rate rose 1.27x
# on 2 threads (63.6 against 50.0) and 1.45x on one, not 2x. Half the bytes did not make half
# the time, because a step is not only weight reads (section 4 sizes the rest; Day 48 profiles
# it). 2 threads beat 1 by 1.67x in fp32 and 1.47x in bf16, more than the read bandwidth gained
# (1.28x and 1.24x): one thread alone does not keep the memory busy.
#
# ## 4. The claims in `linear`'s docstring
#
# `nanoserve.models.linear` does two unusual things on CPU, and its docstring says why with
# numbers that Day 12 is meant to measure:
#
# * in fp32 with two or more threads it splits the output features into one slab per thread and
#   runs a batched matmul, because "MKL's own GEMV/GEMM on these tall, thin shapes keeps one
#   core streaming the weights"; the docstring quotes 14 -> 23 GB/s at one row and 66 -> 46 ms
#   a step at eight rows, on 2 cores;
# * in bf16 on a CPU without bf16 matrix instructions it widens the weights to fp32 from
#   `BF16_UPCAST_ROWS` rows on, because such a CPU "emulates a bf16 GEMM at ~20 GFLOP/s", far
#   below what it reaches in fp32, while at one row bf16's halved bytes win.
#
# `roofline.linear_rows` times both on the model's own weights, every set of them far larger
# than the CPU's cache, so each pass streams from memory as a decode step does: all 121 matrices
# of a step at 1 and 8 rows through fp32 `F.linear`, the fp32 slabs, bf16 `F.linear` and the
# package's bf16 `linear`; then the 30 gate/up matrices over a sweep of row counts, fp32 against
# bf16 and bf16 widened to fp32. The script sweeps 1 to 256 rows, five rounds; the notebook
# 1, 4 and 16 rows, one round. The package's `linear` widens only where oneDNN has no bf16
# instructions (`mkldnn bf16 no` in the cpu line); where it has them, its "bf16 linear" rows are
# plain bf16 products, and only the forced "bf16 widened to fp32" path shows what widening costs.

# %%
t0 = time.perf_counter()
lin = roofline.linear_rows(model, threads=2, repeats=1, sweep=(1, 4, 16))
print(f"{len(lin)} timings in {time.perf_counter() - t0:.1f} s; BF16_UPCAST_ROWS = {BF16_UPCAST_ROWS}")
facts = ["check", "dtype", "rows", "threads", "path", "weight_mb", "mflop"]
with open(roofline.CSV_LINEAR) as f:
    committed_lin = [
        r for r in csv.DictReader(f) if r["check"] == "all matrices" or r["rows"] in ("1", "4", "16")
    ]
assert [[str(r[c]) for c in facts] for r in lin] == [[r[c] for c in facts] for r in committed_lin]
for r in lin[:4] + lin[8:11]:
    print(" | ".join(str(r[c]) for c in facts))

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{'check':17s} {'rows':>4} {'path':21s} {'ms':>8} {'GB/s':>6} {'GFLOP/s':>8}")
for r in lin:
    print(
        f"{r['check']:17s} {r['rows']:>4} {r['path']:21s} {r['ms']:8.2f} {r['gb_s']:6.1f} {r['gflop_s']:8.1f}"
    )

# %% [markdown]
# The script's run (`day-12-linear.csv`, five rounds, 1 to 256 rows), read back:

# %%
cols = ["check", "rows", "path", "ms", "gb_s", "gflop_s"]
print(" | ".join(cols))
with open(roofline.CSV_LINEAR) as f:
    script_lin = list(csv.DictReader(f))
for r in script_lin:
    print(" | ".join(r[c] for c in cols))
print("measured on", script_lin[0]["cpu"])
at = {(r["check"][:3], r["rows"], r["path"]): float(r["ms"]) for r in script_lin}
for rows_ in ("1", "8"):
    fl, sl = at["all", rows_, "fp32 F.linear"], at["all", rows_, "fp32 slabs (linear)"]
    print(f"all matrices, {rows_} row(s): the slabs take {sl / fl:.2f} of F.linear's time ({fl / sl:.2f}x)")
print("docstring: 14 -> 23 GB/s is", f"{23 / 14:.2f}x; 66 -> 46 ms is {46 / 66:.2f} of the time")
widen = [r["rows"] for r in script_lin if r["path"] == "bf16 widened to fp32"]
slower = [n for n in widen if at["gat", n, "bf16 widened to fp32"] > at["gat", n, "bf16 F.linear"]]
print(f"gate/up, widened bf16 slower than plain bf16 at rows {', '.join(slower)} (of {', '.join(widen)})")
for dt, path in (("float32", "fp32 slabs (linear)"), ("bfloat16", "bf16 linear")):
    step_ms, mat_ms = 1e3 / by[dt, "2"]["tok_s"], at["all", "1", path]
    print(
        f"{dt}, 2 threads: a decode step at the committed rate {step_ms:.1f} ms; its matrices alone",
        f"at one row ({path}) {mat_ms} ms; the rest about {step_ms - mat_ms:.1f} ms",
    )

# %% [markdown]
# Against the docstring, claim by claim, in that run (its `measured on` line: AVX-512 with bf16
# instructions, 2 threads):
#
# * **Slabs at one row**: 18.0 GB/s through `F.linear`, 31.6 through the slabs, 1.76x as fast,
#   more than the docstring's 14 -> 23 GB/s (1.64x). The claim holds.
# * **Slabs at eight rows**: 36.22 -> 31.83 ms for the matmuls of a step, 0.88 of the time, where
#   the docstring's 66 -> 46 ms is 0.70. Faster, as claimed, but by less.
# * **The bf16 GEMM rate**: this machine cannot test it. The claim is about a CPU without bf16
#   instructions, and this one has them: bf16 `F.linear` climbs from 28.3 GFLOP/s at one row to
#   909.8 at 256 rows, where the fp32 slabs reach 219.7.
# * **Widening from `BF16_UPCAST_ROWS` = 4 rows on**: the package does not widen on this CPU, and
#   the forced widened path shows why: it is slower than plain bf16 at every row count of the
#   sweep, 9.6 against 4.19 ms at 4 rows and 126.87 against 29.87 at 256. It writes an fp32 copy
#   of every weight it touches on every call, twice the bytes of the bf16 weights, to reach a
#   product that is slower than the bf16 one here. Whether 4 is the right threshold on a CPU
#   without bf16 instructions, this run cannot say.
#
# The read-back's last lines set the matmuls against a whole decode step. At the committed rates
# a two-thread step takes 20.0 ms in fp32 and 15.7 in bf16; one pass over the matrices at one row
# took 17.03 and 11.05 ms. The two come from separate measurements, so the remainder, about 3.0
# and 4.7 ms, is rough, but it makes the point of section 3: bf16 saved time in the matmuls, and
# the rest of the step did not get cheaper with it.

# %% [markdown]
# ## 5. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
colors = {"float32": "tab:blue", "bfloat16": "tab:orange"}
num = ("bandwidth_gb_s", "roofline_tok_s", "tok_s", "fraction", "weight_mb", "ms", "gb_s", "gflop_s")
full = [{k: float(v) if k in num else v for k, v in r.items()} for r in committed]
with open(roofline.CSV_LINEAR) as f:
    full_lin = [{k: float(v) if k in num else v for k, v in r.items()} for r in csv.DictReader(f)]

ax = axes[0, 0]
mb = torch.linspace(100, 700, 50)
for threads, ls in (("1", ":"), ("2", "--")):
    bw = max(r["bandwidth_gb_s"] for r in full if r["threads"] == threads)
    ax.plot(
        mb, bw * 1e3 / mb, "k", ls=ls, lw=1, label=f"roofline, {threads} thread(s): {bw:.1f} GB/s / bytes"
    )
for r in full:
    ax.plot(
        r["weight_mb"],
        r["tok_s"],
        "o" if r["threads"] == "1" else "s",
        color=colors[r["dtype"]],
        ms=9,
        label=f"{r['dtype']}, {r['threads']} thread(s): {r['tok_s']:.1f} tok/s ({r['fraction']:.0%})",
    )
for r in rows:
    ax.plot(r["weight_mb"], r["tok_s"], "x", color=colors[r["dtype"]], ms=9)
ax.plot([], [], "x", color="gray", label="this notebook's run (16 tokens)")
ax.set_xlabel("bytes read per token (MB)")
ax.set_ylabel("decode tokens/s")
ax.set_ylim(0, 1.15 * max(r["roofline_tok_s"] for r in full))
ax.set_title("Batch-1 decode against the bandwidth roofline (day-12-roofline.csv)")
ax.legend(fontsize=7, loc="upper right")

ax = axes[0, 1]
parts = {
    "head (tied embedding)": head,
    "gate/up": cfg.num_layers * per_block["gate_up"],
    "down": cfg.num_layers * per_block["down"],
    "qkv": cfg.num_layers * per_block["qkv"],
    "o": cfg.num_layers * per_block["o"],
}
left = {"fp32": 0, "bf16": 0}
for name, nbytes in parts.items():
    for k, (dt, scale) in enumerate((("fp32", 1), ("bf16", 0.5))):
        ax.barh(
            k,
            nbytes * scale / 1e6,
            left=left[dt],
            label=name if k == 0 else None,
            color=plt.cm.tab10(list(parts).index(name) + 2),
        )
        left[dt] += nbytes * scale / 1e6
for k, dt in enumerate(left):
    ax.text(left[dt] + 5, k, f"{left[dt]:.0f} MB", va="center")
ax.set_yticks([0, 1], ["fp32", "bf16"])
ax.set_xlim(0, 700)
ax.set_xlabel("MB read per decode token (the norms and the one embedding row are too small to see)")
ax.set_title("What a token reads")
ax.legend(fontsize=8, loc="upper right")

ax = axes[1, 0]
step = [r for r in full_lin if r["check"] == "all matrices"]
labels = [
    r["path"].replace(" (linear)", "").replace(" ", "\n", 1)
    + f"\n{r['rows']} row{'s' if r['rows'] != '1' else ''}"
    for r in step
]
pal = {
    "fp32 F.linear": "tab:gray",
    "fp32 slabs (linear)": "tab:blue",
    "bf16 F.linear": "tab:orange",
    "bf16 linear": "tab:red",
}
ax.bar(range(len(step)), [r["ms"] for r in step], color=[pal[r["path"]] for r in step])
for k, r in enumerate(step):
    ax.text(k, r["ms"] + 3, f"{r['ms']:.0f} ms\n{r['gb_s']:.1f} GB/s", ha="center", fontsize=8)
here = [r for r in lin if r["check"] == "all matrices"]
ax.plot(range(len(here)), [r["ms"] for r in here], "kx", ms=8, label="this notebook's run")
ax.set_xticks(range(len(step)), labels, fontsize=7)
ax.set_ylabel("ms for one pass over the matrices")
ax.set_ylim(0, max(r["ms"] for r in step) * 1.35)
ax.set_title("All 121 matrices of a step, 2 threads (day-12-linear.csv)")
ax.legend(fontsize=8, loc="upper left")

ax = axes[1, 1]
for path, c in (
    ("fp32 slabs (linear)", "tab:blue"),
    ("bf16 F.linear", "tab:orange"),
    ("bf16 widened to fp32", "tab:red"),
):
    pts = [r for r in full_lin if r["check"] == "gate/up matrices" and r["path"] == path]
    ax.plot([int(r["rows"]) for r in pts], [r["ms"] for r in pts], "o-", color=c, label=path)
    pts = [r for r in lin if r["check"] == "gate/up matrices" and r["path"] == path]
    ax.plot([r["rows"] for r in pts], [r["ms"] for r in pts], "x", color=c, ms=8)
ax.plot([], [], "x", color="gray", label="this notebook's run")
ax.axvline(BF16_UPCAST_ROWS, color="k", ls=":", lw=1, label=f"BF16_UPCAST_ROWS = {BF16_UPCAST_ROWS}")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("rows M (tokens in the step)")
ax.set_ylabel("ms for x (M, 576) times the 30 gate/up matrices (log)")
ax.set_title("Gate/up matrices: bf16, and bf16 widened to fp32 (day-12-linear.csv)")
ax.legend(fontsize=8, loc="upper center")

fig.suptitle("Day 12: decode against the memory roofline (SmolLM2-135M, batch 1, CPU)", fontsize=14)
fig.tight_layout()
png = diagram_path("day12-roofline.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## 6. Phase 1, from its first step to its last
#
# Twelve days took a GGUF file to a model that answers: the tokenizer (day 1), the weights (2),
# the layers (3-6), the whole forward held to transformers (7), greedy and sampled decoding
# (8-9), stopping and streamed text (10), a contiguous K/V cache (11) and today's measurement.
# The committed CSVs of days 8, 11 and this day put the phase's start next to its end: the
# uncached step of day 8 re-runs the whole sequence, the cached step of day 11 runs one token,
# and a cached step's speed is then bounded by the bytes it reads. The cell checks that the three
# CSVs name the same CPU in their `cpu` column, so their times can stand side by side.

# %%
d8 = read_csv(REPO / "days" / "day08" / "day-08-steps.csv")
d11 = read_csv(REPO / "days" / "day11" / "day-11-cachebench.csv")
d12 = read_csv(REPO / "days" / "day12" / "day-12-roofline.csv")
cpus = {r["cpu"] for r in d8 + d11 + d12}
print("all three measured on one machine:", len(cpus) == 1, "|", *cpus)
print(f"day 8, no cache:  a step at {d8[-1]['length']} tokens runs them all: {d8[-1]['nocache_ms']} ms")
far = d11[-1]
print(
    f"day 11, cached:   at {far['length']} tokens {far['no_cache_ms']} ms uncached against "
    f"{far['cached_ms']} ms cached, {far['speedup']}x"
)
for r in d12:
    print(
        f"day 12, decode:   {r['dtype']:>8}, {r['threads']} thread(s): {r['tok_s']} tok/s, "
        f"{r['fraction']} of the roofline's {r['roofline_tok_s']}"
    )
assert len(cpus) == 1 and float(far["speedup"]) > 10 and all(float(r["fraction"]) < 1 for r in d12)

# %% [markdown]
# On that one machine, a day-8 step without a cache took 710.4 ms at 512 tokens; at 1,024 tokens
# day 11's cached step took 20.9 ms against 1632.1 ms without the cache, 78.2x; and day 12's
# fp32 decode on 2 threads ran at 50.0 tokens a second, 0.5 of its roofline of 99.7.
#
# What the phase leaves for the next: one sequence at a time, and a cache that reserves the
# longest context for it up front. Day 13 measures what that reservation wastes once many
# sequences share the memory.

# %% [markdown]
# ## In the real systems
#
# * **llama.cpp**'s `llama-bench` (`tools/llama-bench/llama-bench.cpp`) measures generation and
#   prompt processing as separate tests: `-n/--n-gen` tokens generated (128 by default) and
#   `-p/--n-prompt` tokens of prompt (512). `-t/--threads` takes a comma-separated list, so one
#   run sweeps thread counts as our script does, and every test is repeated (`-r`, 5 by default)
#   after a warm-up run (skipped with `--no-warmup`), reported in tokens a second. It reports
#   no bandwidth and no roofline; the fraction of one is ours.
# * **vLLM**'s `vllm bench latency` (`vllm/benchmarks/latency.py`) times whole `LLM.generate`
#   calls: `--batch-size` prompts (8) of `--input-len` random tokens (32) generating
#   `--output-len` tokens (128) with `ignore_eos`, after `--num-iters-warmup` (10) and over
#   `--num-iters` (30), and prints the average and percentiles of the latency in seconds, with
#   the prefill inside; `--disable-detokenize` takes detokenization out. Our `decode_rate`
#   subtracts a one-token run instead, so what is left is decode alone.
# * **nano-vllm**'s `bench.py` measures the other regime: 256 sequences of 100 to 1,024 random
#   prompt tokens and as many output tokens, all submitted at once, and one line of throughput
#   in tokens a second. At that batch size the weights are read once per step for many tokens
#   and the batch-1 roofline stops applying, which is where Phase 3 goes.
#
# ## Try it
#
# 1. **Break the byte count on purpose.** Replace the script's count with the state-dict one,
#    `roofline.weight_bytes = lambda m: sum(t.numel() * t.element_size() for t in
#    m.state_dict().values())`, and rerun section 1's gate cell with
#    `check_weight_bytes(roofline.weight_bytes(model), model)`: it raises, `counted 651,306,240
#    bytes; the model's storages hold 538,060,032`. Rerun section 3 and every `roofline_tok_s`
#    drops by the same 17%.
# 2. **Price another precision before measuring it.** Write `int8_bytes(model)`, the bytes a
#    token would read with int8 matrices: one byte for each element of a 2-D weight plus a 4-byte
#    fp32 scale for each of its rows, the norm vectors left in fp32, and every distinct tensor
#    once. `assert int8_bytes(model) == 135_439_104`: section 1's printed sizes give the shapes
#    behind that number, and counting the tied head twice, leaving out the scales or rounding
#    the norms to one byte each makes the assert fail. The int8 roofline is then
#    `weights / int8_bytes(model)` times the fp32 one at the same bandwidth, a little under
#    four because of the scales and the norms. Then compare the fp32 and bf16 rows of
#    section 3: how much of the doubling from fp32 to bf16 did the measured rate keep?
# 3. **Your machine.** `python days/day12/roofline.py --threads 1 2 4 --out-roofline /tmp/r.csv
#    --out-linear /tmp/l.csv` on a machine with more cores, and compare its first line (the CPU)
#    and its `fraction` column with `day-12-roofline.csv`. Every `weight_mb` must still read
#    538.1 and 269.0, and no `fraction` should exceed 1: a rate above the roofline means the
#    bandwidth test or the byte count is wrong.

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
# # Day 58 — Attention without padded copies
#
# Since Day 18, a decode step has read the paged pools in two moves. First, in every layer, it
# copies each row's slot window into a fresh K tensor and a fresh V tensor, every row stretched
# to the width of the widest one (to its width bucket, once Day 52's buckets are on). Then SDPA
# reads that copy once more, with a mask that hides everything past each row's own length. The
# copy is pure overhead: the keys were already in memory, just not side by side, and a short
# row next to a long one pays for slots it will mask away.
#
# PyTorch has no operator that attends through an index table, so a pure-PyTorch engine cannot
# avoid the copy; the fix has to be a kernel of its own. `nanoserve/csrc/paged_attention.cpp`
# is that kernel: for each row and each K/V head it walks the row's window only up to the row's
# context length, reads every key and value once from where it lies in the pool, and serves
# all query heads of that K/V head's group from the same load. `nanoserve.kernels.native()`
# compiles it on first use; `engine_config(58, attention=...)` and `nanoserve serve --attention` choose
# between `"native"`, `"gather"` (the earlier way, kept runnable under that name) and `"auto"`.
#
# 1. what the gather path copies, against what the kernel reads, for SmolLM2's shape,
# 2. the kernel's arithmetic in a few lines of Python, asserted equal to the kernel and to the
#    gather path,
# 3. one layer's decode attention timed both ways (`days/day58/inplace.py`),
# 4. a whole SmolLM2 decode step at 16 rows both ways, and what the profiler sees,
# 5. greedy tokens of both engines against the eager reference,
# 6. the equality check failing on kernels called wrongly,
# 7. where the kernel comes from and what happens where it cannot be built,
# 8. the diagram.

# %%
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

import nanoserve.kernels as kernels
from nanocourse import REPO, as_text, diagram_path, engine_config, read_csv, same_or_near_tie, show
from nanoserve.bench import cpu_line
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day58"))
import inplace  # the day's script: the notebook calls its functions and prints its tables

torch.manual_seed(0)
torch.set_num_threads(2)
print(cpu_line())
print("native kernel:", kernels.native_status())
MODEL_DIR = fetch_default_model()
t0 = time.perf_counter()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
print(f"SmolLM2-135M-Instruct, fp32, loaded in {time.perf_counter() - t0:.1f} s")
cfg = model.cfg
print(
    f"layers {cfg.num_layers}, query heads {cfg.num_heads}, K/V heads {cfg.num_kv_heads}, "
    f"head_dim {cfg.head_dim}"
)
assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
    inplace.LAYERS, inplace.HEADS, inplace.KV_HEADS, inplace.HEAD_DIM,
)  # fmt: skip


# %% [markdown]
# ## 1. What the gather path moves
#
# Take R rows with context lengths L_r and a window width W, the widest row's blocks. Per layer,
# the gather path writes a K copy and a V copy of R x W slots, each slot kv_heads x head_dim
# fp32 numbers: 2 x R x W x kv_heads x head_dim x 4 bytes, and SDPA then reads all of it back.
# The kernel reads 2 x sum(L_r) x kv_heads x head_dim x 4 bytes from the pools and writes
# nothing but the output. A small batch first: four rows of 3, 17, 40 and 64 tokens.

# %%
small = [3, 17, 40, 64]
w = inplace.width_of(small)
print(f"lengths {small}: width {w}, slots copied {len(small) * w}, slots the kernel reads {sum(small)}")
print(
    f"per layer: copied {inplace.copied_bytes(small):,} bytes, "
    f"read in place {inplace.read_bytes(small):,} bytes"
)
assert inplace.copied_bytes(small) == 2 * 4 * 64 * 3 * 64 * 4  # 2 x R x W x kv_heads x head_dim x 4
assert inplace.read_bytes(small) == 2 * 124 * 3 * 64 * 4  # 2 x sum(L) x kv_heads x head_dim x 4

# %% [markdown]
# The day's batch has 16 rows. A batch whose requests arrived at different times has its rows
# spread over many lengths; `ragged_lens` spreads them evenly, row r holding C x (r + 1) / 16
# tokens for a widest context C, so the lengths add up to 8.5 C against the 16 C slots the
# padded copy holds. Next to it, the case with no padding at all: every row at C. The table
# is `bytes_table`, equal to the committed CSV; the `_step` columns multiply by 30 layers.

# %%
print("ragged_lens(64):", inplace.ragged_lens(64))
table = inplace.bytes_table()
assert as_text(table) == read_csv(inplace.HERE / "day-58-bytes.csv")
show(table, ["rows", "widest", "width", "sum_len", "copied_mb_step", "kernel_mb_step", "ratio"])

# %% [markdown]
# For ragged rows the copy is 1.88 times the bytes the step needs, at every context: padding
# grows in proportion to the context. With every row equally long the two are the same size;
# even then the gather path writes those bytes out again as a copy and SDPA reads them a
# second time, so its traffic stays at least three passes over them (read, write, read)
# against the kernel's one. At C = 2048 the ragged batch copies 1509.9 MB per decode step,
# for one token per row.

# %% [markdown]
# ## 2. The kernel's arithmetic, in Python
#
# For each row: take the first L_r entries of its window, fetch those slots' keys and values,
# give query head h the K/V head h // group (grouped-query attention, group = 9 / 3 = 3 here),
# then softmax(q k^T / sqrt(d)) v. A row of context 0 (a padded row of a bucket) reads nothing
# and stays zero. This version indexes the pool per row, so it is the math, not the memory
# pattern; the C++ loop does the same sums reading each slot in place, and loads each K/V row
# once for the 3 query heads that share it.


# %%
def decode_reference(q, k_pool, v_pool, window, context_lens):
    """q (B, heads, hd); pools (slots, kv_heads, hd); window (B, W); context_lens (B,)."""
    rows, heads, hd = q.shape
    group = heads // k_pool.shape[1]
    out = torch.zeros_like(q)
    for r in range(rows):
        n = int(context_lens[r])
        if n == 0:
            continue  # nothing to attend to: zeros
        slots = window[r, :n]  # (n,) the row's own slots, none past its length
        k = k_pool[slots].repeat_interleave(group, dim=1)  # (n, heads, hd): head h sees K/V head h // group
        v = v_pool[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[r], k) / hd**0.5  # (heads, n)
        out[r] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)  # (heads, hd)
    return out


# %% [markdown]
# The test batch: eight rows, lengths from 0 to 200, over random pools with SmolLM2's head
# shape. `attention_caches` gives a gather cache and a native cache over the very same pools,
# and a window made by the package's `plan.slot_window` from block lists: each row owns whole
# blocks of 16 consecutive slots drawn at random, and a row's window is padded with block 0's
# slots up to the widest row, as in a real step.

# %%
lens = [0, 1, 5, 16, 17, 64, 130, 200]
caches, window, ctx, q = inplace.attention_caches(lens, seed=1)
k_pool, v_pool = caches["native"].k[0], caches["native"].v[0]
print("q", tuple(q.shape), " pools", tuple(k_pool.shape), " window", tuple(window.shape))
print("row 4 (17 tokens), window entries 0-19:", window[4, :20].tolist())
for r, n in enumerate(lens):
    print(f"row {r}: context {n:>3}: the kernel reads {n:>3} slots, the gather path copies {window.shape[1]}")

# %%
# NBVAL_IGNORE_OUTPUT
# (the differences are rounding: their last digits depend on how the compiler vectorised the kernel
# for this CPU and on which vector width SDPA picks here; the asserts hold anywhere)
with torch.inference_mode():
    ref = decode_reference(q, k_pool, v_pool, window, ctx)
    kernel = kernels.native().decode_attention(q, k_pool, v_pool, window, ctx, cfg.head_dim**-0.5)
    via_cache = caches["native"]._one_query_rows(0, q, window, ctx)
    gathered = caches["gather"]._one_query_rows(0, q, window, ctx)
TOL = 1e-5  # fp32: sums of up to 200 terms in a different order


def check_close(label, got, want, tol=TOL):
    diff = (got - want).abs().max().item()
    if not diff < tol:
        raise AssertionError(f"{label}: max |difference| {diff:.1e} exceeds {tol:.0e}")
    return diff


pairs = [("native kernel", kernel), ("cache, attention='native'", via_cache), ("gather path", gathered)]
for label, got in pairs:
    print(f"reference vs {label:<26} max |difference| {check_close(label, got, ref):.1e}")
assert torch.equal(kernel, via_cache)  # the cache calls the kernel with nothing in between
assert (kernel[0] == 0).all() and (gathered[0] == 0).all()
print("row 0 (context 0): all zeros from the kernel and from the gather path")

# %% [markdown]
# The kernel and the Python loop agree to within a few units of fp32 rounding, and so do the
# kernel and the gather path it replaces; the tolerance `TOL` is 1e-5. The cache's native path
# is the kernel itself, bit for bit.
#
# ## 3. One layer, timed
#
# `layer_times` times one layer's decode attention over 16 ragged rows both ways, the two calls
# taking turns, and keeps each one's best time: other jobs share this machine, and the least
# time is the one they disturbed least. A live run at C = 512, then the script's table over
# C = 64 to 2048 (30 turns each, one run of `inplace.py`).

# %%
t = inplace.layer_times(512, reps=5)
print(f"C = 512, one layer: gather {t['gather'] * 1e3:.2f} ms, native {t['native'] * 1e3:.2f} ms")
layer = read_csv(inplace.HERE / "day-58-attention.csv")
show(layer, ["widest", "width", "gather_ms", "native_ms", "speedup"])

# %% [markdown]
# The script's run was made on a 2-core AVX-512 EPYC, 2 threads, as the CSV's `cpu` column
# says ("torch capability AVX512, flags avx2 avx512f avx512_bf16"). The kernel was faster at
# every context, by 3.01x to 13.32x (`speedup`, gather time over native time, both from the
# same run). The bytes table alone predicts 1.88x; the copy's write and SDPA's second read add
# to the gather side. The ratio is far from smooth in C. Up to C = 256 it stayed between 3.09x
# and 4.08x, both times under 0.3 ms. From C = 256 to 512 the gather time jumped from 0.273 ms
# to 3.408 ms while the kernel's went from 0.089 ms to 0.256 ms, which gives 13.32x at 512 and
# 9.67x at 1024; at 2048 the ratio came back down to 3.01x, with a gather best (5.763 ms) below
# the one at 1024 (8.481 ms). One layer's padded copy is 6.29 MB at C = 256 and 12.58 MB at 512
# (`copied_mb_layer` in the bytes CSV); the table cannot say what makes the gather path step up
# there, and gather times that fall from 1024 to 2048 say its widest points are the least
# steady. The live line above takes 5 turns on a machine shared with other jobs, so its
# milliseconds need not match the table's.

# %% [markdown]
# ## 4. A whole decode step on SmolLM2
#
# Attention is one part of a step; the matmuls of 30 layers are the rest. `prefilled_engine`
# builds an engine over SmolLM2 (fp32, 2 threads) with 16 rows at `ragged_lens(C)`, random
# prompts and prefix caching off so that no two rows share a block, and prefills them all.
# Then `step_times` runs decode steps, switching the cache's `attention` between `"gather"` and
# `"native"` from one step to the next: the same batch over the same pools both ways. Only
# decode rows consult that setting (a prompt row's mask memo does too, and every prompt is
# done by then), so each step is the one an engine built with that `attention` would take.
# Live at C = 32 (16 rows of 2 to 32 tokens), as far as this notebook can afford to prefill:

# %%
eng = inplace.prefilled_engine(model, 32, steps=8)
running = eng.scheduler.running
print("running rows:", len(running), " decode contexts:", sorted(len(s.token_ids) for s in running))
t = inplace.step_times(eng, reps=1)
print(f"C = 32, one decode step: gather {t['gather'] * 1e3:.0f} ms, native {t['native'] * 1e3:.0f} ms")

# %% [markdown]
# What the profiler sees in one step of each. The kernel is a C++ call that torch.profiler does
# not name, so `label_attention` wraps the cache's decode-attention call in a label, "decode
# attention", for both ways. The op counts are the same every run; the times are this run's.

# %%
inplace.label_attention(eng)
OPS = [
    "decode attention",
    "aten::index_select",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::where",
    "aten::bmm",
]
for kind in ("gather", "native"):
    ops, aten = inplace.profile_step(eng, kind, top=1000)
    by_name = {o["op"]: o for o in ops}
    print(f"attention={kind}: {aten:,} aten ops in the step")
    for name in OPS:
        o = by_name.get(name)
        print(f"   {name:<50} " + (f"{o['calls']:>4} calls  {o['self_ms']:.1f} ms self" if o else "   -"))

# %% [markdown]
# The gather step runs 60 `index_select`s (K and V in each of 30 layers), 30 SDPA calls and the
# masking ops around them; the native step runs none of them, and the "decode attention" label
# holds the kernel's own time instead. The script's run at larger contexts, and the top six ops
# by self time of one step of each at C = 1024:

# %%
steps = read_csv(inplace.HERE / "day-58-step.csv")
show(steps, ["widest", "sum_len", "gather_ms", "native_ms", "speedup"])
profile = read_csv(inplace.HERE / "day-58-profile.csv")
show(profile, ["attention", "rank", "op", "calls", "self_ms", "aten_ops"])
ATTENTION_OPS = ("decode attention", "aten::index_select", OPS[2])  # OPS[2]: the SDPA kernel
aten_ops = {}
for kind in ("gather", "native"):
    top = [r for r in profile if r["attention"] == kind]
    attention_ms = sum(float(r["self_ms"]) for r in top if r["op"] in ATTENTION_OPS)
    bmm_ms = next(float(r["self_ms"]) for r in top if r["op"] == "aten::bmm")
    aten_ops[kind] = int(top[0]["aten_ops"])
    print(f"{kind}: attention's entries {attention_ms:.1f} ms self, aten::bmm {bmm_ms:.1f} ms self")
fewer = aten_ops["gather"] - aten_ops["native"]
print(f"aten ops in a step: gather {aten_ops['gather']:,}, native {aten_ops['native']:,}: "
      f"{fewer // inplace.LAYERS} fewer per layer")  # fmt: skip
assert fewer % inplace.LAYERS == 0

# %% [markdown]
# Over a whole step the kernel gains too, and more the wider the context: 1.10x at C = 128,
# 1.40x at 512 and 2.07x at 1024, where a step went from 137.8 ms to 66.7 ms. The profile at
# C = 1024 shows why. In the gather step attention is three entries, the SDPA kernel (23.1 ms),
# `index_select` (17.3 ms) and the label's own share (4.0 ms), together 44.4 ms of self time:
# more than `aten::bmm`, the matmuls of 30 layers and the logits, at 38.5 ms. In the native step
# it is one entry, the label, which holds the kernel's 11.5 ms. `aten::bmm` does the same work
# in both steps and took 31.0 ms in the native one; a single profiled step cannot say whether
# the copy's traffic slowed the matmuls or that gap is run-to-run. The aten ops in a step fall
# from 7,416 to 5,376, 68 fewer per layer. The copied bytes grow with the context (section 1)
# and the matmuls' work per step does not, which is why the step's gain grows with C.

# %% [markdown]
# ## 5. Same tokens
#
# Three chat prompts, 10 greedy tokens each, through an engine with `attention="native"` and one
# with `attention="gather"`, against the eager reference `greedy_tokens` (contiguous cache, one
# sequence at a time). As in `tests/test_engine.py`, a difference would be excused only at a
# proven near-tie: where the reference's top two logits at the first differing position are
# within 1e-4 of each other.

# %%
QUESTIONS = ("What is 2 + 2?", "Name a colour.", "What is a cache?")
prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in QUESTIONS]
N = 10
with torch.inference_mode():
    eager = [greedy_tokens(model, p, N) for p in prompts]
params = SamplingParams(max_tokens=N, ignore_eos=True)
results = {}
for kind in ("native", "gather"):
    config = engine_config(58, max_batch=4, max_model_len=128, kv_budget="16MiB", attention=kind)
    e = Engine(model, tok, config)
    assert e.cache.attention == kind
    results[kind] = [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)]
for i, p in enumerate(prompts):
    verdicts = [same_or_near_tie(model, p, eager[i], results[kind][i]) for kind in ("native", "gather")]
    print(f"{QUESTIONS[i]!r:<20} native: {verdicts[0]}, gather: {verdicts[1]}   {tok.decode(eager[i])!r}")

# %% [markdown]
# ## 6. The check, failing
#
# Two ways to call the kernel wrongly, each a plausible off-by-one: context lengths one too
# long (every row reads one slot past its end, which holds someone else's key or a stale one),
# and a window shifted by one slot (every row reads the slot after each of its own). The same
# `check_close` that passed in section 2 has to refuse both.

# %%
scale = cfg.head_dim**-0.5
kernel_call = kernels.native().decode_attention
wrong = {
    "context_lens + 1": kernel_call(q, k_pool, v_pool, window, ctx + 1, scale),
    "window shifted by one slot": kernel_call(q, k_pool, v_pool, window + 1, ctx, scale),
}
for label, got in wrong.items():
    try:
        check_close(label, got, ref)
    except AssertionError as e:
        print("caught:", e)
    else:
        raise AssertionError(f"{label} passed the equality check")

# %% [markdown]
# ## 7. Where the kernel comes from
#
# `native()` hands `csrc/paged_attention.cpp` to `torch.utils.cpp_extension.load`, which
# compiles it with this machine's C++ compiler into torch's extension cache the first time a
# process asks and loads the cached build after that. The flags include `-march=native`: the
# compiler may use every vector instruction this CPU has (AVX-512 here, per the line below), so
# the build belongs to this kind of machine and might not run on an older one; that is why it
# is built where it runs and not shipped as a binary. Where there is no compiler, or the build
# fails, or `NANOSERVE_NATIVE=0` is set, `native()` returns None: `"auto"` then quietly takes
# the gather path, and `"native"` refuses with a sentence. The cell fakes a failed build for a
# moment to show both.

# %%
print(cpu_line())
print("native_status():", kernels.native_status())
print("engine_config(58).attention:", engine_config(58).attention, "->",
      BatchedPagedKVCache(cfg, 64).attention)  # fmt: skip
saved = kernels._ext, kernels._status
try:
    kernels._ext, kernels._status = None, "unavailable (no compiler, faked by this cell)"
    print("build failed: attention='auto' ->", BatchedPagedKVCache(cfg, 64, attention="auto").attention)
    try:
        BatchedPagedKVCache(cfg, 64, attention="native")
    except ValueError as e:
        print("build failed: attention='native' ->", e)
finally:
    kernels._ext, kernels._status = saved
assert BatchedPagedKVCache(cfg, 64, attention="auto").attention == "native"
try:
    engine_config(58, attention="fast").validate()
except ValueError as e:
    print("engine_config(58, attention='fast'):", e)

# %% [markdown]
# ## 8. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(14, 10))
fig.suptitle("Day 58: decode attention read in place (16 rows, SmolLM2-135M shape, fp32)", fontsize=13)

# top left: one batch's windows, the padding the copy carries crossed out
ax = axes[0, 0]
demo = inplace.ragged_lens(256)
W = inplace.width_of(demo)
for r, n in enumerate(demo):
    ax.barh(r, n, color="tab:green", height=0.8)
    ax.barh(r, W - n, left=n, color="white", edgecolor="tab:red", hatch="xx", height=0.8, linewidth=0.5)
ax.set_xlim(0, W)
ax.set_ylim(15.6, -0.6)
ax.set_xlabel("window position (slots)")
ax.set_ylabel("row")
ax.set_title(
    f"C = 256: green the kernel reads ({sum(demo)} slots);\n"
    f"hatched the copy also carries ({16 * W - sum(demo)} slots)"
)

# top right: bytes per decode step
ax = axes[0, 1]
for shape, style in (("ragged", "-"), ("uniform", ":")):
    rows = [r for r in table if r["rows"] == shape]
    cs = [r["widest"] for r in rows]
    copied = [float(r["copied_mb_step"]) for r in rows]
    read = [float(r["kernel_mb_step"]) for r in rows]
    ax.plot(cs, copied, "o" + style, color="tab:red", label=f"gather copies, {shape}")
    ax.plot(cs, read, "s" + style, color="tab:green", label=f"kernel reads, {shape}")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("widest context C")
ax.set_ylabel("MB per decode step (30 layers, K and V)")
ax.set_title("bytes: the copy against the in-place read")
ax.legend(fontsize=8)

# bottom left: one layer timed, and the ratio
ax = axes[1, 0]
cs = [int(r["widest"]) for r in layer]
ax.plot(cs, [float(r["gather_ms"]) for r in layer], "o-", color="tab:red", label="gather + SDPA")
ax.plot(cs, [float(r["native_ms"]) for r in layer], "s-", color="tab:green", label="native kernel")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("widest context C")
ax.set_ylabel("ms, one layer (best of 30)")
ax2 = ax.twinx()
ax2.plot(cs, [float(r["speedup"]) for r in layer], "d--", color="black", label="gather / native")
ax2.set_ylabel("gather / native")
ax2.set_ylim(0, None)
ax.set_title("one layer's decode attention, 16 rows")
ax.legend(loc="upper left", fontsize=8)
ax2.legend(loc="lower right", fontsize=8)

# bottom right: the whole step
ax = axes[1, 1]
cs = [r["widest"] for r in steps]
x = range(len(cs))
ax.bar([i - 0.2 for i in x], [float(r["gather_ms"]) for r in steps], 0.4, color="tab:red", label="gather")
ax.bar([i + 0.2 for i in x], [float(r["native_ms"]) for r in steps], 0.4, color="tab:green", label="native")
for i, r in enumerate(steps):
    ax.text(i, max(float(r["gather_ms"]), float(r["native_ms"])) * 1.02, f"x{r['speedup']}", ha="center")
ax.set_xticks(list(x), [f"C = {c}" for c in cs])
ax.set_ylabel("ms per decode step (best of the run)")
ax.set_title("a whole SmolLM2 decode step, 16 rows, 2 threads")
ax.legend(fontsize=8)

fig.tight_layout()
out = diagram_path("day58-inplace.png")
fig.savefig(out, dpi=80)
plt.close(fig)
display(Image(filename=str(out)))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** was built around this kernel. Its `paged_attention_v1` and `v2` kernels
#   (`csrc/attention/`) take the query, the block-shaped key and value caches, a `block_tables`
#   tensor of shape (num_seqs, max_blocks_per_seq) and `seq_lens`, and each thread block walks
#   one sequence's table, loading K/V blocks in place; v2 splits long contexts into partitions
#   and merges their partial softmaxes in a second pass. The CPU build has its own C++ version
#   (`csrc/cpu/attention.cpp`, `paged_attention_v1_impl`) with the same arguments. The key cache
#   layout `[num_blocks, kv_heads, head_size/x, block_size, x]` is chosen for vectorised loads;
#   ours keeps Day 16's `(slots, kv_heads, head_dim)` and indexes by slot.
# * **FlashAttention-2** (`flash_attn_with_kvcache(..., cache_seqlens=..., block_table=...)`) and
#   **FlashInfer** (`BatchDecodeWithPagedKVCacheWrapper`, with the table in CSR form:
#   `paged_kv_indptr`, `paged_kv_indices`, `paged_kv_last_page_len`) read paged K/V the same
#   way on GPUs; SGLang's attention backends hand FlashInfer or Triton kernels a per-token index
#   list, and TensorRT-LLM's generation kernels (XQA for grouped-query heads) read its paged
#   cache through per-sequence block offsets.
# * **llama.cpp** keeps one buffer of KV cells per layer, each tagged with the sequences it
#   belongs to. Nothing is copied per sequence: the batch attends over the range of cells in use
#   (padded to a multiple of 256) with a mask built per step that blocks every cell of another
#   sequence. So it avoids the copy but not the masked reads, the cost our kernel skips by
#   stopping at each row's own length.
# * Why a kernel at all: PyTorch's attention ops want K and V as dense tensors, and indexing a
#   tensor by a slot table always materialises a new tensor. Without writing a kernel (C++, CUDA,
#   Triton), an engine in PyTorch has the copy or nothing, which is what days 18 to 57 had.

# %% [markdown]
# ## Try it
#
# 1. Break the kernel on purpose: in `csrc/paged_attention.cpp`, change
#    `std::min<int64_t>(cp[b], width)` to `cp[b] + 1`, then run
#    `pytest tests/test_kernels.py` (the build takes about a minute) and this notebook's
#    section 2. `check_close` must fail with a difference far above 1e-5. Undo the change.
# 2. Give every row the same length, `[512] * 16` instead of `ragged_lens(512)`. Predict
#    first, then check: `inplace.copied_bytes([512] * 16) == inplace.read_bytes([512] * 16)`,
#    since a full window carries no padding. Whatever speedup `layer_times` then still shows
#    is the cost of the copy and the second pass alone.
# 3. Run with `NANOSERVE_NATIVE=0` set: `native_status()` must say `off`, an engine with
#    `attention="auto"` must report `cache.attention == "gather"`, and section 5's tokens must
#    not change.

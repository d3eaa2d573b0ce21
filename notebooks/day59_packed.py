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
# # Day 59 — Packed weights and a vector kernel: the 16-row decode step
#
# Yesterday's profile ended on matmuls. With decode attention read in place, a 16-row decode
# step of SmolLM2 spends most of its time in 121 matrix products: four per block over 30
# blocks, and the head, which maps 576 numbers onto 49,152 logits and is by far the largest
# single matrix in the model. Day 12's `linear` runs each product on the weight exactly as it
# was loaded, a row-major (out, in) matrix (on several threads split into one slab per thread,
# on one thread a single `F.linear`). A GEMM library handed a matrix in the caller's layout
# typically copies it, panel by panel, into the order its inner loop reads, and it does that
# again on every call, because nothing tells it the matrix is the same one as last time.
#
# A model's weights never change while it serves, so that copy can be made once, at load.
# `model.pack_linears` asks oneDNN, the CPU library behind PyTorch's mkldnn ops, to reorder
# every block matrix and the head into the layout its GEMM wants for this CPU, and `linear`
# hands such a weight straight to `torch.ops.mkldnn._linear_pointwise`. The engine does it at
# startup (`engine_config(59, linear="auto" | "packed" | "plain")`, `nanoserve serve --linear`);
# `"plain"` keeps Day 12's path as the named variant. The same day, the decode-attention
# kernel of Day 58 gained a build in AVX2 intrinsics for head_dim 64.
#
# 1. the matrices of a step by size, and where a plain step's time goes,
# 2. packing one weight: what the bytes become, the product over them in a few lines, and
#    oneDNN's result against `x @ w.T`,
# 3. one step's linears, plain against packed, at 1 to 64 rows (`days/day59/packbench.py`), and
#    why this day measures on one thread,
# 4. the attention kernel: its bytes and flops, and one layer timed against the gather path,
# 5. a whole 16-row step of SmolLM2, plain and packed: time by part, the profiler, a mixed step,
# 6. greedy tokens of both engines against the eager reference,
# 7. checks failing on weights packed wrong, and where packing is refused,
# 8. the diagram.

# %%
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, engine_config, read_csv, same_or_near_tie, show, tiny_config
from nanoserve.bench import cpu_line
from nanoserve.contiguous import NoCache
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.kernels import native
from nanoserve.models import Llama, linear, load_model, pack_linears, packing_status
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day59"))
import packbench  # the day's script: the notebook calls its functions and reads its tables

torch.manual_seed(0)
torch.set_num_threads(1)  # one thread: section 3 says why
print(cpu_line())
MODEL_DIR = fetch_default_model()
t0 = time.perf_counter()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
print(f"SmolLM2-135M-Instruct, fp32, loaded in {time.perf_counter() - t0:.1f} s")
cfg = model.cfg
assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers) == (
    packbench.HIDDEN, packbench.INTER, packbench.VOCAB, packbench.LAYERS,
)  # fmt: skip


# %% [markdown]
# ## 1. The matrices of a step
#
# Every decode step multiplies each row's hidden state by every one of these matrices once.
# fp32 weights, so a row count of 1 reads 4 bytes per multiply-add: the step is a walk over
# all of them.

# %%
mats = {name: tuple(getattr(model.blocks[0], name).shape) for name in packbench.SHAPES}
mats["head"] = tuple(model.head.shape)
total = sum(cfg.num_layers * o * i for n, (o, i) in mats.items() if n != "head") + 49152 * 576
print(f"{'matrix':<8} {'(out, in)':<14} {'per step':>9} {'weights':>12} {'MB':>7} {'share':>6}")
for name, (o, i) in mats.items():
    count = 1 if name == "head" else cfg.num_layers
    n = count * o * i
    print(f"{name:<8} {str((o, i)):<14} {count:>8}x {n:>12,} {n * 4 / 1e6:>7.1f} {n / total:>6.1%}")
print(f"{'all':<8} {'':<14} {4 * cfg.num_layers + 1:>8}x {total:>12,} {total * 4 / 1e6:>7.1f}")
assert mats["head"] == (49152, 576) and total == packbench.block_params() + 49152 * 576

# %% [markdown]
# The head is one matrix of 28,311,552 weights, 16 times the largest block matrix
# (`gate_up`) and a fifth of everything a step reads. SmolLM2 ties it to the embedding, so on
# disk it is the same tensor as the token lookup table. Where the time of a plain 16-row decode
# step goes, from the script's run (section 5 has the whole table):

# %%
step = read_csv(packbench.HERE / "day-59-step.csv")
for r in step:
    if r["step"] == "decode" and r["linear"] == "plain":
        ms = {k: float(r[k + "_ms"]) for k in ("linears", "head", "attention", "rest")}
        shares = ", ".join(f"{k} {v / float(r['step_ms']):.0%}" for k, v in ms.items())
        print(f"plain decode step, C = {r['widest']}: {r['step_ms']} ms: {shares}")

# %% [markdown]
# ## 2. Packing one weight
#
# `pack_linears` does this to each matrix: `torch.ops.mkldnn._reorder_linear_weight(w, rows)`,
# where `rows` is the batch size the layout is chosen for (the engine passes `max_batch`, here
# 16). What comes back is an opaque oneDNN tensor: same shape, layout `torch._mkldnn`, no view
# of it in PyTorch. oneDNN's verbose log says which order it chose; `packbench.onednn_log`
# captures it.

# %%
w = model.blocks[0].qkv.detach()  # (960, 576): q, k and v of block 0
p = packbench.pack(w, 16)
print("packed:", tuple(p.shape), p.dtype, p.layout, " is_mkldnn:", p.is_mkldnn)
for rows in (1, 16):
    (line,) = packbench.onednn_log(lambda rows=rows: packbench.pack(w, rows))
    print(f"reorder for {rows:>2} rows: {line.split(',')[1]}, weight layout {packbench.weight_layout(line)}")

# %% [markdown]
# For one row oneDNN keeps the plain row-major order (`ab`); for 16 it picks `AB16b64a`. In
# oneDNN's notation the capital letters are the outer order, output tiles (A) then input tiles
# (B), and `16b64a` is the inside of a tile: 16 inputs, each with 64 outputs side by side. In
# PyTorch terms that is a view and a permute, written out in `packbench.tiles`. Reading the
# packed tensor's memory (`packbench.packed_floats`, through its data pointer) shows it is
# exactly that permutation of the weight, bit for bit, with the first 64 floats being input
# 0's weights for outputs 0 to 63:

# %%
t = packbench.tiles(w)  # (out/64, in/16, 16, 64)
raw = packbench.packed_floats(p)
print("tiles:", tuple(t.shape), " packed floats:", raw.numel(), " plain floats:", w.numel())
assert torch.equal(raw, t.reshape(-1))  # the packed bytes are w.view(15, 64, 36, 16).permute(0, 2, 3, 1)
assert torch.equal(raw[:64], w[:64, 0]) and torch.equal(raw[64:128], w[:64, 1])
assert torch.equal(raw[1024:1088], w[:64, 16])  # after 16 inputs: the next input tile
assert torch.equal(packbench.packed_floats(packbench.pack(w, 1)), w.reshape(-1))  # 1 row: as loaded
assert torch.equal(p.to_dense(), w)  # and the reorder is undone exactly
print("memory [0:4]    =", [round(v, 4) for v in raw[:4].tolist()], "= w[0:4, 0]")
print("memory [64:68]  =", [round(v, 4) for v in raw[64:68].tolist()], "= w[0:4, 1]")

# %% [markdown]
# Why 64 outputs by 16 inputs: 64 floats are 4 AVX-512 registers of 16 (the kernel oneDNN ran
# here, named in the line above) or 8 AVX2 registers of 8. The inner loop broadcasts one input
# value of one row and adds it, times 64 consecutive weights, into those accumulators; the next
# input's 64 weights follow in memory, so the
# weights stream through in the order they are used. The product over tiles, in plain lines:
# for each output tile and each input tile, a (rows, 16) by (16, 64) product, summed over the
# input tiles.


# %%
def tiled_linear(x, t):
    """x (M, in) times the tiled weight t (out/64, in/16, 16, 64): y (M, out)."""
    m, a, b = x.shape[0], t.shape[0], t.shape[1]
    xb = x.view(m, b, 16)  # (M, in tiles, 16)
    y = torch.einsum("mbi,abij->maj", xb, t)  # (M, out tiles, 64): sum over b and i
    return y.reshape(m, a * 64)


x = torch.randn(16, 576)
want = x @ w.T  # (16, 960)
exact = x.double() @ w.double().T  # float64, for scale
with torch.inference_mode():
    y_pointwise = torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    y_linear = linear(x, p)  # what the engine calls: it sees w.is_mkldnn and goes to oneDNN
    y_plain = linear(x, w)  # Day 12's path
(ip,) = packbench.onednn_log(lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
kind, impl, *_, problem = ip.split(",")
print(f"oneDNN ran: {kind}, {impl}, weights {packbench.weight_layout(ip)}, {problem}")
TOL = 1e-4  # fp32, sums of 576 products with values up to ~70, in another order


def check_close(label, got, ref, tol=TOL):
    diff = (got - ref).abs().max().item()
    if not diff < tol:
        raise AssertionError(f"{label}: max |difference| {diff:.1e} exceeds {tol:.0e}")
    return diff


assert torch.equal(y_linear, y_pointwise)
print(f"largest |x @ w.T|: {want.abs().max().item():.1f}")
results = {"tiled_linear": tiled_linear(x, t), "oneDNN, packed": y_pointwise, "plain linear": y_plain}
for label, got in results.items():
    d64 = (got.double() - exact).abs().max().item()
    print(f"{label:<15} vs x @ w.T: {check_close(label, got, want):.1e}   vs float64: {d64:.1e}")

# %% [markdown]
# All three are within `TOL` = 1e-4 of `x @ w.T`. The tiled loop and the plain path land on
# exactly the same bits as `x @ w.T` here; oneDNN's packed product does not, off by 3.1e-05.
# It sums the same 576 products per output, but in another order and grouping, and fp32 rounds
# after every addition, so the last bits depend on the order. Against the float64 product
# neither answer is exact: the plain one is off by 1.7e-05, the packed one by 3.8e-05, on
# outputs as large as 58.4, so both errors sit in the seventh significant digit. That is all
# packing changes in the numbers, and it is why section 6 compares tokens with the near-tie
# rule rather than asking for equality.

# %% [markdown]
# ## 3. One step's linears, plain against packed
#
# First, a word on threads. `threads_table` times single calls of one linear at 1 row (30
# distinct 3072 x 576 matrices, 4 passes) on one thread and on two. The script ran on a quiet
# 2-core AVX-512 EPYC, as its CSVs' `cpu` column says ("torch capability AVX512, flags avx2
# avx512f avx512_bf16, mkldnn bf16 yes"), and there two threads were faster: the median plain
# call went from 0.40 ms to 0.22 ms, the packed one from 0.20 ms to 0.17 ms. A call on two
# threads is one parallel region, though, and it ends only when both threads have done their
# halves; where other jobs hold the cores, as they can while this notebook runs, the second
# thread waits for one. So this notebook and the script's other tables stay on one thread, the
# script's default (`--threads 2` is there for a quiet machine), and every comparison below is
# core for core. On one thread Day 12's `linear` is a single `F.linear`, which is still the plain
# variant: the weight as loaded. Even this table shows packing at work: on one thread the
# packed call's median was half the plain one's.

# %%
threads = read_csv(packbench.HERE / "day-59-threads.csv")
show(threads, ["threads", "linear", "calls", "min_ms", "median_ms", "p90_ms", "max_ms", "total_ms"])

# %% [markdown]
# `packbench.linear_times(rows, weights, reps)` runs every block matrix in layer order and then
# the head, once with the plain weights and once with the packed ones, the two passes taking
# turns, and keeps each part's best time. Live, on SmolLM2's own head at 16 rows. The packed
# twin copies the module tree and shares the tensors, so `model` stays plain (section 5 says
# why it must).

# %%
packed = packbench.packed_twin(model, rows=16)
print("plain head is_mkldnn:", model.head.is_mkldnn, "  packed twin's:", packed.head.is_mkldnn)
print("embedding shared:", packed.embed is model.embed, "  norms shared:", packed.norm is model.norm)
heads = {"plain": ([], model.head), "packed": ([], packed.head)}  # no block matrices: the head alone
best = packbench.linear_times(16, heads, reps=3)
for kind, (_, head_s) in best.items():
    print(f"16 rows, the head, {kind:<6}: {head_s * 1e3:.1f} ms")

# %% [markdown]
# Three turns, for show. The script's table, from random weights of the same shapes drawn
# separately for each layer (so no matrix is still in cache when its turn comes, as in a real
# step), 8 turns each, at 1, 4, 16 and 64 rows; at 1 row also weights packed for 1 row
# (`packed_for1_ms`), which oneDNN keeps in the plain order:

# %%
lin = read_csv(packbench.HERE / "day-59-linears.csv")
show(lin, ["rows", "part", "gflop", "plain_ms", "packed_ms", "plain_gflops", "packed_gflops", "speedup",
           "packed_for1_ms"])  # fmt: skip
one = next(r for r in lin if r["rows"] == "1" and r["part"] == "all")
gbs = {k: float(one["weight_mb"]) / float(one[k]) for k in ("plain_ms", "packed_ms", "packed_for1_ms")}
print("1 row, all 121 matrices: " + ", ".join(f"{k[:-3]} {v:.1f} GB/s" for k, v in gbs.items()))

# %% [markdown]
# Read by rows. At 1 row every weight is used once, and the product is a walk over 537.9 MB;
# Day 12 measured this machine reading memory at 41.8 GB/s on one thread. The plain path
# walked it at 17.8 GB/s (30.22 ms), the weights packed for 16 rows at 33.6 GB/s (16.00 ms),
# 1.89x faster, and the weights packed for 1 row, which oneDNN leaves in the plain order, at
# 24.3 GB/s (22.17 ms). So on this CPU even one row gains, partly from oneDNN's kernel (the same
# order, faster than `F.linear`) and partly from the tiled order. From 4 rows on packing won by
# more: 2.60x over all matrices at 4 rows, 2.39x at 16 and 2.41x at 64; at 16 rows from 61.5 to
# 146.6 GFLOP/s. The head gained most at every row count, 3.22x at 4 rows and 2.77x at 16,
# against 2.29x to 2.45x for the block matrices at 4 to 64 rows. Each pair of times came from
# passes taking turns in one run.

# %% [markdown]
# ## 4. The attention kernel
#
# Day 58's kernel now holds two builds of its fp32 loop; which one a machine gets is decided
# when it is compiled. `native().isa()` names it:

# %%
ext = native()
print("native kernel build:", ext.isa())
assert ext.isa() == "avx2"

# %% [markdown]
# The AVX2 loop computes eight keys' scores at once (one horizontal sum for eight dot
# products), keeps each head's 64 output numbers in eight registers, and prefetches the rows of
# keys a few slots ahead, since a window's slots are scattered over the pool. It cannot be
# switched off from Python. What can be shown is why attention is a different kind of work from
# the linears. Per layer, each row reads its own keys and values and does 4 x head_dim
# flops per key and query head; with 9 query heads sharing 3 K/V heads that is 1.5 flops per
# byte read, whatever the row count, because every row has keys of its own. A linear reads
# one weight matrix for all rows: 2 x rows flops per 4-byte weight.

# %%
lens = packbench.spread_lens(256)
read, flops = packbench.attention_bytes(lens), packbench.attention_flops(lens)
print(f"16 rows, lengths {lens[0]}..{lens[-1]} (sum {sum(lens)}): one layer reads {read:,} bytes, "
      f"does {flops:,} flops: {flops / read:.2f} flop/byte")  # fmt: skip
for rows in (1, 4, 16, 64):
    print(f"a linear at {rows:>2} rows: {2 * rows / 4:>4.1f} flop/byte")
assert flops / read == 1.5

# %% [markdown]
# So at 16 rows a linear does 8 flops per byte and attention 1.5: attention is bound by how fast
# the memory delivers scattered rows, and what the AVX2 build buys is fewer instructions per
# key loaded and loads issued early. One layer at 16 rows, the gather path of Days 18-57
# against the kernel, with windows of whole 16-slot blocks drawn at random from the pool
# (`attention_times` asserts the two agree to 1e-5 before timing):

# %%
t = packbench.attention_times(256, reps=5)
print(f"C = 256, one layer: gather {t['gather'] * 1e3:.3f} ms, AVX2 kernel {t['native'] * 1e3:.3f} ms")
att = read_csv(packbench.HERE / "day-59-attention.csv")
columns = ["widest", "sum_len", "read_kb", "mflop", "gather_ms", "portable_ms", "avx2_ms", "avx2_gbs",
           "gather_over_avx2", "portable_over_avx2"]  # fmt: skip
if not any(r["portable_ms"] for r in att):  # the run was made without --portable
    columns = [c for c in columns if not c.startswith("portable")]
show(att, columns)

# %% [markdown]
# The kernel beat the gather path at all three contexts, 3.72x at C = 64, 2.76x at 256 and
# 2.43x at 1024. Its rate, `avx2_gbs` (the K/V bytes it must read over its time), was 28.7 GB/s
# at C = 64 and 29.9 GB/s at 256, on one thread, and fell to 10.7 GB/s at 1024, where one layer
# reads 19267.6 KB. The script's run was made without `--portable`, so this table has no
# portable build to set against the AVX2 one; `packbench.portable_kernel()` builds it (the same
# source with its AVX2 block switched off) for a run that wants that comparison.

# %% [markdown]
# ## 5. A whole 16-row step
#
# Two engines over SmolLM2, `linear="plain"` and `linear="packed"`, 16 rows each. Packing is in
# place and one way: the engine packs the model it is handed, and a model already packed stays
# packed, whatever the config asks.

# %%
small_cfg = dict(max_batch=16, max_model_len=256, kv_budget="16MiB")
asked_plain = Engine(packed, tok, engine_config(59, **small_cfg, linear="plain"))
print("engine_config(59, linear='plain') on a packed model runs:", asked_plain.linear)
del asked_plain

# %% [markdown]
# That is why this notebook keeps two module trees, `model` and `packed`, over one set of
# tensors. `prefilled_engines` gives both engines the same 16 random prompts of 3 to 7 tokens
# (prefix caching off, so no two rows share a block) and prefills them; `best_steps` then runs
# decode steps, the two engines taking turns, with the time of each step split by
# `component_clock` into the blocks' linears, the head, attention, and the rest (norms, rotary,
# sampling, the scheduler and the plan). Live, at this small context:

# %%
twins = {"plain": model, "packed": packed}
engines = packbench.prefilled_engines(twins, packbench.spread_lens(8), steps=4, tok=tok)
for kind, eng in engines.items():
    print(f"{kind:<6}: linears {eng.linear}, decode attention {eng.cache.attention}, "
          f"rows {len(eng.scheduler.running)}")  # fmt: skip
steps = packbench.best_steps(engines, reps=2)  # the first turn builds oneDNN's primitives
for kind, s in steps.items():
    print(f"{kind:<6} step {s['step']:.1f} ms: linears {s['linears']:.1f} ms, head {s['head']:.1f} ms, "
          f"attention {s['attention']:.1f} ms, rest {s['rest']:.1f} ms")  # fmt: skip
for eng in engines.values():  # done with them: end the rows
    for seq in list(eng.scheduler.running):
        eng.abort(seq.request_id)

# %% [markdown]
# The script's run: decode steps with rows from C/2 to C tokens at C = 64 and 256, and mixed
# steps at 256, where one row is ended and each turn adds a 128-token prompt to the 15 decode
# rows (Day 57's budget policy puts both in one step) and aborts it after the step; 8 turns
# each. Then torch.profiler's top ops by self time in one decode step of each at C = 256:

# %%
show(step, ["step", "widest", "tokens", "linear", "step_ms", "linears_ms", "head_ms", "attention_ms",
            "rest_ms", "vs_plain"])  # fmt: skip
prof = read_csv(packbench.HERE / "day-59-profile.csv")
show(prof, ["linear", "rank", "op", "calls", "self_ms", "ops_in_step"])
counts = {r["linear"]: int(r["ops_in_step"]) for r in prof}
fewer = counts["plain"] - counts["packed"]
print(f"ops in a step: plain {counts['plain']:,}, packed {counts['packed']:,}: {fewer} fewer, "
      f"{fewer / 121:.0f} per matrix")  # fmt: skip

# %% [markdown]
# The packed engine's decode step was 2.04x faster at C = 64 and 1.92x at 256, and its mixed
# step 2.10x. Both linear parts shrank: the head from 16.4 ms to 5.9 ms at C = 64 (16.9 to 5.9 at
# 256, 15.9 to 5.9 in the mixed step), the block linears from 55.8 ms to 24.9 ms and from 56.5 ms
# to 25.5 ms, as section 3 predicts. Attention is the same kernel in both engines, and its
# columns agree to within this run's spread (3.2 and 3.3 ms at C = 64, 9.5 and 9.2 at 256). The
# mixed step carries 143 tokens, and there the block linears, most of the step, went from
# 299.3 ms to 125.7 ms: in section 3 the block matrices' gain did not shrink with the rows
# (2.35x at 64), and with 143 tokens it did not shrink either. In the profile, the 121 products
# are 121 `aten::mm` calls in the plain step (75.1 ms of self time) and 121
# `mkldnn::_linear_pointwise` calls in the packed one (31.2 ms), and the packed step runs 3,440
# aten and mkldnn ops against 4,166: 726 fewer, 6 per matrix, the ops that `F.linear` wraps
# around its `mm`.

# %% [markdown]
# ## 6. Same tokens
#
# Three short text prompts, 6 greedy tokens each, through an engine of each kind, against the eager
# reference `greedy_tokens` (contiguous cache, one sequence at a time, plain weights). As in
# `tests/test_engine.py`, a difference is excused only at a proven near-tie: where the
# reference's top two logits at the first differing position are within 1e-4.

# %%
TEXTS = ("The capital of France is", "A cache is a", "Two plus two equals")
prompts = [tok.encode(c) for c in TEXTS]
N = 6
with torch.inference_mode():
    eager = [greedy_tokens(model, p, N) for p in prompts]
params = SamplingParams(max_tokens=N, ignore_eos=True)
results = {}
for kind, m in (("plain", model), ("packed", packed)):
    e = Engine(m, tok, engine_config(59, max_batch=16, max_model_len=128, kv_budget="16MiB", linear=kind))
    assert e.linear == kind
    results[kind] = [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)]
for i, p in enumerate(prompts):
    verdicts = [same_or_near_tie(model, p, eager[i], results[kind][i]) for kind in ("plain", "packed")]
    print(f"{TEXTS[i]!r:<26} plain: {verdicts[0]}, packed: {verdicts[1]}   {tok.decode(eager[i])!r}")

# %% [markdown]
# ## 7. The checks, failing
#
# Two ways to pack wrongly that raise nothing. First, packing the transpose: a reader who
# remembers that a GEMM wants (in, out) might hand oneDNN `w.T`. For a square matrix (`o`,
# 576 x 576) the shapes still fit and every product runs, on the wrong numbers. Second, two
# blocks' packed `qkv` swapped by an off-by-one in a packing loop: every matrix has the right
# shape and the right layout, and the model still answers. The same `check_close` refuses both,
# the second on one forward's logits against the plain model's (tolerance 1e-3 there: 30
# layers of section 2's rounding; the correct twin passes it).

# %%
w_o = model.blocks[0].o.detach()
x_o = torch.randn(16, 576)
with torch.inference_mode():
    right, wrong = linear(x_o, packbench.pack(w_o, 16)), linear(x_o, packbench.pack(w_o.T.contiguous(), 16))
print(f"packed from w:   {check_close('packed from w', right, x_o @ w_o.T):.1e}")
try:
    check_close("packed from w.T", wrong, x_o @ w_o.T)
except AssertionError as e:
    print("caught:", e)
else:
    raise AssertionError("a weight packed from its transpose passed")

ids = torch.tensor(prompts[0])
pos = torch.arange(len(ids))


def logits_of(m):
    cache = NoCache()
    cache.begin(pos)
    with torch.inference_mode():
        return m(ids, pos, cache)


ref_logits = logits_of(model)
print(f"packed twin's logits: {check_close('packed twin', logits_of(packed), ref_logits, 1e-3):.1e}")
q0, q1 = packed.blocks[0].qkv, packed.blocks[1].qkv
packed.blocks[0].qkv, packed.blocks[1].qkv = q1, q0  # blocks 0 and 1 swapped
try:
    check_close("qkv of blocks 0 and 1 swapped", logits_of(packed), ref_logits, 1e-3)
except AssertionError as e:
    print("caught:", e)
else:
    raise AssertionError("swapped packed weights passed")
finally:
    packed.blocks[0].qkv, packed.blocks[1].qkv = q0, q1  # put back

# %% [markdown]
# Where packing is impossible, `packing_status(dtype, device)` says why, and `pack_linears`
# raises that sentence. oneDNN packs bf16 weights only on a CPU with bf16 instructions
# (avx512_bf16 or AMX); on an AVX2-only CPU a bf16 model is refused, an engine asked for
# `"packed"` refuses with the same reason, and `"auto"` quietly takes the plain path. On a GPU
# the linears stay plain. The CPU these outputs come from has avx512_bf16, so here the bf16
# model packs and `"auto"` picks `packed`; what this cell prints depends on the machine (under
# test its output is not compared), and its assert holds on either kind.

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
for dtype, device in ((torch.float32, "cpu"), (torch.bfloat16, "cpu"), (torch.float32, "cuda")):
    print(f"packing_status({dtype}, {device!r}): {packing_status(dtype, device)}")
tiny_bf16 = Llama(tiny_config(), dtype=torch.bfloat16)
for p_ in tiny_bf16.parameters():
    p_.normal_(0, 0.05)
try:
    pack_linears(tiny_bf16)
except ValueError as e:
    print("pack_linears(bf16 model):", e)
try:
    bf16 = dict(max_batch=2, max_model_len=64, dtype="bfloat16")
    Engine(tiny_bf16, None, engine_config(59, **bf16, linear="packed"))
except ValueError as e:
    print("engine_config(59, linear='packed'), bf16:", e)
auto = Engine(tiny_bf16, None, engine_config(59, max_batch=2, max_model_len=64, dtype="bfloat16"))
print("engine_config(59) (linear='auto'), bf16 ->", auto.linear)
if packing_status(torch.bfloat16, "cpu") is None:  # bf16 instructions: pack_linears packed it
    assert auto.linear == "packed" and tiny_bf16.head.is_mkldnn
else:
    assert auto.linear == "plain" and not tiny_bf16.head.is_mkldnn

# %% [markdown]
# ## 8. The diagram

# %%
fig = plt.figure(figsize=(15, 10))
grid = fig.add_gridspec(2, 3, hspace=0.38, wspace=0.3)
fig.suptitle(
    "Day 59: weights packed once for oneDNN, and the 16-row decode step (SmolLM2-135M, fp32, 1 thread)",
    fontsize=13,
)

# top left: where each weight of a 128 x 48 matrix lies in memory, plain and packed
small = torch.arange(128 * 48, dtype=torch.float32).view(128, 48)  # each entry its own flat index
order = packbench.tiles(small).reshape(-1).long()  # memory position -> flat (out, in) index
assert torch.equal(packbench.packed_floats(packbench.pack(small, 16)), small.reshape(-1)[order])
offset = torch.empty(128 * 48)
offset[order] = torch.arange(128 * 48, dtype=torch.float32)  # flat (out, in) index -> memory position
sub = grid[0, 0].subgridspec(1, 2, wspace=0.12)
for k, (name, where, at) in enumerate(
    (("plain (out, in)", small, torch.arange(128 * 48)), ("packed AB16b64a", offset.view(128, 48), order))
):
    ax = fig.add_subplot(sub[k])
    ax.imshow(where, cmap="viridis", aspect="auto", interpolation="nearest")
    for x0 in (15.5, 31.5):
        ax.axvline(x0, color="white", lw=0.8)
    ax.axhline(63.5, color="white", lw=0.8)
    first = at[:160]  # the first 160 floats in memory, in order
    ax.plot(first % 48, first // 48, "-", color="red", lw=2)
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("input")
    if k == 0:
        ax.set_ylabel("output")
    else:
        ax.set_yticks([])
ax.text(-0.1, 1.12, "memory position of each weight (dark first); red: the first 160 floats",
        transform=ax.transAxes, ha="center", fontsize=10)  # fmt: skip

# top middle and right: GFLOP/s against rows
for j, part in enumerate(("blocks", "head")):
    ax = fig.add_subplot(grid[0, 1 + j])
    rows_ = [r for r in lin if r["part"] == part]
    xs = [int(r["rows"]) for r in rows_]
    plain_g, packed_g = [float(r["plain_gflops"]) for r in rows_], [float(r["packed_gflops"]) for r in rows_]
    ax.plot(xs, plain_g, "o-", color="tab:red", label="plain (day 12 linear)")
    ax.plot(xs, packed_g, "s-", color="tab:green", label="packed for 16 rows (oneDNN)")
    for r in rows_:
        ax.annotate(f"x{r['speedup']}", (int(r["rows"]), float(r["packed_gflops"])),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)  # fmt: skip
    ax.set_ylim(0, max(packed_g) * 1.15)  # room for the labels above the last point
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(v) for v in xs])
    ax.set_xlabel("rows")
    ax.set_ylabel("GFLOP/s")
    title = "the 120 block matrices, distinct per layer" if part == "blocks" else "the head, 49152 x 576"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)

# bottom left and middle: a step by part
ax = fig.add_subplot(grid[1, 0:2])
parts = [("linears_ms", "block linears", "tab:blue"), ("head_ms", "head", "tab:purple"),
         ("attention_ms", "attention", "tab:orange"), ("rest_ms", "the rest", "tab:gray")]  # fmt: skip
labels = [f"{r['step']} C={r['widest']}\n{r['linear']}" for r in step]
bottom = [0.0] * len(step)
for col, name, color in parts:
    vals = [float(r[col]) for r in step]
    ax.bar(range(len(step)), vals, 0.6, bottom=bottom, color=color, label=name)
    bottom = [b + v for b, v in zip(bottom, vals)]
for i, r in enumerate(step):
    if r["linear"] == "packed":
        ax.text(i, float(r["step_ms"]) * 1.02, f"x{r['vs_plain']}", ha="center", fontsize=9)
ax.set_xticks(range(len(step)), labels, fontsize=8)
ax.set_ylabel("ms per step (best of the run)")
ax.set_title("one SmolLM2 step at 16 rows, by part: plain against packed", fontsize=10)
ax.legend(fontsize=8, ncol=4)

# bottom right: one layer's decode attention
ax = fig.add_subplot(grid[1, 2])
cs = [int(r["widest"]) for r in att]
ax.plot(cs, [float(r["gather_ms"]) for r in att], "o-", color="tab:red", label="gather + SDPA")
if all(r["portable_ms"] for r in att):
    portable_ms = [float(r["portable_ms"]) for r in att]
    ax.plot(cs, portable_ms, "^-", color="tab:olive", label="kernel, portable build")
ax.plot(cs, [float(r["avx2_ms"]) for r in att], "s-", color="tab:green", label="kernel, AVX2 build")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xticks(cs, [str(c) for c in cs])
ax.set_xlabel("widest context C (rows from C/2 to C)")
ax.set_ylabel("ms, one layer, 16 rows")
ax.set_title("decode attention: 1.5 flop per byte read", fontsize=10)
ax.legend(fontsize=8)

out = diagram_path("day59-packed.png")
fig.savefig(out, dpi=80, bbox_inches="tight")
plt.close(fig)
display(Image(filename=str(out)))

# %% [markdown]
# ## In the real systems
#
# * **PyTorch's own compiler** does this when told the weights are constants. With
#   `torch._inductor.config.freezing = True` on CPU, the passes in
#   `torch/_inductor/fx_passes/mkldnn_fusion.py` (switched by `config.cpp.weight_prepack`,
#   on by default) rewrite a linear into a weight node packed once and a packed product:
#   `mkldnn._reorder_linear_weight` and `mkldnn._linear_pointwise`, the two ops of this day, for
#   bf16 and fp16 weights. For fp32 with a fixed batch size they prefer MKL's own packed GEMM
#   (`mkl._mkl_reorder_linear_weight`, `mkl._mkl_linear`) and fall back to oneDNN's when the batch
#   size is symbolic or the model is compiled ahead of time, since an MKL packed buffer cannot
#   be moved to another address. nanoserve takes the oneDNN pair for every row count.
# * **vLLM's CPU backend** does it in the hook every linear layer gets after the checkpoint is
#   read. `UnquantizedLinearMethod.process_weights_after_loading`
#   (`vllm/model_executor/layers/linear.py`) calls `dispatch_cpu_unquantized_gemm`
#   (`vllm/model_executor/layers/utils.py`): on x86 with oneDNN it builds a handle with
#   `ops.create_onednn_mm(weight.t(), ...)` that holds the reordered weight, and the layer's
#   `cpu_linear` becomes `ops.onednn_mm(handle, x, bias)`; on CPUs with AMX tiles and bf16 or
#   int8 weights it packs with `convert_weight_packed` for `weight_packed_linear`, kernels that
#   came from SGLang's CPU backend. Linear layers drop the original weight once packed; the
#   embedding's method keeps its weight, because the token lookup reads it, the same reason our
#   tied head gets a packed copy of its own while `embed` stays plain.
# * `process_weights_after_loading` is also where vLLM's quantization methods rewrite weights
#   into their kernels' layouts once, for example GPTQ weights repacked for the Marlin kernel
#   (`gptq_marlin_repack`); **TensorRT-LLM** does the same at build time with
#   `torch.ops.trtllm.preprocess_weights_for_mixed_gemm`, which interleaves int4 and int8
#   weights for its weight-only GEMMs. The rule is the same everywhere: pay for a layout once
#   at load, never per call.
# * **llama.cpp** repacks quantized weights for the CPU as they are loaded. Tensors placed in the
#   `CPU_REPACK` buffer type (`ggml/src/ggml-cpu/repack.cpp`) are rewritten by functions such as
#   `repack_q4_0_to_q4_0_8_bl`, which interleave the Q4_0 blocks of 8 rows so that one load of
#   the activations serves 8 output rows, the same idea as our 64 outputs side by side; which
#   interleave it picks depends on the CPU's instructions. This replaced the separate
#   `Q4_0_4_4`, `Q4_0_4_8` and `Q4_0_8_8` file types in late 2024, and `--no-repack` (`-nr`)
#   turns it off. Our default model ships as such a GGUF (Q4_1), which the next day keeps
#   quantized.

# %% [markdown]
# ## Try it
#
# 1. **Pack for one row.** Build `packbench.packed_twin(model, rows=1)`. Predict first:
#    `packbench.weight_layout` of its reorder says `ab`, so `packed_floats(twin.head)` equals
#    `model.head.reshape(-1)` exactly (check it with `torch.equal`), and section 7's logits
#    check still passes. Then compare `linear_times(1, ...)` for the two twins' heads, and
#    check the direction against `packed_for1_ms` at 1 row in `day-59-linears.csv`.
# 2. **Break the packing on purpose.** In a copy of `pack_linears`, pack `gate_up` with its two
#    halves swapped (`torch.cat(w.chunk(2)[::-1])`): every shape still fits and nothing
#    raises. Section 7's `check_close` on the logits must fail, and so must
#    `pytest tests/test_engine.py` once the engine uses your copy. Name the error's size.
# 3. **Attention's intensity for another model.** A Llama-3-8B layer has 32 query heads over 8
#    K/V heads of 128. Change the head counts in `attention_flops` and `attention_bytes` and
#    predict the flops per byte before running: `4 x 32 / (2 x 8 x 4)` = 2.0, against 1.5 here.
#    `assert` it; grouping more query heads per K/V head is the only thing that raises it.

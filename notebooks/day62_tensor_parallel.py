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
# # Day 62 — One model across processes: tensor parallelism over torch.distributed
#
# Every day so far has assumed that the whole model, and the whole KV pool, fit in the memory
# of one device. Past some size they do not: a 70B model in bf16 is 140 GB of weights before a
# single token of cache. The usual answer for one server with several accelerators is tensor
# parallelism: every block's matrices are cut into slices, each process (a *rank*) holds one
# slice of each, all ranks run every step together on the same tokens, and they add up their
# partial results where the arithmetic requires it.
#
# The split the engine uses today is the one Megatron-LM made standard. Attention is cut by
# heads: a rank owns some query heads and the K/V heads those query heads read, so attention
# itself needs nothing from any other rank. The MLP is cut by its inner columns. What stays
# whole on every rank is small: the norms. The price is communication: after the output
# projection `o` and after the MLP's `down`, each rank holds only a partial sum of the block's
# output, and an all-reduce adds them up on every rank. That is two collectives per block, every
# step, whatever the batch.
#
# 1. the cost in collectives, counted for SmolLM2-135M before running anything,
# 2. one block split for 3 ranks by hand, run rank by rank, summed, and held against the
#    one-process block and against `tp.shard`,
# 3. the rank counts a model allows, and the sentence for one it refuses,
# 4. live ranks: a tiny model over 2 processes (`tp.spawn`, gloo), tokens against one process,
#    and the collectives of every step counted,
# 5. the default model over 3 ranks from `days/day62/tpmemory.py`: memory a rank, decode rate,
#    text,
# 6. a shard that gives each rank the wrong K/V head, caught by the block check,
# 7. the diagram.

# %%
import contextlib
import csv
import importlib.util
import io
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import matplotlib
import torch
import torch.nn.functional as F

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path
from nanoserve import tp
from nanoserve.bench import cpu_line
from nanoserve.contiguous import ContiguousKVCache, causal_attention
from nanoserve.engine import build_engine
from nanoserve.errors import NanoserveError
from nanoserve.models import LlamaConfig, apply_rope, linear, load_model, model_weight_bytes, rms_norm
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

torch.manual_seed(0)
print(cpu_line())
MODEL_DIR = fetch_default_model()
t0 = time.perf_counter()
full, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
cfg = full.cfg
print(f"SmolLM2-135M-Instruct, fp32, loaded in {time.perf_counter() - t0:.1f} s")
with open(REPO / "days" / "day62" / "day-62-memory.csv") as f:
    CSV = list(csv.DictReader(f))

# %% [markdown]
# ## 1. What is split, and what it costs
#
# SmolLM2-135M's shape decides everything below: 9 query heads, 3 K/V heads (grouped-query: 3
# query heads read each K/V head), an MLP 1536 columns wide, a vocabulary of 49,152 and 30
# blocks. Per step, a rank takes part in
#
# * 2 all-reduces in every block (after `o`, after `down`),
# * 1 all-reduce for the embedding: the vocabulary is split too, each rank looks up only the
#   tokens whose rows it holds and gives zeros for the rest, so the sum has one nonzero term,
# * 1 gather of the logits on rank 0, which alone samples,
# * 1 broadcast from rank 0 of the step's plan (which positions, which slots), so that the
#   other ranks run the same step on their own shares and their own part of the KV pool.
#
# How much data that moves at one decode row is worth working out as well:

# %%
L, H, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
per_step = 2 * L + 3
print(
    f"{L} blocks: {2 * L} block all-reduces + 1 embedding all-reduce + 1 logits gather "
    f"+ 1 plan broadcast = {per_step} collectives a step"
)
reduce_bytes = (2 * L + 1) * H * 4  # one row: each all-reduce sums a (1, 576) fp32 vector
gather_bytes = V // 3 * 4  # one row of a rank's 16,384 logits
print(
    f"one decode row: {2 * L + 1} all-reduces of {H * 4:,} bytes = {reduce_bytes:,} bytes, "
    f"and a logits share of {gather_bytes:,} bytes a rank"
)
third = model_weight_bytes(full) / 3
print(
    f"a rank's parameters, read every step: {third / 1e6:.1f} MB, "
    f"{third / (reduce_bytes + gather_bytes):.0f} times the bytes it hands to collectives"
)
assert per_step == 63

# %% [markdown]
# A rank hands about 206 KB to collectives per decode row, 870 times less than the weights it
# reads in the same step. At small batch the collectives cost in *count*, not in
# bytes: 63 round trips a step, each of which waits for the slowest rank.
#
# ## 2. One block, split by hand
#
# Block 0 of SmolLM2, cut for 3 ranks in plain slices. The fused `qkv` matrix stacks 9 query
# heads, then 3 K heads, then 3 V heads, 64 rows a head; `gate_up` stacks the 1536 gate rows over
# the 1536 up rows. Rank `r` keeps
#
# * query heads `3r .. 3r+2` and K/V head `r` (the one those three read): rows of `qkv`,
# * the same 192 columns of `o` (the inputs of `o` are the attention outputs of its heads),
# * MLP columns `512r .. 512r+511`: those rows of gate and of up, those columns of `down`.

# %%
hd, nh, nkv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
blk = full.blocks[0]
RANKS = 3


def rank_slices(r, world=RANKS, kv_of=lambda r: r):
    """Rank r's part of block 0; kv_of(r) names the K/V head it gets (its own, when right)."""
    qh, kvh, cols = nh // world, nkv // world, inter // world
    kv = kv_of(r)
    q_rows = slice(r * qh * hd, (r + 1) * qh * hd)
    k_rows = slice(nh * hd + kv * kvh * hd, nh * hd + (kv + 1) * kvh * hd)
    v_rows = slice((nh + nkv) * hd + kv * kvh * hd, (nh + nkv) * hd + (kv + 1) * kvh * hd)
    mlp = slice(r * cols, (r + 1) * cols)
    return {
        "q": blk.qkv[q_rows],  # (192, 576)
        "k": blk.qkv[k_rows],  # (64, 576)
        "v": blk.qkv[v_rows],  # (64, 576)
        "o": blk.o[:, q_rows],  # (576, 192)
        "gate": blk.gate_up[mlp],  # (512, 576)
        "up": blk.gate_up[inter:][mlp],  # (512, 576)
        "down": blk.down[:, mlp],  # (576, 512)
    }


mine = [rank_slices(r) for r in range(RANKS)]
whole = {"q": blk.qkv, "k": blk.qkv, "v": blk.qkv, "o": blk.o, "gate": blk.gate_up, "up": blk.gate_up}
whole["down"] = blk.down
for name, w in mine[0].items():
    print(f"rank 0 {name:<4} {tuple(w.shape)!s:<11} cut from {tuple(whole[name].shape)}")

# %% [markdown]
# A rank's half-block, written out: the norm (replicated), its heads' Q, K and V, the rotary,
# causal attention of its 3 query heads over its one K/V head, and its columns of `o`. What
# comes out is (tokens, 576), full width but only this rank's heads' share of the sum. The MLP
# part is the same shape of thing for its 512 columns. The block on 3 ranks is then: add the
# three attention parts to the residual (the first all-reduce), then add the three MLP parts
# (the second).

# %%
ids = torch.tensor(tok.encode("Tensor parallelism splits every block three ways"))
n, positions = len(ids), torch.arange(len(ids))
x = full.embed[ids]  # (N, 576)
cos, sin = full.cos[positions].unsqueeze(1), full.sin[positions].unsqueeze(1)  # (N, 1, hd)


def attention_part(x, w):
    h = rms_norm(x, blk.input_norm, cfg.rms_norm_eps)
    q = apply_rope(linear(h, w["q"]).view(n, -1, hd), cos, sin)  # (N, 3, hd)
    k = apply_rope(linear(h, w["k"]).view(n, -1, hd), cos, sin)  # (N, 1, hd)
    v = linear(h, w["v"]).view(n, -1, hd)
    a = causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), positions)  # (N, 3, hd)
    return linear(a.reshape(n, -1), w["o"])  # (N, 576): a partial sum over heads


def mlp_part(x, w):
    h = rms_norm(x, blk.post_norm, cfg.rms_norm_eps)
    return linear(F.silu(linear(h, w["gate"])) * linear(h, w["up"]), w["down"])  # (N, 576)


def split_block(x, shares):
    x = x + sum(attention_part(x, w) for w in shares)  # all-reduce 1
    return x + sum(mlp_part(x, w) for w in shares)  # all-reduce 2


cache = ContiguousKVCache(cfg, n)
cache.begin(positions)
with torch.inference_mode():
    one = blk(x, cos, sin, cache)  # the one-process block
    split = split_block(x, mine)
diff = (split - one).abs().max().item()
TOL = 5e-5  # about 26 fp32 ulp at 24.6: a few times the largest difference measured
print(f"{n} tokens {ids.tolist()}")
print(f"one-process block 0: largest |entry| {one.abs().max():.2f}")
big = one.abs().max().item()
ulp = 2.0 ** (math.floor(math.log2(big)) - 23)  # fp32 spacing at the largest entry
print(f"3 ranks summed:      max |difference| {diff:.1e} = {diff / ulp:.0f} fp32 ulp at {big:.2f}")
print(f"tolerance: {TOL:.0e}")
assert diff < TOL

# %% [markdown]
# The difference is a few units in the last place (ulp) of the largest entry, 24.60: two on the
# AVX-512 CPU this last ran on, and the exact count follows the order in which a CPU's kernels
# add. The same products, only added up in another order (each rank sums over its own heads or
# columns, then the three partial results are added). fp32 rounding, nothing more; `TOL` is a
# few times the largest difference measured on the CPUs this has run on. The engine's `tp.shard`
# holds exactly these slices, tensor for tensor:

# %%
slots = int(CSV[0]["kv_tokens"])  # the pool of section 5, for each rank's share of it
shares, lookups = [], []  # what later sections need from each rank's model
for r in range(RANKS):
    model_r, share = tp.shard(full, r, RANKS)
    b, w = model_r.blocks[0], mine[r]
    assert torch.equal(b.qkv, torch.cat([w["q"], w["k"], w["v"]]))
    assert torch.equal(b.o, w["o"]) and torch.equal(b.down, w["down"])
    assert torch.equal(b.gate_up, torch.cat([w["gate"], w["up"]]))
    assert torch.equal(b.input_norm, blk.input_norm) and torch.equal(model_r.norm, full.norm)
    print(
        f"rank {r}: qkv {tuple(b.qkv.shape)}, o {tuple(b.o.shape)}, gate_up {tuple(b.gate_up.shape)}, "
        f"down {tuple(b.down.shape)}, embedding rows {share.vocab_start}-"
        f"{share.vocab_start + share.vocab_rows - 1}"
    )
    # the sentence's tokens looked up in this rank's rows; zeros where another rank holds them
    local = ids - share.vocab_start
    held = (local >= 0) & (local < share.vocab_rows)
    lookups.append(torch.where(held[:, None], model_r.embed[local.clamp(0, share.padded_rows - 1)], 0.0))
    share.weight_bytes = model_weight_bytes(model_r)
    share.kv_pool_bytes, share.kv_tokens = tp.pool_bytes(model_r, slots), slots
    shares.append(share)
    del model_r, b  # a third of the model each: keep the facts, free the memory for the next

# %% [markdown]
# The embedding is the one place where the split sum is exact, not just close. Each token's row
# lives on one rank; the others contribute zeros. The loop above looked the sentence's seven
# tokens up in each rank's rows; their owners, and the sum:

# %%
rows = V // RANKS
owner = (ids // rows).tolist()
print("token ids:  ", ids.tolist())
print("owner rank: ", owner)
assert torch.equal(sum(lookups), full.embed[ids])
print("sum of the three lookups equals the full embedding, bit for bit")

# %% [markdown]
# ## 3. The rank counts a model allows
#
# A K/V head cannot be split without splitting the attention that reads it, so the rank count
# must divide the K/V heads (and the query heads and the MLP width). SmolLM2 has 3 K/V heads:
# 1 or 3 ranks, not 2. `tp.check_split` is called before any rank waits for another.

# %%
print("SmolLM2 allows:", tp.allowed_ranks(cfg))
try:
    tp.check_split(cfg, 2)
    raise AssertionError("2 ranks were accepted")
except NanoserveError as e:
    print("2 ranks ->", e)
assert tp.allowed_ranks(cfg) == [1, 3]

# %% [markdown]
# ## 4. Live ranks: a tiny model over 2 processes
#
# The tests' tiny random checkpoint (`make_tiny_dir`: 3 blocks, hidden 64, 8 query heads, 2 K/V
# heads, MLP 160, vocabulary 256) allows 1 or 2 ranks. It has no tokenizer of its own; the
# engine only needs one to exist, so SmolLM2's files are copied next to it and the prompts are
# token ids below 256.
#
# The script below is what each rank runs. Rank 0 builds the engine with `build_engine` (which,
# seeing torchrun's variables, loads rank 0's share and joins the group) and serves three
# requests, counting the collectives its TP object makes during each `step()`; any other rank
# calls `tp.run_worker`, which loads its share and follows rank 0's plans. `tp.spawn` starts the
# ranks with torchrun's variables. The reference is the same script's `run` and `config` in this
# process, which is one plain process (no torchrun variables here).

# %%
sys.path.insert(0, str(REPO))
with warnings.catch_warnings():  # transformers' import warns about tqdm's notebook widgets
    warnings.simplefilter("ignore")
    from tests.test_model import make_tiny_dir  # the random-weight checkpoint the tests write

work = Path(tempfile.mkdtemp(prefix="day62-"))
tiny_dir = work / "tiny"
make_tiny_dir(tiny_dir, seed=0, num_key_value_heads=2)
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(MODEL_DIR / name, tiny_dir / name)
tiny_cfg = LlamaConfig.from_dir(tiny_dir)

RANK_SCRIPT = '''
"""One rank of day 62's live run: rank 0 serves three token-id prompts, the others follow."""
import json
import sys

from nanocourse import engine_config
from nanoserve.engine import build_engine
from nanoserve.sampling import SamplingParams
from nanoserve.tp import launched, run_worker

PROMPTS = [[5, 17, 42, 9, 100], [7, 7, 3, 250, 31, 64, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9]]


def config(model_dir):
    # 3 layers x 2 K/V heads x 8 x fp32 x (K, V) = 384 bytes a token; 32 blocks of 4 tokens
    return engine_config(  # the engine as of day 62
        62, model=model_dir, threads=1, max_batch=4, block_size=4, kv_budget=384 * 4 * 32, max_model_len=64
    )


def run(engine, new_tokens=8):
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, logprobs=5)
    order = [engine.add_request(p, params) for p in PROMPTS]
    tokens, top = {r: [] for r in order}, {r: [] for r in order}
    group = getattr(engine.model, "tp", None)
    calls = []
    while engine.has_unfinished():
        before = group.collectives if group else 0
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            top[o.request_id] += [[float(v) for _, v in lp.top] for lp in o.logprobs or []]
        calls.append((group.collectives if group else 0) - before)
    return {
        "tokens": [tokens[r] for r in order],
        "top5_logprobs": [top[r] for r in order],
        "calls_per_step": calls,
        "collectives": group.collectives if group else 0,
    }


if __name__ == "__main__":
    where = launched()
    if where is not None and where[0] != 0:
        run_worker(config(sys.argv[1]))
    else:
        print(json.dumps(run(build_engine(config(sys.argv[1])))))
'''
script = work / "tiny_ranks.py"
script.write_text(RANK_SCRIPT)
t0 = time.perf_counter()
pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=work)
ranks = tp.spawn(2, [str(script), str(tiny_dir)], **pipes)  # rank 0 and rank 1, in the background
print("tiny model allows:", tp.allowed_ranks(tiny_cfg))

# the reference while they start: the same script's run() and config, in this process
spec = importlib.util.spec_from_file_location("tiny_ranks", script)
tiny_ranks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny_ranks)
threads = torch.get_num_threads()
with contextlib.redirect_stderr(io.StringIO()):  # the pool line
    ref = tiny_ranks.run(build_engine(tiny_ranks.config(str(tiny_dir))))
torch.set_num_threads(threads)  # the config asked for 1 thread; give the notebook its own back

outs = [p.communicate(timeout=300) for p in ranks]
assert all(p.returncode == 0 for p in ranks), [o[1][-500:] for o in outs]
print(f"2 ranks ran in {time.perf_counter() - t0:.1f} s (and one process here, meanwhile)")
two = json.loads(outs[0][0])
for line in outs[0][1].splitlines():
    if "tensor parallel rank" in line:
        print(line)
shutil.rmtree(work)  # the checkpoint and the script are done with

# %% [markdown]
# Rank 0 printed each rank's share: 4 of the 8 query heads, 1 of the 2 K/V heads, 80 of the 160
# MLP columns and half the vocabulary, and the whole pool's 124 tokens over its own K/V head.
# The tokens, and the top-5 log-probabilities behind them, against the single process:

# %%
for i, (a, b) in enumerate(zip(two["tokens"], ref["tokens"])):
    print(f"request {i}: 2 ranks {a}  one process {b}  equal {a == b}")
assert two["tokens"] == ref["tokens"]
gap = max(
    abs(p - q)
    for ra, rb in zip(two["top5_logprobs"], ref["top5_logprobs"])
    for sa, sb in zip(ra, rb)
    for p, q in zip(sa, sb)
)
print(f"top-5 log-probabilities, largest difference: below {10 ** math.ceil(math.log10(gap)):.0e}")
assert gap < 1e-5

# %% [markdown]
# Now the count. Rank 0's `TP.collectives` goes up by one for every collective it joins; the
# script read it around every `engine.step()`:

# %%
calls = two["calls_per_step"]
expected = 2 * tiny_cfg.num_layers + 3
print(f"steps: {len(calls)}, collectives in each: {calls}")
print(f"2 x {tiny_cfg.num_layers} blocks + embedding + logits + plan = {expected}")
once = two["collectives"] - expected * len(calls)
print(f"rank 0's total: {two['collectives']} = {expected} x {len(calls)} + {once}")
assert set(calls) == {expected}
assert two["collectives"] == expected * len(calls) + 2

# %% [markdown]
# Every step, the prefill of the three prompts and each decode step after it, cost the same 9
# collectives: the count follows the number of blocks, not the tokens in the step. The 2 left
# over happened once, at startup, in `TP.setup`: the broadcast of the pool's size and the linear
# layout to the workers, and the gather of every rank's share that produced the lines above. (A
# stop message is broadcast when rank 0 exits, after the script has read the counter.)
#
# ## 5. The default model on 3 ranks: `days/day62/tpmemory.py`
#
# The script runs the same `python -m nanoserve generate` command (24 tokens, one thread a
# process, `--weights dtype`) as one process and as 3 ranks, three times each, alternating, and
# keeps the best decode rate of each. `--weights dtype` makes both sides run the fp32 conversion
# of the checkpoint: without it a single process on a CPU serves the GGUF's own quantized blocks
# (day 60's default), which a rank cannot split, and the two sides would be different models.
# Its CSV, one row a rank, and the CPU line the CSV records for the run:

# %%
cols = ["ranks", "rank", "weight_mb", "kv_pool_mb", "kv_tokens", "decode_tok_s", "text_equal"]
print(" | ".join(cols))
for r in CSV:
    print(" | ".join(r[c] if c != "decode_tok_s" else f"{r[c]} tok/s" for c in cols))
print(CSV[0]["cpu"])
assert len({r["cpu"] for r in CSV}) == 1  # one machine, one thread a process, for every row
one_row, rank_rows = CSV[0], CSV[1:]
w1, wr = float(one_row["weight_mb"]), float(rank_rows[0]["weight_mb"])
k1, kr = float(one_row["kv_pool_mb"]), float(rank_rows[0]["kv_pool_mb"])
s1, sr = float(one_row["decode_tok_s"]), float(rank_rows[0]["decode_tok_s"])
print(f"weights a rank / one process: {wr / w1:.3f};  KV pool a rank / one process: {kr / k1:.3f}")
print(f"decode, 3 ranks against one process: {sr / s1:.2f}x")
step1, step3 = 1000 / s1, 1000 / sr
extra = step3 - step1 / RANKS
print(
    f"a decode step: {step1:.0f} ms in one process, a third of that {step1 / RANKS:.0f} ms, "
    f"on 3 ranks {step3:.0f} ms; the {extra:.0f} ms beyond a third is {extra / per_step:.1f} ms "
    f"for each of the {per_step} collectives, if all of it went there"
)
assert all(r["text_equal"] == "True" for r in CSV)
assert len({r["kv_tokens"] for r in CSV}) == 1  # the same pool plan, split by K/V heads

# %% [markdown]
# Both memory figures drop to a third, and both can be rebuilt from the shards of section 2. The
# engine packs its linears for oneDNN (phase 6's CPU default), and SmolLM2's head is tied to the
# embedding, so packing gives the head a copy of its own: vocabulary rows x 576 fp32 numbers, on
# one process all 49,152 rows, on a rank its 16,384. The KV pool is `tp.pool_bytes` of the same
# 11,648 slots over 3 K/V heads, or over 1.

# %%
packed_head = lambda rows: rows * H * 4  # noqa: E731
one_mb = (model_weight_bytes(full) + packed_head(V)) / 1e6
rank_mb = [(s.weight_bytes + packed_head(s.padded_rows)) / 1e6 for s in shares]
for who, params, head, total in (
    ("one process", model_weight_bytes(full), packed_head(V), one_mb),
    ("a rank", shares[0].weight_bytes, packed_head(rows), rank_mb[0]),
):
    print(f"{who:<12} {params / 1e6:.1f} MB of parameters + {head / 1e6:.1f} MB packed head = {total:.1f} MB")
pool_one, pool_rank = tp.pool_bytes(full, slots) / 1e6, shares[0].kv_pool_bytes / 1e6
print(f"KV pool      {pool_one:.1f} MB in one process, {pool_rank:.1f} MB a rank")
assert round(one_mb, 1) == w1 and all(round(mb, 1) == wr for mb in rank_mb)
assert round(pool_one, 1) == k1 and all(round(s.kv_pool_bytes / 1e6, 1) == kr for s in shares)
assert slots == int(rank_rows[0]["kv_tokens"])
norm_bytes = (2 * L + 1) * H * 4  # two norms a block and the final one, fp32
extra = shares[0].weight_bytes - model_weight_bytes(full) // RANKS
print(f"a rank's parameters beyond a third of one process's: {extra:,} bytes", end=" ")
print(f"= 2/3 of the {norm_bytes:,} bytes of norms, which every rank keeps whole")
assert extra * RANKS == 2 * norm_bytes

# %% [markdown]
# The norms are the only weights a rank holds in full, and they are why a rank's parameters
# come to 93,696 bytes more than a third. The decode rate is the other side of the bargain, and
# on this machine it is far worse: on the same fp32 model, 3 ranks decoded at 5.1 tok/s against
# one process's 40.0, 0.13x. What the outputs show about why:
#
# * the CPU line says each process ran on 1 thread, and the machine has 2 cores, so the 3 ranks
#   share 2 cores between them, where the single process had a core to itself;
# * each step is 63 collectives through gloo (section 1), and each one waits for every rank;
# * the arithmetic a rank saves is small next to what it lost: a third of one process's 25 ms
#   step is 8 ms, and the 3-rank step took 196 ms. Spread over the 63 collectives the difference
#   comes to 3.0 ms each, if all of it went there, for about 206 KB of data a step.
#
# The run does not measure how those 196 ms divide between waiting for a core and waiting in
# the collectives; it shows only that the total is far above a third of one process's step.
# Tensor parallelism buys memory first; this machine can show the memory and the equality, not
# a gain in speed.
#
# ## 6. A split that is wrong, caught
#
# The broken version gives rank `r` the K/V head `(r + 1) % 3` instead of head `r`. Every weight
# is still somewhere, the shapes all fit, and each rank runs without complaint; but its query
# heads now read keys and values that were trained for other query heads. The block check of
# section 2, run on it:

# %%
wrong = [rank_slices(r, kv_of=lambda r: (r + 1) % RANKS) for r in range(RANKS)]
with torch.inference_mode():
    got = split_block(x, wrong)
try:
    d = (got - one).abs().max().item()
    assert d < TOL, f"split block differs from the one-process block by {d:.1f} (tolerance {TOL:.0e})"
    print("the wrong split passed")
except AssertionError as e:
    print("caught:", e)

# %% [markdown]
# The check does not care where the mistake was made: the one-process block is the reference,
# and a split of it is right only if its summed parts give that block back.
#
# ## 7. The diagram

# %%
fig = plt.figure(figsize=(15, 7.5))
grid = fig.add_gridspec(1, 2, width_ratios=[1.7, 1], wspace=0.12)
ax = fig.add_subplot(grid[0])
ax.axis("off")
ax.set_xlim(0, 8)
ax.set_ylim(0, 10)
ax.set_title("block 0 of SmolLM2 on 3 ranks: each rank's slices, then the two all-reduces", fontsize=12)
colors = ["#cfe2f3", "#d9ead3", "#fce5cd"]


def box(x0, y0, w, h, text, color, size=9):
    ax.add_patch(plt.Rectangle((x0, y0), w, h, facecolor=color, edgecolor="black", lw=0.8))
    ax.text(x0 + w / 2, y0 + h / 2, text, ha="center", va="center", fontsize=size)


for r in range(RANKS):
    x0, mid = 0.1 + r * 2.65, 0.1 + r * 2.65 + 1.15
    ax.text(mid, 9.6, f"rank {r}", ha="center", fontsize=11, weight="bold")
    qkv_text = f"qkv rows: Q heads {3 * r}-{3 * r + 2}\n+ K/V head {r}  (320 x 576)"
    box(x0, 8.3, 2.3, 1.0, qkv_text, colors[r], 8)
    box(x0, 7.1, 2.3, 0.9, f"attention: 3 query heads\nover K/V head {r} (its pool)", colors[r], 8)
    box(x0, 5.9, 2.3, 0.9, f"o columns {192 * r}-{192 * r + 191}\n(576 x 192) -> partial", colors[r], 8)
    box(x0, 3.4, 2.3, 1.0, f"gate_up rows: MLP cols\n{512 * r}-{512 * r + 511}  (1024 x 576)", colors[r], 8)
    box(x0, 2.2, 2.3, 0.9, f"down columns {512 * r}-{512 * r + 511}\n(576 x 512) -> partial", colors[r], 8)
    for y_from, y_to in ((8.3, 8.0), (7.1, 6.8), (3.4, 3.1)):
        ax.annotate("", (mid, y_to), (mid, y_from), arrowprops=dict(arrowstyle="->", lw=0.8))
    ax.annotate("", (3.9, 5.05), (mid, 5.9), arrowprops=dict(arrowstyle="->", lw=1))
    ax.annotate("", (mid, 4.4), (3.9, 4.6), arrowprops=dict(arrowstyle="->", lw=1, color="gray"))
    ax.annotate("", (3.9, 1.35), (mid, 2.2), arrowprops=dict(arrowstyle="->", lw=1))
box(1.1, 4.6, 5.6, 0.45, "all-reduce 1: the 3 partial sums added on every rank, + residual", "#f4cccc", 9)
box(1.1, 0.9, 5.6, 0.45, "all-reduce 2: the 3 partial sums added on every rank, + residual", "#f4cccc", 9)
ax.text(
    7.9, 0.2,
    f"norms on every rank; embedding and head by vocabulary rows\n"
    f"a step: {2 * L} block all-reduces + 1 embedding + 1 logits gather + 1 plan = {per_step}",
    fontsize=9, ha="right", color="dimgray",
)  # fmt: skip

ax = fig.add_subplot(grid[1])
labels = ["1 process"] + [f"rank {r['rank']} of 3" for r in rank_rows]
weights = [float(r["weight_mb"]) for r in CSV]
pools = [float(r["kv_pool_mb"]) for r in CSV]
xs = range(len(labels))
ax.bar([i - 0.2 for i in xs], weights, 0.4, label="weights (linears packed)", color="tab:blue")
ax.bar([i + 0.2 for i in xs], pools, 0.4, label=f"KV pool, {slots:,} tokens", color="tab:orange")
for i in xs:
    ax.text(i - 0.2, weights[i] + 8, f"{weights[i]:.1f}", ha="center", fontsize=9)
    ax.text(i + 0.2, pools[i] + 8, f"{pools[i]:.1f}", ha="center", fontsize=9)
ax.set_xticks(list(xs), labels)
ax.set_ylabel("MB a process")
ax.set_ylim(0, 760)
ax.set_title(
    f"MB a process holds (tpmemory.py)\n"
    f"fp32 decode {s1} -> {sr} tok/s ({sr / s1:.2f}x), 1 thread a process on 2 cores",
    fontsize=11,
)
ax.legend(loc="upper right", fontsize=9)
fig.suptitle("Day 62: tensor parallelism over torch.distributed", fontsize=15)
png = diagram_path("day62-tensor_parallel.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** builds models from parallel layers in `vllm/model_executor/layers/linear.py`:
#   `ColumnParallelLinear` (output rows split; `QKVParallelLinear` and
#   `MergedColumnParallelLinear` are its fused-QKV and gate/up forms) and `RowParallelLinear`
#   (input columns split, followed by `tensor_model_parallel_all_reduce` when `reduce_results`
#   is set), the same pairing as our `o` and `down`. `VocabParallelEmbedding` and
#   `ParallelLMHead` (`vocab_parallel_embedding.py`) split the vocabulary, padding it to a
#   multiple of 64 (`DEFAULT_VOCAB_PADDING_SIZE`). One difference in policy: where the rank count
#   exceeds the K/V heads, `QKVParallelLinear` replicates each K/V head over
#   `num_kv_head_replicas` ranks instead of refusing, as `tp.check_split` does. `--tensor-parallel-size`
#   sets the count. On GPUs the all-reduce goes through NCCL (`pynccl.py`) or, for small tensors
#   between GPUs with peer access such as over NVLink, its own one-kernel `CustomAllreduce`
#   (`device_communicators/custom_all_reduce.py`; `--disable-custom-all-reduce` turns it off),
#   because at decode sizes latency, not bandwidth, dominates, as section 1 found. On CPU,
#   `CpuCommunicator` swaps gloo for a shared-memory all-reduce (`shm_allreduce`) when the ranks
#   share a machine, in place of gloo's exchanges between processes, the setting of section 5.
# * **nano-vllm** keeps the same classes in miniature (`nanovllm/layers/linear.py`,
#   `embed_head.py`): its `VocabParallelEmbedding` masks tokens outside the rank's range and
#   all-reduces, and `ParallelLMHead` gathers logits on rank 0 with `dist.gather`, as ours does;
#   it asserts the vocabulary divides evenly rather than padding. Rank 0 sends each call to the
#   workers by pickling the method name and arguments into a `SharedMemory` block and setting
#   an event per worker (`ModelRunner.write_shm` / `read_shm` / `loop`), where we broadcast the
#   plan over the same gloo/NCCL group.
# * **SGLang** takes `--tp-size` and uses the same layer family (`python/sglang/srt/layers/linear.py`,
#   with the same K/V head replication), its own custom all-reduce (`--disable-custom-all-reduce`)
#   and, as options, torch symmetric memory or MSCCL++ for the reduction.
# * **TensorRT-LLM** describes the split with `Mapping(world_size, tp_size, pp_size)` and runs
#   one MPI rank per GPU; its all-reduce picks a strategy (`AllReduceStrategy`: `NCCL`,
#   `ONESHOT`, `TWOSHOT`, `AUTO`, ...) and can fuse the residual add and the next RMSNorm into
#   the reduction (`AllReduceFusionOp.RESIDUAL_RMS_NORM`), the step that follows each of our two
#   all-reduces.
# * **llama.cpp** chooses with `--split-mode` (`-sm`): `layer`, the default, gives each GPU a
#   run of whole layers and their KV cache (pipeline, not tensor, parallelism); `row` split the
#   dense weight matrices across GPUs and is now marked deprecated in favour of an experimental
#   `tensor` mode that splits weights and KV across a "meta device" and reduces through NCCL.
#   `--tensor-split` (`-ts`) sets the proportions. The RPC backend (`rpc-server` on each remote
#   host, `--rpc host:port` on the client) offloads a share of the model over TCP to other
#   machines.
#
# ## Try it
#
# 1. **Split the MLP unevenly.** In `rank_slices`, give rank 0 columns 0-767 and ranks 1 and 2
#    384 each (adjust the slices of gate, up and down together). The check: `split_block(x,
#    ...)` still equals `one` within `TOL`, because a partial sum may cover any set of columns.
#    (`tp.shard` still insists on equal shares: the slowest rank's matmul sets the pace of every
#    all-reduce.)
# 2. **Break it on purpose in the engine's own split.** Take rank 1's shard, `m, _ =
#    tp.shard(full, 1, 3)`, swap the gate and up halves of block 0's `gate_up` (`g =
#    m.blocks[0].gate_up; g.copy_(torch.cat([g[512:], g[:512]]))`) and run section 2's
#    `torch.equal` checks of it against `rank_slices(1)`: the `gate_up` assert must fail. Then
#    build the same swap into `rank_slices` (gate from the up rows and up from the gate rows) and
#    watch the block check of section 6 refuse it as well.
# 3. **Count for another model.** Take Llama-3-8B's shape from its `config.json` on the
#    Hugging Face hub (quoted): 32 blocks, 32 query heads, 8 K/V heads, an MLP of 14,336. Write
#    a `LlamaConfig` for it and check that `tp.allowed_ranks` is `[1, 2, 4, 8]` and that a step
#    costs `2 * 32 + 3 = 67` collectives whatever the rank count.

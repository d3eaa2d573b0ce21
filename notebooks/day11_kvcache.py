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
# # Day 11 — A contiguous KV cache: prefill and decode
#
# Without a cache, generating a token means running the model over the whole sequence so far,
# prompt and every token generated before, and keeping only the last position's logits. The
# next token repeats all of it plus one position. Today's cache, `nanoserve.contiguous.
# ContiguousKVCache`, keeps each layer's keys and values from earlier steps, so a step runs only
# the new tokens: the whole prompt once (prefill), then one token at a time (decode).
#
# 1. why keeping K and V is allowed: earlier positions do not change when a token is appended,
# 2. a cache in a dozen lines, against the package's,
# 3. the package's cache: its tensors, its bytes, its bookkeeping, and the gate that refuses to
#    overflow it,
# 4. prefill, then decode, step by step,
# 5. the same tokens as the loop without a cache, on the real model,
# 6. a cache built wrong, and the gate that catches it,
# 7. how the saving grows with the text (`days/day11/cachebench.py`), the table and the diagram.

# %%
import csv
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path
from nanoserve.contiguous import ContiguousKVCache, NoCache, causal_attention
from nanoserve.generate import greedy_tokens
from nanoserve.models import load_model
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day11"))
import cachebench  # the day's script: the notebook prints the same tables it writes

MODEL_DIR = fetch_default_model()
tok = Tokenizer.from_dir(MODEL_DIR)
t0 = time.perf_counter()
model = load_model(MODEL_DIR)
cfg = model.cfg
print(f"loaded in {time.perf_counter() - t0:.1f} s; threads: {torch.get_num_threads()}")
prompt = tok.encode_chat([{"role": "user", "content": cachebench.PROMPTS[0]}])
print(f"prompt: {len(prompt)} tokens", end="; ")
print(f"layers {cfg.num_layers}, K/V heads {cfg.num_kv_heads}, head dim {cfg.head_dim}")

# %% [markdown]
# ## 1. What a step without a cache recomputes
#
# Attention is causal: position i attends to positions 0..i and nothing after. So the keys and
# values a layer computes for position i depend only on the tokens up to i, and appending a
# token cannot change them. Record every layer's K and V on a forward over the prompt and on a
# forward over the prompt plus one token, and compare the positions they share:


# %%
class Recording(NoCache):
    """The no-cache attention, keeping what each layer wrote: k, v (N, kv_heads, head_dim)."""

    def __init__(self):
        self.kept = {}

    def write(self, layer, k, v):
        super().write(layer, k, v)
        self.kept[layer] = (k.clone(), v.clone())


def record(ids):
    cache = Recording()
    positions = torch.arange(len(ids))
    cache.begin(positions)
    model(torch.tensor(ids), positions, cache)
    return cache.kept


first = greedy_tokens(model, prompt, 1)[0]
short, longer = record(prompt), record(prompt + [first])
n = len(prompt)
worst = max(
    (longer[i][j][:n] - short[i][j]).abs().max().item() for i in range(cfg.num_layers) for j in (0, 1)
)
scale = max(short[i][0].abs().max().item() for i in range(cfg.num_layers))
print(
    f"layer 0 K: {tuple(short[0][0].shape)} for the prompt, {tuple(longer[0][0].shape)} with one more token"
)
print(f"largest |ΔK|, |ΔV| over the {n} shared positions, all {cfg.num_layers} layers:", end=" ")
print(f"exactly 0: {worst == 0}, below 1e-4: {worst < 1e-4}")
print(f"(the largest |K| is about {scale:.0f})")
assert worst < 1e-4

# %% [markdown]
# Nothing moves: on this machine the keys and values of the 37 shared positions come out bit for
# bit the same in all 30 layers (the gate allows 1e-4, since another CPU may sum a 38-row matmul
# in another order than a 37-row one). Only the new position's row is new. So a step needs the
# new tokens' Q, K and V, and the K and V of everything before, which can be kept from the steps
# that made them.
#
# ## 2. A cache in a dozen lines
#
# The model does not own any K/V storage (Day 7): each block hands its keys and values to a
# cache object (`write`) and asks it for the attention output (`attention`), after the loop has
# announced the step's positions (`begin`). The smallest cache that speaks that protocol keeps a
# growing tensor per layer:


# %%
class GrowingCache:
    def __init__(self, num_layers):
        self.k = [None] * num_layers  # (kv_heads, length, head_dim) per layer once written
        self.v = [None] * num_layers

    def begin(self, positions):
        self.positions = positions

    def write(self, layer, k, v):
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # (N, kv, hd) -> (kv, N, hd)
        old_k, old_v = self.k[layer], self.v[layer]
        self.k[layer] = k if old_k is None else torch.cat([old_k, k], dim=1)
        self.v[layer] = v if old_v is None else torch.cat([old_v, v], dim=1)

    def attention(self, layer, q):
        return causal_attention(q, self.k[layer], self.v[layer], self.positions)


def cached_run(cache, ids, steps):
    """Prefill `ids`, then feed back the greedy token `steps` times; the logits of every step."""
    positions, x, out = torch.arange(len(ids)), torch.tensor(ids), []
    for _ in range(steps + 1):
        cache.begin(positions)
        logits = model(x, positions, cache, logits_at=positions[-1:] - positions[0])  # (1, V)
        out.append(logits[0])
        x = logits.argmax(-1)  # (1,): the next input is the token just chosen
        positions = positions[-1:] + 1
    return torch.stack(out)  # (steps + 1, V)


mine = cached_run(GrowingCache(cfg.num_layers), prompt, 8)
theirs = cached_run(ContiguousKVCache(cfg, len(prompt) + 8), prompt, 8)
print(
    "logits:",
    tuple(mine.shape),
    "| GrowingCache == ContiguousKVCache, bit for bit:",
    torch.equal(mine, theirs),
)
print("tokens:", mine.argmax(-1).tolist())
assert torch.equal(mine, theirs) and mine.argmax(-1).tolist() == greedy_tokens(model, prompt, 9)

# %% [markdown]
# The first seven tokens are `The capital of France is Paris.`; the eighth, 2, is `<|im_end|>`,
# the end-of-turn id Day 1 found. The ninth, 198, comes after EOS: `cached_run` feeds back
# whatever it picked and never checks for EOS, so the model goes on writing after its answer has
# ended (Day 10 showed what it writes there). For comparing two caches that is just one more
# step.
#
# `torch.cat` copies the whole layer's keys every step, so each append costs as much as the cache
# is long (transformers' `DynamicCache` grows the same way). The package reserves every position
# once and fills it in place.
#
# ## 3. The package's cache
#
# `ContiguousKVCache(cfg, max_len)` allocates, for every layer, a K and a V tensor of shape
# (kv_heads, max_len, head_dim), zeros. `begin(positions)` moves two counters: `start`, the first
# position this step writes, and `length`, the positions filled once it has. `write` copies the
# step's rows into `[start, length)`; `attention` reads `[0, length)`.

# %%
budget = 8
cache = ContiguousKVCache(cfg, len(prompt) + budget)
per_token = cfg.kv_bytes_per_token(torch.float32)
total = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
print(f"{len(cache.k)} K tensors and {len(cache.v)} V tensors of shape {tuple(cache.k[0].shape)}")
print("bytes per position: 2 (K, V)", end=" ")
print(f"x {cfg.num_layers} x {cfg.num_kv_heads} x {cfg.head_dim} x 4 = {per_token:,}")
print(
    f"this cache: {cache.max_len} positions, {total:,} bytes; the model's whole context "
    f"({cfg.max_position_embeddings}): {cfg.max_position_embeddings * per_token / 1e6:.1f} MB"
)
assert per_token == 46_080 and total == cache.max_len * per_token

cache.begin(torch.arange(len(prompt)))
print(f"after begin(prefill of {len(prompt)}): start {cache.start}, length {cache.length}")
cache.begin(torch.tensor([len(prompt)]))
print(f"after begin(one decode token):   start {cache.start}, length {cache.length}")
try:
    cache.begin(torch.arange(cache.length, cache.length + budget))
except ValueError as e:
    print("caught:", e)
else:
    raise RuntimeError("a step past max_len should be refused")

# %% [markdown]
# The cache refuses a step that would not fit, instead of writing past its end. `decode_loop`
# sizes it for the prompt plus the request's token budget (never more than the context), so a
# short request does not pay for 8,192 positions; Day 13 measures what a fixed reservation like
# this wastes once many requests share memory.
#
# ## 4. Prefill, then decode
#
# This is `nanoserve.generate.decode_loop` spelled out. Prefill feeds every prompt token at its
# position and asks for logits at the last row only (`logits_at`); each decode step feeds one
# token at position `cache.length`, the next free one.

# %%
cache = ContiguousKVCache(cfg, len(prompt) + 4)
ids, positions, last = torch.tensor(prompt), torch.arange(len(prompt)), torch.tensor([len(prompt) - 1])
tokens = []
for step in range(4):
    cache.begin(positions)
    logits = model(ids, positions, cache, logits_at=last)
    kind = "prefill" if step == 0 else "decode "
    print(
        f"{kind} input {tuple(ids.shape)} positions {positions[0].item()}..{positions[-1].item()} -> "
        f"logits {tuple(logits.shape)}; cache filled to {cache.length}"
    )
    tokens.append(int(logits.argmax()))
    ids, positions, last = (
        torch.tensor([tokens[-1]]),
        torch.tensor([cache.length]),
        torch.zeros(1, dtype=torch.long),
    )
print("tokens:", tokens, repr(tok.decode(tokens)))
assert tokens == greedy_tokens(model, prompt, 4)

# %% [markdown]
# Inside each block, prefill attends with a causal mask over the (37, 37) block of the prompt;
# decode has one query that may see every key written so far, so `causal_attention` passes no
# mask at all.
#
# ## 5. The same tokens as the loop without a cache
#
# `cachebench.equal_row` runs a prompt both ways for 16 greedy tokens: `greedy_tokens` on the
# contiguous cache, and a loop that runs a `NoCache` forward over the whole sequence every step.
# It compares the tokens, bounds the logit difference at every step, and counts the token
# positions each loop pushed through the model. Neither loop is given EOS ids, so both run all 16
# steps even where the answer ends sooner: the first prompt's answer closes with `<|im_end|>` at
# its eighth token (section 2's tokens), and the eight tokens after it are generated past EOS.
# The script does three prompts; the notebook reruns the first and reads the other two back from
# the committed CSV.

# %%
t0 = time.perf_counter()
first_row = cachebench.equal_row(model, tok, cachebench.PROMPTS[0])
print(f"1 prompt in {time.perf_counter() - t0:.1f} s")
with open(cachebench.CSV_EQUAL) as f:
    equal = list(csv.DictReader(f))
assert {k: str(v) for k, v in first_row.items()} == equal[0], "rerun cachebench.py"
print(" | ".join(equal[0]))
for r in equal:
    print(" | ".join(r.values()))
assert all(r["identical"] == "yes" and r["max_abs_dlogit"] == "<1e-3" for r in equal)

# %% [markdown]
# 16 tokens after a 37-token prompt: the cached loop runs 52 positions through the model (the
# prompt once, then 15 single tokens; the 16th token needs no forward after it), the loop without
# a cache runs 712, because every step starts over.
#
# ## 6. A cache built wrong
#
# An off-by-one that looks harmless: on decode steps, attend over the positions written before
# this step, `[0, length - 1)`, forgetting the key the step itself just wrote. Prefill is
# untouched, so the first token is still right.


# %%
class ForgetsItself(ContiguousKVCache):
    def attention(self, layer, q):
        if q.shape[0] > 1:
            return super().attention(layer, q)
        k, v = self.k[layer][:, : self.length - 1], self.v[layer][:, : self.length - 1]
        return causal_attention(q, k, v, self.positions)


def check_logits_match(cached: list[torch.Tensor], plain: list[torch.Tensor], bound=cachebench.LOGIT_BOUND):
    """Every step's logits within `bound` of the no-cache loop's; raises at the first that is not."""
    for i, (a, b) in enumerate(zip(cached, plain)):
        worst = (a - b).abs().max().item()
        if not worst < bound:
            raise AssertionError(f"step {i}: max |logit difference| {worst:.2f}, bound {bound:g}")


plain = list(cachebench.no_cache_greedy(model, prompt, 6))
plain_tokens, plain_logits = [t for t, _ in plain], [lg for _, lg in plain]
check_logits_match(cachebench.cached_logits(model, prompt, plain_tokens), plain_logits)
print("ContiguousKVCache: within the bound at all 6 steps")
try:
    check_logits_match(cachebench.cached_logits(model, prompt, plain_tokens, ForgetsItself), plain_logits)
except AssertionError as e:
    print("ForgetsItself caught:", e)
else:
    raise RuntimeError("the off-by-one cache should have been caught")

# %% [markdown]
# The first step passes (it is prefill) and the second already fails, by more than 4 logits.
# The tokens are a much weaker witness. Let the broken cache generate on its own, greedily, and
# compare its picks with the right ones:

# %%
parted = {}
for text in cachebench.PROMPTS[:2]:
    ids = tok.encode_chat([{"role": "user", "content": text}])
    good = greedy_tokens(model, ids, 8)
    bad = cached_run(ForgetsItself(cfg, len(ids) + 8), ids, 7).argmax(-1).tolist()
    parted[text] = next(i for i, (a, b) in enumerate(zip(good, bad)) if a != b)
    print(f"{text!r}: first different token at index {parted[text]}")
    print(f"   right: {tok.decode(good)!r}\n   wrong: {tok.decode(bad)!r}")
assert list(parted.values()) == [6, 1]

# %% [markdown]
# On the first prompt the broken cache agrees for six tokens, `The capital of France is Paris`,
# and then puts a comma where the right model ends the sentence; on the haiku it goes wrong at
# the second token. A test that compared the first few tokens of the first prompt would have
# passed it. The logit gate fails it at the first decode step.
#
# ## 7. How the saving grows with the text
#
# At each length L, `cachebench.bench` times one step of each loop: the no-cache step is a
# forward over all L tokens, the cached step a forward over one token that attends over L
# (the fastest of a few rounds over all the lengths, on random ordinary tokens). The counts next
# to the times are facts; the times below are this notebook's own run, on whatever machine runs
# it. The notebook runs two short lengths once; the script five lengths, five rounds.

# %%
t0 = time.perf_counter()
rows = cachebench.bench(model, lengths=(64, 256), repeats=1)
print(f"{len(rows)} lengths in {time.perf_counter() - t0:.1f} s")
facts = ["length", "no_cache_tokens_per_step", "cached_tokens_per_step", "kv_cache_mb"]
print(" | ".join(facts))
for r in rows:
    print(" | ".join(str(r[c]) for c in facts))
with open(cachebench.CSV_BENCH) as f:
    committed = list(csv.DictReader(f))
by_length = {int(r["length"]): r for r in committed}
assert all(str(r[c]) == by_length[r["length"]][c] for r in rows for c in facts), "rerun cachebench.py"

# %%
# NBVAL_IGNORE_OUTPUT
for r in rows:
    print(
        f"L={r['length']:4d}: no cache {r['no_cache_ms']:7.1f} ms, cached {r['cached_ms']:6.1f} ms, "
        f"speed-up {r['speedup']}x"
    )

# %% [markdown]
# The script's full sweep, as committed (`day-11-cachebench.csv`, read back, not recomputed). Its
# `cpu` column, printed once below, names the machine that measured it: a 2-core AVX-512 CPU
# with bf16 instructions, running 2 threads. There the cached step stays between 18.7 and
# 20.9 ms at every length, while the step without a cache grows from 89.4 ms at 64 tokens to
# 1632.1 ms at 1,024: a speed-up of 4.8x at the shortest length and 78.2x at the longest.

# %%
shown = [c for c in committed[0] if c != "cpu"]  # the cpu column is the same on every row: printed once
print(" | ".join(shown))
for r in committed:
    print(" | ".join(r[c] for c in shown))
print("measured on", committed[0]["cpu"])

# %% [markdown]
# ## 8. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
L = [int(r["length"]) for r in committed]

ax = axes[0, 0]
ax.plot(
    L,
    [float(r["no_cache_ms"]) for r in committed],
    "o-",
    color="tab:red",
    label="no cache: forward over L tokens",
)
ax.plot(
    L,
    [float(r["cached_ms"]) for r in committed],
    "o-",
    color="tab:green",
    label="cached: one token attends over L",
)
ax.plot(
    [r["length"] for r in rows],
    [r["no_cache_ms"] for r in rows],
    "x",
    color="tab:red",
    ms=9,
    label="this notebook's run",
)
ax.plot([r["length"] for r in rows], [r["cached_ms"] for r in rows], "x", color="tab:green", ms=9)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("sequence length L (tokens)")
ax.set_ylabel("one step (ms, log)")
ax.set_title("Time for the next token (committed sweep; x: this run)")
ax.legend(fontsize=8)

ax = axes[0, 1]
ax.plot(L, [float(r["speedup"]) for r in committed], "o-", color="tab:blue", label="committed sweep")
ax.plot(
    [r["length"] for r in rows],
    [r["speedup"] for r in rows],
    "x",
    color="tab:blue",
    ms=9,
    label="this notebook's run",
)
for r in committed:
    ax.annotate(
        f"{float(r['speedup']):.0f}x",
        (int(r["length"]), float(r["speedup"])),
        xytext=(4, -12),
        textcoords="offset points",
        fontsize=8,
    )
ax.set_xscale("log", base=2)
ax.set_xlabel("sequence length L (tokens)")
ax.set_ylabel("no-cache step / cached step")
ax.set_title("Speed-up of one decode step")
ax.legend(fontsize=8)

ax = axes[1, 0]
P = int(equal[0]["prompt_tokens"])
new = range(1, 1025)
ax.plot(new, [n * P + n * (n - 1) // 2 for n in new], color="tab:red", label=f"no cache: n·{P} + n(n-1)/2")
ax.plot(new, [P + n - 1 for n in new], color="tab:green", label=f"cached: {P} + n - 1 (each position once)")
for r in equal:
    n = int(r["new_tokens"])
    ax.plot(n, int(r["tokens_forwarded_no_cache"]), "s", color="tab:red", ms=5)
    ax.plot(n, int(r["tokens_forwarded_cached"]), "s", color="tab:green", ms=5)
ax.plot([], [], "s", color="gray", label="section 5's prompts (37 to 41 tokens), 16 new")
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel(f"tokens generated n after a {P}-token prompt")
ax.set_ylabel("token positions forwarded in all (log)")
ax.set_title("Work to generate n tokens, one at a time")
ax.legend(fontsize=8)

ax = axes[1, 1]
lengths = list(range(0, 2049, 64))
ax.plot(
    lengths, [n * per_token / 1e6 for n in lengths], color="tab:purple", label="K/V of the positions filled"
)
ax.axhline(
    2048 * per_token / 1e6, color="k", ls="--", lw=1, label="ContiguousKVCache(cfg, 2048): reserved up front"
)
ax.fill_between(
    lengths,
    [n * per_token / 1e6 for n in lengths],
    2048 * per_token / 1e6,
    color="gray",
    alpha=0.2,
    label="reserved, not yet used (Day 13)",
)
ax.set_xlabel("positions filled")
ax.set_ylabel("MB (fp32)")
ax.set_title(f"K/V memory: {per_token:,} bytes a position, 30 layers")
ax.legend(fontsize=8, loc="lower right")

fig.suptitle(
    "Day 11: a contiguous K/V cache against re-running the sequence (SmolLM2-135M, fp32, CPU)", fontsize=14
)
fig.tight_layout()
png = diagram_path("day11-kvcache.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **transformers** has both of today's caches. `DynamicLayer.update`
#   (`src/transformers/cache_utils.py`) appends each step's keys and values with `torch.cat`
#   along the sequence axis, like section 2's `GrowingCache`, so every step copies the layer's
#   whole cache. `StaticLayer` reserves `[batch, heads, max_cache_len, head_dim]` up front and
#   writes in place with `index_copy_` at `cache_position`, so its tensors keep their addresses
#   (what `torch.compile` and CUDA graphs need); unlike ours it hands attention all
#   `max_cache_len` positions and masks the unused ones (`get_mask_sizes` returns
#   `max_cache_len`), where `ContiguousKVCache.attention` slices `[0, length)`.
# * **llama.cpp** keeps one K and one V tensor per layer for the whole context, `kv_size` cells,
#   in `llama_kv_cache` (`src/llama-kv-cache.h`). The cells are a ring that several sequences can
#   share: `find_slot` looks for free cells for each micro-batch, `cpy_k` / `cpy_v` write the new
#   rows at those cell indices, and `get_k` / `get_v` return views over the first `n_kv` cells,
#   described in the header as a heuristic to avoid attending the full cache while it is not
#   yet used: the same idea as our slice. V is stored transposed by default (`v_trans`).
# * **nano-vllm** (and vLLM) never has a per-sequence contiguous cache: the K/V memory is paged
#   from the start. `ModelRunner.allocate_kv_cache` (`nanovllm/engine/model_runner.py`) sizes one
#   tensor `(2, layers, blocks, block_size, kv_heads, head_dim)` from the free GPU memory;
#   `prepare_prefill` and `prepare_decode` compute a `slot_mapping` for the step's tokens, and
#   `store_kvcache` (a Triton kernel in `nanovllm/layers/attention.py`) writes K and V there.
#   Prefill attends with `flash_attn_varlen_func`, decode with `flash_attn_with_kvcache` over
#   block tables. Days 13 to 18 build that here.
#
# ## Try it
#
# 1. **Break the cache on purpose, in the package.** Put section 6's off-by-one into the
#    package's class inside `def pytest_configure(config):` in a file `breakcache.py`
#    (`ContiguousKVCache.attention = ...`, slicing `[:, : self.length - 1]` when `q.shape[0] ==
#    1`) and run `PYTHONPATH=. pytest -p breakcache tests/test_model.py -k "tiny or cache"`: two
#    tests fail, `test_cache_gives_the_same_logits_as_recomputing` and
#    `test_tiny_greedy_continuation_matches_transformers`. Without the plugin, all pass.
# 2. **Count the work without running it.** For a prompt of P tokens and n greedy tokens, derive
#    how many token positions each loop forwards, then check your formulas on the three rows of
#    section 5: with `P, n = int(r["prompt_tokens"]), int(r["new_tokens"])` for each row `r` of
#    `equal`, `int(r["tokens_forwarded_no_cache"]) == n * P + n * (n - 1) // 2` and
#    `int(r["tokens_forwarded_cached"]) == P + n - 1` must both be `True` (712 and 52 on the
#    first row).
# 3. **Reproduce the equality table.** `python days/day11/cachebench.py --lengths 64
#    --out-equal /tmp/e.csv --out-bench /tmp/b.csv`, then `diff /tmp/e.csv
#    days/day11/day-11-equal.csv` must print nothing: three prompts, identical tokens, every
#    step's logits within 1e-3 of the loop without a cache.

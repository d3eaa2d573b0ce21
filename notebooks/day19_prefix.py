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
# # Day 19 — Prefix sharing: hashed blocks and reference counts
#
# A chat client keeps no state on the server: every turn it sends the whole conversation
# again, the system prompt, every earlier question and every earlier answer, and then the new
# question. Day 11 showed why the keys and values of a prefix do not depend on what comes
# after it, so all but the newest part of that prompt was already computed on the previous
# turn. The K/V is still in the pool; what is missing is a way to find it.
#
# The engine finds it by name. Every full block of 16 tokens gets a name that covers the block
# and everything before it, a chained SHA-256 (`nanoserve.blocks.block_hashes`). When a block's
# K/V has been written, the allocator files the block under its name; when a prompt arrives,
# its leading blocks whose names are on file are handed to the new sequence instead of fresh
# ones, and a reference count says how many tables hold each block.
#
# 1. the chained name of a block, by hand, against `block_hashes`,
# 2. two requests sharing a prefix: block tables, reference counts, and what freeing does,
# 3. a real multi-turn chat with SmolLM2 through the engine: how many blocks each turn finds,
# 4. the same turn with the cache off (the engine before today): same tokens, more work,
# 5. why the name must be chained: the same block after a different prefix, and a planted
#    hash of the block's own tokens that shares K/V it must not,
# 6. the script's full table (`days/day19/prefixbench.py`) and the diagram.

# %%
import hashlib
import random
import struct
import sys
import time
from unittest import mock

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

import nanoserve.blocks as blocks
from nanocourse import REPO, diagram_path, engine_as_of, read_csv, recording_cache, tiny_llama
from nanoserve.bench import cpu_line
from nanoserve.blocks import BlockAllocator, BlockTable, block_hashes
from nanoserve.generate import greedy_tokens
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day19"))
import prefixbench  # the day's script: the notebook runs its functions and reads its table

# One thread: the counts this notebook checks do not depend on it, and on a machine shared with
# other jobs two threads that wait for each other at every op slow down far more than one.
torch.set_num_threads(1)
MODEL_DIR = fetch_default_model()
t0 = time.perf_counter()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
print(f"SmolLM2-135M-Instruct, fp32, loaded in {time.perf_counter() - t0:.1f} s")
BS = prefixbench.BLOCK_SIZE
committed = read_csv(prefixbench.CSV_CHAT)

# %% [markdown]
# ## 1. The name of a block
#
# Block i of a sequence holds tokens [16 i, 16 i + 16). Its name is SHA-256 over two things:
# the name of block i - 1 (32 zero bytes for the first block) and the block's 16 token ids,
# packed as little-endian 64-bit integers. So the name of block i depends on every token from
# position 0 to the end of block i, and a partial last block has no name at all. In a few lines:


# %%
def chained_names(tokens, block_size):
    parent, names = bytes(32), []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}q", *block)).digest()
        names.append(parent)
    return names


users = prefixbench.CONVERSATIONS["A"]
turn1 = tok.encode_chat([{"role": "user", "content": users[0]}])
mine, theirs = chained_names(turn1, BS), block_hashes(turn1, BS)
print(f"turn 1 of the chat: {len(turn1)} tokens = {len(turn1) // BS} full blocks + {len(turn1) % BS}")
for i, h in enumerate(theirs):
    print(f"  block {i}: tokens {i * BS}-{i * BS + BS - 1}, name {h.hex()[:16]}...")
assert mine == theirs and len(theirs) == len(turn1) // BS

tiny_case = [5, 6, 5, 6, 9]
names = block_hashes(tiny_case, 2)
print("block_hashes([5, 6, 5, 6, 9], 2):", [h.hex()[:8] for h in names])
assert chained_names(tiny_case, 2) == names and len(names) == 2 and names[0] != names[1]

# %% [markdown]
# The second example holds the same two tokens (5, 6) in both of its full blocks, yet the two
# names differ, because the second one also covers the first block. The token 9 is a partial
# block and gets no name. A name therefore stands for a whole prefix, which is what makes it
# safe to share: two blocks with the same name hold the K/V of the same tokens at the same
# positions after the same history.
#
# ## 2. Two requests, one prefix
#
# The allocator is integer bookkeeping, so the real chat template's tokens can go through it
# without running the model. Take one exchange, the user's first question and a reply, and two
# different follow-ups. The engine files a block under its name with `cache_full_blocks` once
# the block's K/V is written; here that is done by hand after the first prompt is "computed".

# %%
exchange = [
    {"role": "user", "content": users[0]},
    {"role": "assistant", "content": "Start with simple dishes and learn a few basic skills."},
]
x = tok.encode_chat(exchange + [{"role": "user", "content": users[1]}])
y = tok.encode_chat(exchange + [{"role": "user", "content": "Which knife should I buy?"}])
common = next(i for i, (a, b) in enumerate(zip(x, y)) if a != b)
print(f"x: {len(x)} tokens, y: {len(y)} tokens, the same first {common} ({common // BS} full blocks)")

alloc = BlockAllocator(num_blocks=12, block_size=BS)
story = {}  # after each event: every block's ref count, and the blocks filed under a name


def snap(event):
    named = {alloc.cached_block(h) for h in block_hashes(x, BS) + block_hashes(y, BS)} - {None}
    story[event] = ([alloc.ref_count(b) for b in range(alloc.num_blocks)], named)


tx, ty = BlockTable(BS), BlockTable(BS)
print("x cached:", alloc.allocate_prompt(tx, x), "tokens; table", tx.blocks)
alloc.cache_full_blocks(tx, x)  # x's K/V is written: its full blocks are filed under their names
snap("x admitted")
print("y cached:", alloc.allocate_prompt(ty, y), "tokens; table", ty.blocks)
snap("y admitted")
refs = {b: alloc.ref_count(b) for b in sorted(set(tx.blocks + ty.blocks))}
print("ref counts:", refs, "| free:", alloc.num_free, "of", alloc.num_blocks)
alloc.check_invariants([tx, ty])
shared = [b for b in ty.blocks if b in tx.blocks]
assert ty.num_cached_tokens == common // BS * BS and all(alloc.ref_count(b) == 2 for b in shared)

# %% [markdown]
# The two prompts agree on their first 58 tokens, and three full blocks of them, 48 tokens, have
# names: `y` found x's first three blocks and took fresh ones for the rest. The model computes
# y's tokens from 48 on as usual; tokens 0 to 47 it does not compute at all. Tokens 48 to 57 are
# the same in both prompts too, but they sit in a block whose last tokens differ, so that
# block's name differs and y computes them again. The three shared blocks have two owners
# each, and `check_invariants` agrees that each count equals the number of live tables holding
# the block.
#
# Freeing a table drops its references. The shared blocks stay with the other owner; a block
# whose count falls to 0 goes to the free list but keeps its name, so a later prompt can still
# claim it (Day 20 follows the free list further):

# %%
alloc.free(tx)
snap("x finished")
print("x finished: ref counts", {b: alloc.ref_count(b) for b in refs}, "| free:", alloc.num_free)
alloc.check_invariants([ty])
assert all(alloc.ref_count(b) == 1 for b in shared)
alloc.cache_full_blocks(ty, y)
alloc.free(ty)
snap("y finished")
print("y finished: ref counts", {b: alloc.ref_count(b) for b in refs}, "| free:", alloc.num_free)
on_file = [alloc.cached_block(h) for h in block_hashes(y, BS)]
print("blocks still filed under y's names:", on_file)
tz = BlockTable(BS)
print("a third request with y's prompt finds", alloc.allocate_prompt(tz, y), "tokens cached:", tz.blocks)
assert on_file[: len(shared)] == shared and tz.blocks[: len(on_file)] == on_file
alloc.free(tz)

# %% [markdown]
# The third request with y's prompt finds all four of y's full blocks, 64 of its 70 tokens, and
# computes the last 6, a partial block, which has no name. Had the prompt been exactly 64
# tokens, it would still have found only three: the last prompt token is always computed,
# because its logits pick the first new token, so a prompt never comes wholly from the cache.
#
# ## 3. A real chat, turn by turn
#
# `prefixbench.chat` runs a conversation through the engine the way a chat client drives a
# server. The engine is `Engine` (`add_request`, `step`), whose API day 34 builds; it runs here
# as it stood on day 19 (`engine_config(19, ...)`), one request at a time. Turn t's prompt is
# the chat template over every message so far, and the model's greedy reply (16 tokens at most)
# becomes the next assistant message. After each turn's first step it reads how many prompt
# tokens the sequence's table got from the cache. The notebook runs the first three turns of
# conversation A; the script runs all five, then conversation B.

# %%
t0 = time.perf_counter()
on = prefixbench.chat(prefixbench.chat_engine(model, tok), tok, {"A": users[:3]})
print(f"3 turns in {time.perf_counter() - t0:.1f} s")
for r in on:
    print(f"turn {r['turn']}: {r['user']!r}\n   -> {r['text']!r}")

# %%
facts = ["prompt_tokens", "prompt_blocks", "cached_blocks", "cached_tokens", "computed_on", "reply_tokens"]
print("turn | " + " | ".join(facts))
for r in on:
    n = len(r["prompt"])
    row = [n, n // BS, r["cached"] // BS, r["cached"], n - r["cached"], len(r["tokens"])]
    print(f"{r['turn']} | " + " | ".join(map(str, row)))
    want = committed[r["turn"] - 1]
    assert [str(v) for v in row] == [want[c] for c in facts] and want["conversation"] == "A"

# %% [markdown]
# Turn 1 finds nothing: the engine is new. Turn 2's prompt begins with turn 1's prompt and
# reply, and finds 3 of its 4 full blocks; turn 3 finds 5 of 6. What does a turn compute,
# then? The boundary of turn 2, decoded: the cached part ends inside turn 1's reply.

# %%
second = on[1]
cut = second["cached"]
print(f"turn 2, tokens {cut - 12}..{cut - 1} (cached): {tok.decode(second['prompt'][cut - 12 : cut])!r}")
print(f"turn 2, tokens {cut}..{len(second['prompt']) - 1} (computed):")
print(repr(tok.decode(second["prompt"][cut:], skip_special_tokens=False)))
previous = len(on[0]["prompt"]) + len(on[0]["tokens"])
print(f"turn 1 left {previous} tokens, of which the engine computed {previous - 1}: "
      f"{(previous - 1) // BS} full blocks filed")  # fmt: skip
assert cut == (previous - 1) // BS * BS

# %% [markdown]
# Three kinds of token are computed on a turn: the tail of the previous turn that did not fill
# a block (here the last 10 tokens of turn 1's reply), the template tokens that close the reply
# and open the new message, and the new message itself. The last token a turn generates (here
# the 16th) never had its K/V computed: the sequence ended as soon as it was sampled. So the
# most a turn can find is the full blocks of the previous sequence's first `previous - 1`
# tokens, and turn 2 found exactly that.
#
# ## 4. The same turn with the cache off
#
# `enable_prefix_caching=False` is the engine as it was through Day 18: every prompt computed
# from position 0. Turn 3's prompt through such an engine must give the same reply, computing
# all of its tokens:

# %%
t0 = time.perf_counter()
off = prefixbench.run_turn(
    prefixbench.chat_engine(model, tok, False), on[2]["prompt"], prefixbench.MAX_TOKENS
)
print(f"turn 3 without the cache in {time.perf_counter() - t0:.1f} s")
print(f"cached: {off['cached']} tokens; reply equal to the cached run's: {off['tokens'] == on[2]['tokens']}")
print(f"prompt tokens computed: {len(on[2]['prompt']) - on[2]['cached']} with the cache, "
      f"{len(on[2]['prompt'])} without")  # fmt: skip
assert off["cached"] == 0 and off["tokens"] == on[2]["tokens"]

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
print(
    f"turn 3's first step (prefill and the first token): {1e3 * on[2]['first_s']:.0f} ms with the "
    f"cache, {1e3 * off['first_s']:.0f} ms without"
)

# %% [markdown]
# These two times are this execution's and change from run to run. The script's table in
# section 6, measured on a quiet machine, has both for every turn: without the cache the first
# step grows with the prompt, from 136.3 ms at 42 tokens to 439.9 ms at 177, and with it every
# turn after the engine's first stays between 93.3 and 119.1 ms. The counts do not depend on
# the machine at all: with the cache a turn computes about a block and a half here (27 and 28
# tokens on turns 2 and 3), however long the conversation has become, and without it every
# turn computes the whole conversation again.
#
# ## 5. Why the name is chained
#
# Give two prompts the same second block after different first blocks. The chained names of
# the second blocks differ, so a prompt that shares only the second block shares nothing:

# %%
rng = random.Random(19)
draw = lambda n: [rng.randrange(256) for _ in range(n)]  # noqa: E731
a_block, b_block, same = draw(4), draw(4), draw(4)
p, q = a_block + same + draw(3), b_block + same + draw(3)
hp, hq = block_hashes(p, 4), block_hashes(q, 4)
print(f"block 1 holds {same} in both; names {hp[1].hex()[:8]} and {hq[1].hex()[:8]}")
small = BlockAllocator(16, block_size=4)
tp, tq = BlockTable(4), BlockTable(4)
small.allocate_prompt(tp, p)
small.cache_full_blocks(tp, p)
print("q after p: cached", small.allocate_prompt(tq, q), "tokens")
assert hp[0] != hq[0] and hp[1] != hq[1] and tq.num_cached_tokens == 0

# %% [markdown]
# Now the planted version: a name made from the block's own tokens alone, patched into the
# package for the length of a `with` block. Under it, `same`'s name is the same wherever the
# block sits, and a prompt that *begins* with `same` finds p's second block, whose K/V was
# computed at positions 4 to 7, after p's first block:


# %%
def own_tokens_only(parent, block_tokens):
    """The planted name: ignores the parent, so equal blocks get equal names anywhere."""
    return hashlib.sha256(struct.pack(f"<{len(block_tokens)}q", *block_tokens)).digest()


r = same + draw(6)  # begins with p's second block
with mock.patch.object(blocks, "_chain", own_tokens_only):
    print("planted names: p's block 1 and r's block 0 equal:", block_hashes(p, 4)[1] == block_hashes(r, 4)[0])
    planted = BlockAllocator(16, block_size=4)
    tp, tr = BlockTable(4), BlockTable(4)
    planted.allocate_prompt(tp, p)
    planted.cache_full_blocks(tp, p)
    found = planted.cached_block(block_hashes(r, 4)[0])
    print(f"the name of r's block 0 is on file: block {found} (p's {tp.blocks.index(found)})")
    print("r cached by the package's allocator:", planted.allocate_prompt(tr, r), "tokens")
    assert found == tp.blocks[1] and tr.num_cached_tokens == 0

# %% [markdown]
# The package's allocator did not take it. A name is only a lookup: before a block counts as a
# hit, `_cached_prefix` compares what the block holds, its parent's name and its tokens, with
# what the prompt needs, and p's block has p's first block as its parent, not the root. That
# second check is there for hash collisions, and here it also catches a broken hash.
#
# Take the check away too, a prefix cache that trusts the name alone, and run it in an engine
# over the tiny random-weight Llama. The gate this time is what sharing must preserve: the K/V
# in every slot of a sequence's table must equal the K/V its own tokens give at those positions
# when computed from scratch.


# %%
class NameOnly(BlockAllocator):
    """A prefix cache that believes names: no check of the block's contents."""

    def _cached_prefix(self, token_ids, use_cache=True):
        usable = (len(token_ids) - 1) // self.block_size * self.block_size
        hits = []
        for h in block_hashes(token_ids[:usable], self.block_size):
            if (block := self._block_of.get(h)) is None:
                break
            hits.append(block)
        return hits


tiny = tiny_llama(0)


def tiny_engine(allocator=None):
    per_block = tiny.cfg.kv_bytes_per_token(torch.float32) * 4
    eng = engine_as_of(19, tiny, None, block_size=4, max_model_len=128, kv_budget=65 * per_block, max_batch=4)
    if allocator is not None:
        eng.allocator = eng.scheduler.allocator = allocator(eng.pool.num_blocks, 4)
    return eng


def run_and_keep_table(eng, prompt, n=6):
    """Run prompt to the end; its tokens, cached count and block table as it was after prefill."""
    rid = eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    seq, tokens, kept = eng.requests[rid].seq, [], None
    while eng.has_unfinished():
        tokens += [t for o in eng.step() for t in o.new_token_ids]
        kept = kept or (seq.block_table.num_cached_tokens, list(seq.block_table.blocks))
    return tokens, *kept


def check_kv_is_own(eng, prompt, table_blocks):
    """Every layer's K in the table's slots for the prompt's positions equals a fresh forward's."""
    rec, pos = recording_cache(), torch.arange(len(prompt))
    rec.begin(pos)
    tiny(torch.tensor(prompt), pos, rec)
    slots = BlockTable(4, table_blocks).slots(0, len(prompt))
    for layer, want in rec.kept.items():
        got = eng.cache.k[layer][slots]  # (N, kv_heads, head_dim)
        bad = (got - want).abs().amax(dim=(1, 2))  # (N,)
        if bad.max() > 1e-5:
            wrong = (bad > 1e-5).nonzero().flatten().tolist()
            raise AssertionError(f"layer {layer}: the K at positions {wrong} is not this prompt's own")


reference = greedy_tokens(tiny, r, 6)
for label, allocator, name in [
    ("package allocator, chained names", None, blocks._chain),
    ("name-only cache, chained names", NameOnly, blocks._chain),
    ("name-only cache, planted names", NameOnly, own_tokens_only),
]:
    with mock.patch.object(blocks, "_chain", name):
        eng = tiny_engine(allocator)
        run_and_keep_table(eng, p)
        tokens, cached, table = run_and_keep_table(eng, r)
    try:
        check_kv_is_own(eng, r, table)
        verdict = "K/V is r's own"
    except AssertionError as e:
        verdict = f"caught: {e}"
    print(f"{label}: r found {cached} cached; tokens equal to eager: {tokens == reference}; {verdict}")

# %% [markdown]
# With chained names the name-only cache is harmless: a name still means a prefix, and r shares
# nothing. With the planted names it hands r p's block for r's positions 0 to 3, and the K/V
# check fails at exactly those positions, already in layer 0, where a key depends only on its
# token and its position: the slots hold keys rotated for positions 4 to 7, not 0 to 3 (in
# later layers they were also computed after p's first block). The six greedy tokens, here,
# came out the same as the eager reference's: the tiny random model did not notice. As on Day
# 11, equal text is the weaker witness; what the slots hold is the stronger one.
#
# ## 6. The full table, and the diagram
#
# The script's run, `day-19-chat.csv`, read back: all five turns of conversation A, then three
# of conversation B on the same engine, the cache on and off (the replies asserted equal):

# %%
columns = ["conversation", "turn", "prompt_tokens", "prompt_blocks", "cached_blocks", "computed_on"]
columns += ["computed_off", "hit_rate", "first_step_ms_on", "first_step_ms_off"]
print(" | ".join(columns))
for row in committed:
    print(" | ".join(row[c] for c in columns))
total = {c: sum(int(row[c]) for row in committed) for c in ("prompt_tokens", "cached_tokens", "computed_on")}
print(
    f"all turns: {total['cached_tokens']} of {total['prompt_tokens']} prompt tokens from the cache "
    f"({total['cached_tokens'] / total['prompt_tokens']:.0%}); computed {total['computed_on']} "
    f"against {total['prompt_tokens']}"
)
b1 = next(row for row in committed if row["conversation"] == "B" and row["turn"] == "1")
b_first = tok.encode_chat([{"role": "user", "content": prefixbench.CONVERSATIONS["B"][0]}])
print(f"B's turn 1 found {b1['cached_blocks']} block(s), shared with every conversation:")
print(repr(tok.decode(b_first[: int(b1["cached_tokens"])], skip_special_tokens=False)))
assert block_hashes(b_first, BS)[0] == block_hashes(turn1, BS)[0] != block_hashes(b_first, BS)[1]

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
labels = [f"{row['conversation']}{row['turn']}" for row in committed]
cached_t = [int(row["cached_tokens"]) for row in committed]
computed_t = [int(row["computed_on"]) for row in committed]

ax = axes[0, 0]
ax.bar(labels, cached_t, color="tab:green", label="from the prefix cache")
ax.bar(labels, computed_t, bottom=cached_t, color="tab:orange", label="computed")
for i, row in enumerate(committed):
    ax.text(i, int(row["prompt_tokens"]) + 2, f"{float(row['hit_rate']):.0%}", ha="center", fontsize=8)
ax.set_xlabel("conversation and turn")
ax.set_ylabel("prompt tokens")
ax.set_title("Each turn's prompt: found in the cache or computed (hit rate on top)")
ax.legend(fontsize=8)

ax = axes[0, 1]
ax.plot(labels, [sum(computed_t[: i + 1]) for i in range(len(labels))], "o-", color="tab:orange",
        label="prefix cache on")  # fmt: skip
off_t = [int(row["computed_off"]) for row in committed]
ax.plot(labels, [sum(off_t[: i + 1]) for i in range(len(labels))], "s-", color="tab:red",
        label="prefix cache off (through Day 18)")  # fmt: skip
ax.set_xlabel("conversation and turn")
ax.set_ylabel("prompt tokens computed, running total")
ax.set_title("Prefill work over the whole run (same replies both ways)")
ax.legend(fontsize=8)

ax = axes[1, 0]
for i, row in enumerate(committed):
    n, hits = int(row["prompt_tokens"]), int(row["cached_blocks"])
    for b in range(-(-n // BS)):
        full = b < n // BS
        color = "tab:green" if b < hits else "tab:orange"
        ax.add_patch(plt.Rectangle((b, i), 0.9, 0.8, color=color, alpha=1.0 if full else 0.4,
                                   hatch=None if full else "//"))  # fmt: skip
ax.set_xlim(0, max(-(-int(row["prompt_tokens"]) // BS) for row in committed) + 0.5)
ax.set_ylim(len(committed), -0.2)
ax.set_yticks([i + 0.4 for i in range(len(labels))], labels)
ax.set_xlabel(f"block of the prompt ({BS} tokens)")
ax.set_title("Blocks of each prompt: green shared, orange computed, hatched partial")

ax = axes[1, 1]
events = list(story)
used = sorted({b for counts, _ in story.values() for b, n in enumerate(counts) if n})
grid = [[story[e][0][b] for b in used] for e in events]
ax.imshow(grid, cmap="Blues", vmin=0, vmax=2.5, aspect="auto")
for i, e in enumerate(events):
    for j, b in enumerate(used):
        n, named = story[e][0][b], story[e][1]
        note = "" if n or b not in named else "\nfree, named"
        ax.text(j, i, f"{n}{note}", ha="center", va="center", fontsize=8)
ax.set_xticks(range(len(used)), [f"block {b}" + ("\n(shared)" if b in shared else "") for b in used])
ax.set_yticks(range(len(events)), events)
ax.set_title("Section 2: reference counts of x's and y's blocks")

fig.suptitle("Day 19: prefix sharing on a multi-turn SmolLM2 chat (16-token blocks, fp32, CPU)", fontsize=14)
fig.tight_layout()
png = diagram_path("day19-prefix.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** (V1) names blocks the same way. `hash_block_tokens` in
#   `vllm/v1/core/kv_cache_utils.py` hashes the parent block's hash, the block's token ids and
#   a tuple of extra keys (a LoRA adapter, hashes of image inputs, a per-request `cache_salt`
#   that keeps one tenant's prefixes away from another's), so a block is shared only when all
#   of them match; the design page "Automatic Prefix Caching" draws the chain. The first block's
#   parent is `NONE_HASH`, a random value per process unless `PYTHONHASHSEED` is set, where ours
#   is 32 zero bytes, and `--prefix-caching-hash-algo` picks the hash function (SHA-256
#   variants, and xxhash in recent releases). `BlockPool` keeps `cached_block_hash_to_block`,
#   each `KVCacheBlock` has a `ref_cnt`, and `KVCacheManager.get_computed_blocks` caps a hit
#   at the prompt's length minus one so the last token is always computed for its logits, the
#   rule section 2 met. Prefix caching is on by default in V1.
# * **SGLang**'s RadixAttention (`python/sglang/srt/mem_cache/radix_cache.py`) keeps no hashes:
#   `RadixCache` is a radix tree whose edges are runs of token ids, and `match_prefix` walks it
#   from the root, so the prefix is checked token by token and never by name. A node's
#   `lock_ref` counts the running requests using it (our reference count), and only unlocked
#   leaves can be evicted. With the default page size of 1 a match can end at any token,
#   so there is no partial block to recompute, at the price of a tree walk per request.
# * **llama.cpp**'s server reuses per slot rather than across a pool: with `cache_prompt` (a
#   request field, on by default in recent builds) a slot compares the new prompt's tokens with
#   what its KV cells still hold and keeps the longest common prefix, and `--cache-reuse N`
#   goes further, shifting matching chunks of at least N tokens that come after a difference.
#   A chat that lands on the same slot each turn gets today's saving; two conversations on two
#   slots do not share a system prompt.
# * **TensorRT-LLM** calls it KV cache block reuse (`KvCacheConfig(enable_block_reuse=True)`):
#   blocks of finished requests stay in a tree keyed by their tokens, and a new request's
#   matching blocks are taken from it, as here.
#
# ## Try it
#
# 1. **Break the chain in the package.** In `nanoserve/blocks.py`, make `_chain` ignore
#    `parent` (hash `struct.pack(...)` alone), run `pytest tests/test_blocks.py -k chain`, and
#    watch `test_block_hashes_chain_over_the_whole_prefix` fail. Then run section 5 of this
#    notebook: the package's allocator still refuses the wrong share, because its contents check
#    compares the parent. Undo the change.
# 2. **Predict a turn.** Before running it, work out turn 4's `cached_blocks` from turn 3's row
#    (prompt 108 tokens, reply 16): `(108 + 16 - 1) // 16` must equal the script's 7.
# 3. **A system prompt of your own.** Give every conversation the same long system message
#    (`{"role": "system", "content": ...}` first): conversation B's turn 1 must now find every
#    full block that ends before the first user message's own words, and `block_hashes` of the
#    two conversations' first prompts must agree exactly up to that block.

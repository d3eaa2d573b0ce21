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
# # Day 65 — Sliding windows in a paged cache: Gemma 3
#
# Gemma 3 is the third family the engine runs, and the first whose layers do not all read the
# same positions. Of Gemma 3 270M's 18 layers, 15 attend only to their latest 512 positions (a
# *sliding window*); layers 5, 11 and 17 attend to the whole context. The rest of the family is
# forward-pass detail (four norms a block, GELU in the MLP, the embedding scaled by
# sqrt(hidden), two rotary bases), written in `nanoserve/models/gemma.py` and held to
# transformers by `tests/test_gemma.py`. This notebook is about the window, because the window
# reaches past the model into the cache:
#
# 1. which positions a sliding layer reads: the band mask by hand, against transformers' own
#    mask function, and a tiny random Gemma 3 held to transformers past its window,
# 2. which blocks a sliding layer still needs for a row, worked out by hand and against
#    `WindowBlocks`, the bookkeeping that gives the sliding layers blocks of their own; and
#    what that does to prefix caching,
# 3. a window one position off, caught by token equality through the paged engine
#    (`days/day65/windowbench.py`), and a block given back one block early, which the tokens
#    do not show and `WindowBlocks.check_rows` catches,
# 4. the memory: the K/V bytes one row holds at contexts up to 4,096 with and without freeing
#    what has left the window, at Gemma 3 270M's cache geometry,
# 5. the diagram.
#
# The engine runs with today's defaults: the budget schedule (day 57), decode attention `auto`
# (day 58's native kernel where it builds), linears `auto` (day 59's packed ones where oneDNN
# can), fp32 weights and K/V. Its decode steps run as torch ops: `decode_step="auto"` fuses
# them into one native call (day 61) only for quantized weights, and these are fp32.

# %%
import dataclasses
import sys
import tempfile
import time
import warnings
from pathlib import Path

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, as_text, diagram_path, read_csv
from nanoserve.bench import cpu_line
from nanoserve.blocks import WindowBlocks
from nanoserve.config import EngineConfig
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.engine import Engine
from nanoserve.generate import greedy_tokens
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams

sys.path.insert(0, str(REPO / "days" / "day65"))
with warnings.catch_warnings():  # transformers' import warns about tqdm's notebook widgets
    warnings.simplefilter("ignore")
    import transformers
    import windowbench  # the day's script: the notebook calls its functions and reads its tables
    from transformers.masking_utils import sliding_window_causal_mask_function

transformers.utils.logging.set_verbosity_error()
torch.manual_seed(0)
print(cpu_line())
WORK = Path(tempfile.mkdtemp(prefix="day65-"))
T0 = time.perf_counter()




# %% [markdown]
# ## 1. Which positions a sliding layer reads
#
# A layer with a window of `w` lets the query at position `p` attend to the keys `j` with
# `p - w < j <= p`: its own position and the `w - 1` before it. Below `w` positions that is the
# causal mask; past it, a band of constant width moves along the diagonal. Written out for 16
# positions and the window of 8 that the tiny model below uses:

# %%
def band(n: int, window: int) -> torch.Tensor:
    """(n, n) bool: query p reads key j when p - window < j <= p."""
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j <= p) & (j > p - window)


N, W = 16, 8
mask = band(N, W)
for p in range(N):
    keys = "".join("#" if m else "." for m in mask[p].tolist())
    print(f"query {p:>2}  {keys}  {int(mask[p].sum())} keys")
theirs = sliding_window_causal_mask_function(W)(torch.tensor(0), torch.tensor(0), *torch.meshgrid(
    torch.arange(N), torch.arange(N), indexing="ij"))  # fmt: skip
differs = [p for p in range(N) if not torch.equal(mask[p], band(N, N)[p])]
print(f"equal to transformers' sliding_window_causal_mask_function({W}): {torch.equal(mask, theirs)}")
print(f"queries whose keys differ from a causal mask's: {differs}")
assert torch.equal(mask, theirs) and differs == list(range(W, N))
assert not torch.equal(band(N, W + 1), theirs) and not torch.equal(band(N, W - 1), theirs)

# %% [markdown]
# The band equals the mask transformers builds for Gemma 3's sliding layers, and a window of 9
# or 7 does not. Queries 0 to 7 see exactly what a causal mask shows them; from query 8 on, the
# oldest key drops out at every step, so every query reads 8 keys. This is why a model with a
# window can be right on every short test and wrong on every long one: nothing distinguishes a
# window of 8 from no window at all until position 8.
#
# Next, a tiny Gemma 3 built with transformers' own `Gemma3TextConfig` and `Gemma3ForCausalLM`
# (`windowbench.tiny_gemma3`: 6 layers, hidden 64, 4 query heads over 1 K/V head of 16, a
# vocabulary of 300, random weights with norm weights drawn from U(0.5, 1.5)), written as a
# checkpoint and loaded by `load_model` as any model directory is:

# %%
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    hf = windowbench.tiny_gemma3(WORK / "tiny")
tiny = load_model(WORK / "tiny")
cfg = tiny.cfg
print(f"{cfg.family}: {cfg.num_layers} layers, sliding layers {cfg.sliding_layers}, "
      f"window {cfg.sliding_window}")  # fmt: skip
print(f"each layer's window in the cache: {[cfg.window(i) for i in range(cfg.num_layers)]}")
print(f"rotary bases: {cfg.rope_local_theta:g} (sliding), {cfg.rope_theta:g} (global); "
      f"q.k scaled by 20 ** -0.5")  # fmt: skip
assert cfg.sliding_layers == (0, 1, 2, 3, 4) and cfg.window(5) is None and cfg.attention_scale == 20**-0.5

# %% [markdown]
# Our forward over 40 positions (five windows) against transformers', position by position: the
# first 8 are inside the first window, the other 32 are where a sliding layer and a global one
# read different keys.

# %%
def prefill(model, ids):
    """Logits at every position of ids, one prefill through a contiguous cache."""
    cache = ContiguousKVCache(model.cfg, len(ids), dtype=model.dtype)
    positions = torch.arange(len(ids))
    cache.begin(positions)
    with torch.inference_mode():
        return model(torch.tensor(ids), positions, cache)  # (N, vocab)


ids, TOL = windowbench.IDS, windowbench.TOL
with torch.no_grad():
    ref = hf(torch.tensor([ids])).logits[0]  # (40, 300)
right = prefill(tiny, ids)
inside, past = (right[:W] - ref[:W]).abs().max().item(), (right[W:] - ref[W:]).abs().max().item()
print(f"positions 0-7, max |ours - transformers| {inside:.1e}; positions 8-39, {past:.1e} "
      f"(tolerance {TOL:.0e})")  # fmt: skip
print(f"logits up to {ref.abs().max():.2f}")
assert inside < TOL and past < TOL

# %% [markdown]
# (Differences this small are printed in e-notation and masked when the notebook is checked;
# their digits differ between CPUs, and the `assert` holds the bound.)
#
# Both within the tolerance. To see that the second figure is a check of the window, the same
# weights are read with the window moved, one position short, one over, and removed: the logits
# must stay put exactly where the two masks agree and move where they do not.

# %%
def with_window(window):
    """The tiny model's weights, its sliding layers reading `window` positions (None: all)."""
    model = load_model(WORK / "tiny")
    model.cfg = dataclasses.replace(model.cfg, sliding_window=window)
    for block in model.blocks:
        block.cfg = model.cfg
    return model


moved_by = {}
for window in (7, 9, None):
    moved = (prefill(with_window(window), ids) - right).abs().amax(dim=-1)  # (40,) per position
    first = int((moved > 1e-3).nonzero()[0])
    moved_by[window] = moved.max().item()
    print(f"window {window}: positions 0-{first - 1} unchanged (max {moved[:first].max():.0e}), "
          f"from position {first} on moved by up to {moved.max():.3f}")  # fmt: skip
    assert first == min(window or N, W) and moved[:first].max() < 1e-5 and moved.max() > 100 * TOL

# %% [markdown]
# A window of 7 parts from the right one at position 7 (query 7 loses key 0), a window of 9 and
# no window at all at position 8 (query 8 keeps key 0), and before that the logits do not move.
# Past it each moves the logits by more than 1.2, on logits no larger than 1.38:
# over ten thousand times the tolerance, nothing like rounding. The comparison is only as good
# as its prompt's length; on a prompt of 7 tokens all three mistakes would pass.
#
# Last, greedy tokens. The model's own greedy loop on a contiguous cache (`greedy_tokens`) on
# the four prompts section 3 runs through the engine, 9 to 40 tokens long, 24 new tokens each;
# transformers runs once over each prompt and its answer, and its top token at every answer
# position must be the token our loop chose (then its own greedy decoding would have written
# the same answer).

# %%
PROMPTS, N_NEW = windowbench.PROMPTS, windowbench.NEW_TOKENS
OWN = [greedy_tokens(tiny, p, N_NEW) for p in PROMPTS]
for p, own in zip(PROMPTS, OWN):
    with torch.no_grad():
        top = hf(torch.tensor([p + own])).logits[0, len(p) - 1 : -1].argmax(-1).tolist()
    print(f"prompt of {len(p):>2} tokens -> {len(p) + N_NEW} positions: transformers' top tokens equal ours: "
          f"{top == own}")  # fmt: skip
    assert top == own

# %% [markdown]
# ## 2. Which blocks a sliding layer still needs
#
# The paged cache (days 14-18) stores a row's K/V in blocks of `block_size` positions: block `b`
# holds positions `b * bs` to `b * bs + bs - 1`. A step of a row computes the positions
# `[start, end)`: a prompt chunk, or one decode token (`end = start + 1`). Its oldest query is at
# `start` and reads from position `start - window + 1`; every later query reads from later on.
# So for the step, a sliding layer needs the blocks from
#
#     first = max(0, start - window + 1) // block_size
#
# up to the block that holds `end - 1`, and every block before `first` is one that no query of
# this row will read again: it can go back to the pool while the row is still running. The
# global layers keep every block; a row that wants position 0 in 4,000 steps needs it there.
#
# By hand, for Gemma 3 270M's window of 512 and blocks of 16, on one row: a 1,500-token prompt
# in chunks of 512 (the engine's default token budget), then decode steps:

# %%
def blocks_by_hand(start, end, window=512, bs=16):
    """(the first block a sliding layer needs for the step [start, end), the last)."""
    return max(0, start - window + 1) // bs, (end - 1) // bs


BLOCKS = read_csv(windowbench.HERE / "day-65-blocks.csv")
got = windowbench.block_rows()  # the same steps run through WindowBlocks.prepare, as the engine does
assert as_text(got) == BLOCKS
print(f"{'step':<19} {'reads from':>10} {'blocks held':>12} {'count':>5} {'given back':>10}")
for r in got:
    first, last = blocks_by_hand(r["start"], r["end"])
    kind = "chunk" if r["end"] - r["start"] > 1 else "decode"
    step = f"{kind} [{r['start']}, {r['end']})"
    held = f"{first}-{last}"
    print(f"{step:<19} {r['first_position_read']:>10} {held:>12} {last - first + 1:>5} {first:>10}")
    assert (first, last) == (r["first_block"], r["last_block"])
    assert r["first_needed_agrees"] and r["prepare_agrees"]
print(f"WindowBlocks.first_needed and prepare agree with the hand on all {len(got)} steps")

# %% [markdown]
# Three things to read in it. The second chunk's oldest query (position 512) still reads
# position 1, so nothing is given back until the third chunk. A prompt chunk holds more than a
# window: the chunk [1024, 1500) holds blocks 32-93, 62 of them, because its first query reads
# back to 513 and its last writes the one before 1500. And in decode, a row holds 32 or 33 blocks of 16 for a
# window of 512: 32 when the window starts on a block boundary (position 1536 at the step
# [2047, 2048)), 33 when it straddles one, which is why the pool has to count
# ceil((window - 1) / bs) + 1 blocks a row and not window / bs.
#
# `WindowBlocks` keeps these blocks. It does not change the plans: a step still addresses full
# slots through the row's block table, and the cache maps a full block `b` to the sliding
# layers' block `local_of[b]` (a hole block when no row holds one) for the sliding layers' reads
# and writes. Here is one row of the tiny model through the engine, blocks of 4, a window of 8: a
# prompt of 23 tokens in chunks of 16, then decode steps. After each step, which full blocks the
# row's table holds (`#`) and which sliding blocks (`#`; `.` for one given back):

# %%
engine = Engine(tiny, None, EngineConfig(**windowbench.ENGINE))
rid = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=14, ignore_eos=True))
seq, walk = engine.requests[rid].seq, []
while engine.has_unfinished():
    before = seq.num_computed
    engine.step()
    if not seq.finished:
        held = engine.window_blocks.held[id(seq)][1]  # (seq, {block index: full block})
        walk.append((before, seq.num_computed, len(seq.block_table.blocks), sorted(held)))
print(f"{'step':<14} {'full blocks':<14} {'sliding blocks':<14} held")
for start, end, n_full, held in walk:
    strip = "".join("#" if b in held else "." for b in range(n_full))
    print(f"[{start:>2}, {end:>2})       {'#' * n_full:<14} {strip:<14} {len(held)}")
    first, last = blocks_by_hand(start, end, window=8, bs=4)
    assert held == list(range(first, last + 1))
assert engine.window_blocks.num_used == 0 and engine.allocator.num_used == 0
print(f"tokens equal the model's own: {seq.token_ids[len(PROMPTS[1]):] == OWN[1][:14]}")
assert seq.token_ids[len(PROMPTS[1]) :] == OWN[1][:14]

# %% [markdown]
# The full blocks grow with the context: the prompt's 6 at admission, then one more every 4
# tokens. The sliding ones are 4 while a prompt chunk's queries need them, then 2 or 3, moving
# right one block every 4 steps. When the row finishes, both kinds go back to their pools.
#
# **Prefix caching changes with it.** A prompt whose leading blocks are cached skips computing
# them (day 19), and the next position it computes reads the window before it. For the global
# layers those blocks are the hit itself. For the sliding layers they are the hit's last window,
# and a row that has moved on has given those back. A sliding block given back keeps its K/V,
# as the prefix cache keeps a freed full block's: it goes to the end of the sliding free list,
# fresh blocks are handed out from the front, and its K/V is lost only when it is handed out
# again or its full block is handed out fresh (`WindowBlocks.forget`). `WindowBlocks.usable_hits`
# cuts a hit back to the blocks whose last window is still held by a row or kept on the free
# list. Three requests: A (40 tokens), B (A's first 32 tokens and 8 of its own) arriving two
# steps after A, while A is still in its prompt, and C (B's prompt again) after both have
# finished:

# %%
def cached_tokens(window_blocks: bool):
    engine = Engine(tiny, None, EngineConfig(**windowbench.ENGINE, window_blocks=window_blocks))
    params, a = SamplingParams(max_tokens=12, ignore_eos=True), PROMPTS[2]
    b = a[:32] + list(range(200, 208))
    seqs = {"A": engine.requests[engine.add_request(a, params)].seq}
    engine.step(), engine.step()
    seqs["B"] = engine.requests[engine.add_request(b, params)].seq
    engine.step()
    cached = {"B": seqs["B"].block_table.num_cached_tokens}
    while engine.has_unfinished():
        engine.step()
    seqs["C"] = engine.requests[engine.add_request(b, params)].seq
    engine.step()
    cached["C"] = seqs["C"].block_table.num_cached_tokens
    while engine.has_unfinished():
        engine.step()
    for name, s in seqs.items():
        assert s.token_ids[len(s.prompt_ids) :] == greedy_tokens(tiny, s.prompt_ids, 12), name
    return cached


HITS = {wb: cached_tokens(wb) for wb in (True, False)}
for wb, cached in HITS.items():
    way = "sliding layers on their own blocks" if wb else "one pool for all layers         "
    print(f"{way}: B starts with {cached['B']} cached tokens, C with {cached['C']}")
assert HITS[True] == HITS[False] == {"B": 32, "C": 36}

# %% [markdown]
# B's 32 shared tokens are a hit either way: when it arrives, A holds the sliding blocks of
# positions 8-31, which include the window before B's first computed position. C's hit is 36
# tokens either way too (B's prompt but its last block, whose last token is always
# recomputed): with one pool the full blocks are still cached, and with the sliding layers on
# their own, the blocks of positions 28-35 went back to the free list as A and B moved on,
# their K/V kept, and nothing handed them out again before C came. A full block's K/V alone
# could not start a sliding layer at position 36; it is the kept window that makes the hit
# usable. All three answers equal the model's own greedy tokens both ways. The hit lasts as long as the kept
# blocks do: a busy engine hands them out again and `usable_hits` cuts the hit back, which
# costs compute, never correctness.
#
# ## 3. Off by one through the paged engine: the tokens and the books
#
# `windowbench.token_rows` runs the four prompts through the engine together (blocks of 4, a
# 16-token budget, so every prompt but the first is cut into chunks) and compares each row's 24
# tokens with the model's own from section 1: the engine as built, once with the sliding layers
# on their own blocks and once with one pool, then with three mistakes planted for the run. A
# window of 9 or 7 in the cache is the classic off-by-one of `<` against `<=`; "given back early"
# replaces `first_needed` with one that returns one block later than it should (never past the
# block the step writes), so a row lets go of its window's oldest block while a query still
# reads it. Every run also calls `WindowBlocks.check_rows` after each step's `prepare`
# (`windowbench.rows_checked`): it fails a step if a row of it does not hold a sliding block
# its queries read or write, and the last column counts the steps it failed.

# %%
TOKENS = read_csv(windowbench.HERE / "day-65-tokens.csv")
FIRST_FAILURE = {}
rows = windowbench.token_rows(tiny, messages=FIRST_FAILURE)
print(f"{'variant':<31} {'window_blocks':<14} {'cache window':<13} {'rows equal':<11} {'parted at':<10} "
      f"check_rows failed")  # fmt: skip
for r in rows:
    print(f"{r['variant']:<31} {r['window_blocks']!s:<14} {r['cache_windows']:<13} "
          f"{r['rows_equal']} of {r['rows']:<6} {r['first_parted_at']!s:<10} "
          f"{r['check_rows_failed']}")  # fmt: skip
for name, message in FIRST_FAILURE.items():
    print(f"{name}, the first failure: {message}")
pool = WindowBlocks.blocks_for(4, 16, 4, 8)  # the engine's sizing for these runs (windowbench.ENGINE)
print(f"the sliding pool of these runs: WindowBlocks.blocks_for(4 rows, a 16-token budget, blocks of 4, "
      f"window 8) = {pool} blocks")  # fmt: skip
assert as_text(rows) == TOKENS
right_rows, windows_off, freed_early = rows[:2], rows[2:4], rows[4]
assert all(r["rows_equal"] == r["rows"] for r in right_rows)
assert right_rows[0]["check_rows_failed"].startswith("0 of")
assert all(r["rows_equal"] < r["rows"] for r in windows_off)
assert not freed_early["check_rows_failed"].startswith("0 of")
assert list(FIRST_FAILURE) == [freed_early["variant"]]

# %% [markdown]
# The engine's rows equal the model's own tokens both ways, and `check_rows` passes all 27
# steps of the run with the sliding layers on their own blocks. A window of 9 or 7 changes all
# four rows, the first of them at the first new token: every prompt is longer than the window,
# so the first token already reads a window's edge.
#
# The last row is the mistake a memory saving invites, and the tokens do not catch it: all
# four rows equal the model's own. The block a row lets go of too soon is not lost yet. It
# waits at the end of the free list with its K/V, `local_of` still maps its full block to it,
# and with 24 sliding blocks for these four short rows, nothing handed it out again before the
# last query that reads it. The bug is real all the same: a busier pool would hand the block to
# another row, which would overwrite it while this row still reads it (Try it 3 below makes the
# pool do that, and the tokens part). What catches it is the books: `check_rows` fails 26 of
# the 27 steps, first at the 9-token prompt's first decode step, whose query at position 9
# reads positions 2-9 from a row that no longer holds the block of positions 0-3. An engine
# that frees one block too soon raises no error of its own, and on a quiet pool its tokens are
# even right; `tests/test_gemma.py` plants the same kinds of mistake in a model built the same
# way, and runs `check_rows` after every step of its engine tests.
#
# ## 4. What it saves: Gemma 3 270M's cache geometry
#
# How many K/V bytes a token costs depends on the cache geometry alone: K and V, times layers,
# times K/V heads, times head dim, times the bytes of the dtype. Gemma 3 270M's `config.json`
# (the converted directory `fetch_named_model` keeps) gives 18 layers, 1 K/V head of 256 and a
# window of 512; its hidden size of 640 and its 262,144-entry vocabulary do not enter. So
# `windowbench.toy_270m` keeps that config but for hidden 64, MLP 128, vocabulary 256, one query
# head (queries are not cached) and rotary tables for 4,096 + 64 positions, draws random weights, and
# runs prompts of up to 4,095 tokens in seconds.

# %%
real = windowbench.gemma_270m_config()
toy = windowbench.toy_270m()
geometry = lambda c: (c.num_layers, c.num_kv_heads, c.head_dim, c.sliding_window, c.sliding_layers)
per_layer = 2 * real.num_kv_heads * real.head_dim * 4  # K and V, fp32
n_full = real.num_layers - len(real.sliding_layers)
global_layers = [i for i in range(real.num_layers) if real.window(i) is None]
print(f"Gemma 3 270M: {real.num_layers} layers ({len(real.sliding_layers)} sliding over "
      f"{real.sliding_window}, global: {global_layers}), {real.num_kv_heads} K/V head of {real.head_dim}; "
      f"hidden {real.hidden_size}, vocabulary {real.vocab_size:,}")  # fmt: skip
print(f"toy:          the same cache geometry; hidden {toy.cfg.hidden_size}, "
      f"vocabulary {toy.cfg.vocab_size}, {toy.cfg.num_heads} query head")  # fmt: skip
print(f"K/V a token: 2 x {real.num_layers} x {real.num_kv_heads} x {real.head_dim} x 4 bytes = "
      f"{real.kv_bytes_per_token(torch.float32):,} (global layers {n_full * per_layer:,}, "
      f"sliding layers {len(real.sliding_layers) * per_layer:,})")  # fmt: skip
assert geometry(toy.cfg) == geometry(real) == (18, 1, 256, 512, tuple(i for i in range(18) if i % 6 != 5))
assert toy.cfg.kv_bytes_per_token(torch.float32) == real.kv_bytes_per_token(torch.float32) == 18 * per_layer

# %% [markdown]
# 36,864 bytes a token in fp32 (the engine's K/V dtype is the model's; a bf16 cache would be
# half), of which the three global layers' share is 6,144. With `window_blocks=True`, the
# default, a block of the full pool holds the global layers' K/V only and a sliding block the
# sliding layers'; with `window_blocks=False` one block holds all 18 layers' and nothing is
# given back before the row ends. `windowbench.memory_rows` runs one request at each context in
# each engine (the same KV budget both ways; `max_batch=1`, since one request runs at a time;
# prefix caching off, so each context is computed from scratch) and reads
# `Engine.kv_bytes_held()` after the decode step that writes the context's last position.

# %%
t0 = time.perf_counter()
mem, engines, sliding_held = windowbench.memory_rows(toy)
print(f"{len(mem)} contexts, both ways, in {time.perf_counter() - t0:.0f} s")
MEMORY = read_csv(windowbench.HERE / "day-65-memory.csv")
assert as_text(mem) == MEMORY
print(f"{'context':>7} {'without: blocks':>15} {'MB':>7} {'with: full':>10} {'sliding':>7} {'MB':>6} "
      f"{'ratio':>5}")  # fmt: skip
for r in mem:
    print(f"{r['context']:>7,} {r['blocks_without']:>15} {r['bytes_without'] / 1e6:>7.1f} "
          f"{r['full_blocks_with']:>10} {r['sliding_blocks_with']:>7} {r['bytes_with'] / 1e6:>6.1f} "
          f"{r['ratio']:>5}")  # fmt: skip
block = windowbench.BLOCK
for r in mem:
    c = r["context"]
    assert r["blocks_without"] == r["full_blocks_with"] == -(-c // block)
    assert r["bytes_without"] == r["blocks_without"] * block * 18 * per_layer
    assert r["bytes_with"] == block * per_layer * (3 * r["full_blocks_with"] + 15 * r["sliding_blocks_with"])
    first, last = blocks_by_hand(c - 1, c)
    assert sliding_held[c] == list(range(first, last + 1))
assert [r["ratio"] for r in mem[:2]] == ["1.00", "1.00"] and float(mem[-1]["ratio"]) > 3.5

# %% [markdown]
# Up to the window the two ways hold the same bytes: a row of 512 positions needs all of its
# 32 blocks in every layer. Past it, the sliding layers stop growing at 32 or 33 blocks, and
# only the three global layers' share keeps rising: at 4,096 positions one row holds 151.0 MB
# without giving blocks back and 40.9 MB with, 3.69 times less. The ratio climbs toward 6, the
# 18 layers over the 3 that must keep everything, and never reaches it, since the window's
# blocks stay. Every figure is the block count times the layers' bytes, asserted cell by cell
# above, and the sliding blocks held at each context are the ones the hand rule of section 2
# names.
#
# The other side of the same budget is how much context it holds. Both engines were given
# bytes for 4,192 tokens of one pool:

# %%
plain, split = engines[False], engines[True]
print(f"one pool: {plain.pool.num_blocks} blocks of {block} = {plain.pool.max_tokens:,} tokens, "
      f"every layer")  # fmt: skip
print(f"split:    sliding layers {split.window_pool.num_blocks} blocks (WindowBlocks.blocks_for: "
      f"max_batch {split.config.max_batch}, a token budget of {split.config.max_num_batched_tokens}), "
      f"global layers {split.pool.num_blocks:,} blocks = {split.pool.max_tokens:,} tokens")  # fmt: skip
print(f"global context at the same bytes: {split.pool.max_tokens / plain.pool.max_tokens:.1f} times")
assert split.config.max_batch == 1
assert split.window_pool.num_blocks == WindowBlocks.blocks_for(1, 512, block, 512)
assert split.pool.max_tokens > 4 * plain.pool.max_tokens

# %% [markdown]
# The sliding layers' pool is sized once, for the most blocks the rows that can run at once
# might hold (`max_batch` rows each holding a window, plus a step's token budget of chunks), so
# it can never run out in the middle of a step; everything else goes to the global layers.
# `prepare` gives back what every running row no longer reads before it hands out fresh blocks,
# so a single row prefilling a long prompt in chunks never holds the last chunk's window and the
# next chunk's blocks at once, and one row's 67 blocks are enough. At the same bytes, the engine
# that gives blocks back holds 19,744 tokens of global context against 4,192, 4.7 times as
# many.
#
# ## 5. The diagram

# %%
fig = plt.figure(figsize=(16, 10.5))
grid = fig.add_gridspec(2, 2, hspace=0.35, wspace=0.2)

ax = fig.add_subplot(grid[0, 0])
n = 24
shade = band(n, n).int() + band(n, W).int()  # 0 unseen, 1 causal only, 2 in the window
ax.imshow(shade, cmap=matplotlib.colors.ListedColormap(["white", "#d9d9d9", "#e69138"]), vmin=0, vmax=2)
for x in range(4, n, 4):
    ax.axvline(x - 0.5, color="black", lw=0.5, ls=":")
ax.set_xlabel("key position j (dotted: blocks of 4)")
ax.set_ylabel("query position p")
ax.set_title(f"a sliding layer reads p - {W} < j <= p (orange);\na global layer every j <= p (grey too)",
             fontsize=11)  # fmt: skip

ax = fig.add_subplot(grid[0, 1])
steps = range(len(walk))
for s, (_, _, n_full, held) in enumerate(walk):
    ax.add_patch(plt.Rectangle((s - 0.4, -0.5), 0.35, n_full, color="#999999"))
    for b in held:
        ax.add_patch(plt.Rectangle((s + 0.05, b - 0.5), 0.35, 1, color="#e69138"))
ax.set_xlim(-0.7, len(walk) - 0.3)
ax.set_ylim(-0.7, max(w[2] for w in walk) + 0.3)
ax.set_xticks(list(steps), [f"{end}" for _, end, _, _ in walk], fontsize=8)
ax.set_xlabel("positions computed after the step")
ax.set_ylabel("block index (4 positions each)")
ax.set_title("one row of the tiny model through the engine:\nfull blocks (grey), sliding blocks (orange)",
             fontsize=11)  # fmt: skip

ax = fig.add_subplot(grid[1, 0])
c = mem[-1]["context"]
strip = torch.zeros(toy.cfg.num_layers, -(-c // block))
for layer in range(toy.cfg.num_layers):
    if toy.cfg.window(layer) is None:
        strip[layer] = 1
    else:
        strip[layer, sliding_held[c]] = 2
ax.imshow(strip, aspect="auto", interpolation="nearest",
          cmap=matplotlib.colors.ListedColormap(["white", "#999999", "#e69138"]), vmin=0, vmax=2)  # fmt: skip
ax.set_yticks(range(toy.cfg.num_layers), [f"{i}{' global' if toy.cfg.window(i) is None else ''}"
                                          for i in range(toy.cfg.num_layers)], fontsize=8)  # fmt: skip
ax.set_xlabel(f"block index (16 positions each), one row at {c:,} positions")
ax.set_title(f"Gemma 3 270M's geometry: blocks each layer holds at {c:,} positions\n"
             f"(global: all {strip.shape[1]}; sliding: {len(sliding_held[c])}, "
             f"{sliding_held[c][0]}-{sliding_held[c][-1]})", fontsize=11)  # fmt: skip

ax = fig.add_subplot(grid[1, 1])
xs = [r["context"] for r in mem]
ax.plot(xs, [r["bytes_without"] / 1e6 for r in mem], "o-", color="#999999", label="window_blocks=False")
ax.plot(xs, [r["bytes_with"] / 1e6 for r in mem], "o-", color="#e69138", label="window_blocks=True")
for r in mem[2:]:
    ax.annotate(f"{r['ratio']}x", (r["context"], r["bytes_with"] / 1e6), textcoords="offset points",
                xytext=(0, -16), ha="center", fontsize=9)  # fmt: skip
ax.axvline(512, color="black", ls=":", lw=0.8)
ax.text(560, 100, "the window,\n512 positions", fontsize=9)
ax.set_xlabel("positions held by the row (context)")
ax.set_ylabel("K/V bytes held, MB (Engine.kv_bytes_held)")
ax.legend(fontsize=9, loc="upper left")
ax.set_title("one row, fp32: bytes held with and without freeing\nout-of-window blocks (day-65-memory.csv)",
             fontsize=11)  # fmt: skip

fig.suptitle("Day 65: sliding windows in a paged cache (Gemma 3)", fontsize=15)
png = diagram_path("day65-sliding-windows.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))
print(f"notebook ran in {time.perf_counter() - T0:.0f} s")

# %% [markdown]
# ## In the real systems
#
# * **vLLM** calls this the hybrid KV cache manager (`docs/design/hybrid_kv_cache_manager.md`).
#   Layers are split into KV cache groups of equal size, each with one attention type, and a
#   request gets one block table per group; all groups draw from one `BlockPool` whose blocks
#   have one page size (for Gemma 3 270M, by the design document's rule, a group of the 3
#   global layers and five groups of 3 sliding layers). `HybridKVCacheCoordinator`
#   (`vllm/v1/core/kv_cache_coordinator.py`) drives one manager per group,
#   `FullAttentionManager` and `SlidingWindowManager`
#   (`vllm/v1/core/single_type_kv_cache_manager.py`). The sliding manager's
#   `get_num_skipped_tokens` is `max(0, num_computed_tokens - sliding_window + 1)`, the same
#   arithmetic as our `first_needed`, and `remove_skipped_blocks` swaps the blocks before it for
#   a shared null block and frees them. Its prefix caching keeps freed blocks as ours does: a
#   freed block keeps its hash in the pool's LRU queue until it is reused, and a sliding group's
#   hit is found by scanning right to left for `cdiv(sliding_window - 1, block_size)`
#   contiguous cached blocks, within the global group's hit; so a finished request's window can
#   still be a hit, as C's is in section 2 (our `usable_hits` asks for the blocks of the window
#   before the hit's end, held or kept).
#   `--disable-hybrid-kv-cache-manager` gives every layer every block, our
#   `window_blocks=False`.
# * **llama.cpp** keeps two caches for a model with interleaved windows, `llama_kv_cache_iswa`
#   in `src/llama-kv-cache-iswa.cpp` (added as `llama_kv_cache_unified_iswa`): one for the
#   global layers with the whole context, one for the sliding layers with room for a window per
#   sequence that shares it and a micro-batch (`n_swa * n_seq_max + n_ubatch` cells in a unified
#   cache), rounded up to 256. Its cells are reused as the window moves past them. Cells, not
#   blocks: there is no block table to keep, and a pruned cache cannot go back to an earlier
#   position. `--swa-full` makes the sliding cache as large as the other, for prompts that
#   branch from an earlier point, at the memory cost this notebook measures; without it,
#   `llama-server` saves checkpoints of the sliding cache's state to resume a shared prefix from
#   (`--ctx-checkpoints`).
# * **transformers** builds the band with `sliding_window_causal_mask_function` in
#   `masking_utils.py` (section 1's reference). Its `DynamicCache`, given a Gemma 3 config,
#   keeps each sliding layer in a `DynamicSlidingWindowLayer` that holds the latest window of
#   K/V only: a batch's tensors trimmed to the window as they grow, with no blocks to share.
#
# nanoserve sits between the two. Like vLLM it keeps blocks and frees whole ones, and like
# llama.cpp it sizes the sliding layers' memory once for the rows that can run; unlike either,
# its sliding blocks are found through the full blocks (`local_of`), so the plans, the slot
# table and the captured decode graphs of days 51-55 address full slots unchanged. The price is
# in the books: a sliding block is shared, kept and forgotten with its full block (`forget`,
# when the full block is handed out fresh), and a bookkeeping slip can hide behind kept K/V,
# which is why `check_rows` exists.
#
# ## Try it
#
# 1. **Where does the ratio stop?** Run `python days/day65/windowbench.py --contexts 8192 16384
#    --out /tmp/d65` (the pool and the rotary tables grow to fit; about two minutes on two
#    cores) and read `ratio` in `/tmp/d65/day-65-memory.csv`. Predict it first from section 4:
#    `18 * F / (3 * F + 15 * S)` with `F = ceil(c / 16)` full blocks and `S` sliding blocks (32
#    at these contexts). The check: `18 * 512 / (3 * 512 + 15 * 32)` at 8,192 and
#    `18 * 1024 / (3 * 1024 + 15 * 32)` at 16,384, to two places, still under 6, and
#    `bytes_with` equal to `16 * 2048 * (3 * F + 15 * S)`.
# 2. **Plant the `<=`.** In `nanoserve/cache.py`'s `_windowed_chunk`, change
#    `(keys > pos - window)` to `(keys >= pos - window)`: a window of 9 for the queries of a
#    prompt chunk, while decode rows still read 8. Predict which variants of section 3 change,
#    then rerun it. The check: `python -m pytest tests/test_gemma.py -q -k paged_engine` fails on
#    all three paths, and section 3's first two variants match 0 of 4 rows (their `assert`
#    fails); put the `>` back and both pass again.
# 3. **Hand out the newest first.** In `nanoserve/blocks.py`'s `WindowBlocks._acquire`, change
#    `self._free.popitem(last=False)` to `popitem(last=True)`: a fresh sliding block is now the
#    one given back most recently, not the one kept longest. Predict C's cached tokens in
#    section 2 and the "oldest block given back early" row of section 3, then rerun them. The
#    check: `cached_tokens(True)` gives C 0 cached tokens (the window it needed was handed out
#    again as B decoded on), its answer still the model's own; `windowbench.token_rows(tiny)`
#    puts the early freeing at 0 of 4 rows equal, parting at the first new token, with
#    `check_rows` failing 26 of 27 steps as before. Put `last=False` back.

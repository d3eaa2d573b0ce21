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
# # Day 13 — What contiguous caches waste
#
# Day 11's `ContiguousKVCache` takes a length when it is built and allocates K and V for every
# one of those positions at once. For one sequence on a laptop that is harmless. A server holds
# many sequences in one memory, and it has to pick that length before the request has produced
# a single token, so it does not know how long the answer will be. Whatever it reserves and the
# request never writes is memory no other request can use.
#
# There are two ways to lose memory like this. Internal fragmentation is the part of a
# reservation that is never written. External fragmentation is free memory that is cut into
# holes too small for the next reservation, so a request waits although the free slots add up
# to more than it needs. Today counts both on a seeded, made-up workload, and sets them against
# a pool of 16-token blocks, where a sequence takes a block only when it reaches it.
#
# 1. one request in Day 11's cache on SmolLM2: what it reserves and what it writes,
# 2. the workload: seeded lognormal prompt and output lengths, and why that law,
# 3. internal fragmentation, by hand and with `days/day13/waste.py`, with the paged pool's count
#    checked against `BlockAllocator`,
# 4. external fragmentation: a first-fit `Arena`, and a simulated stream of arrivals and
#    finishes in one memory,
# 5. an arena built wrong, and the check that catches it,
# 6. the tables and the diagram.
#
# Nothing is timed today: every number is a count of slots (one token's K/V, all layers) and
# comes out the same on every run.

# %%
import csv
import sys

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, tiny_llama
from nanoserve.blocks import BlockAllocator, BlockTable
from nanoserve.contiguous import ContiguousKVCache
from nanoserve.models import LlamaConfig
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day13"))
import waste  # the day's script: the notebook calls its functions and reads back its CSVs

cfg = LlamaConfig.from_dir(fetch_default_model())  # SmolLM2-135M-Instruct's shape, for its bytes
per_slot = cfg.kv_bytes_per_token(torch.float32)
print(f"SmolLM2-135M-Instruct, fp32: {per_slot:,} bytes of K and V a slot (a token, all 30 layers)")
tiny = tiny_llama()  # the course's random-weight Llama, for the one run below


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def show(rows, columns=None):
    columns = columns or list(rows[0])
    print(" | ".join(columns))
    for r in rows:
        print(" | ".join(str(r[c]) for c in columns))


def as_text(rows):
    return [{k: str(v) for k, v in r.items()} for r in rows]


# %% [markdown]
# ## 1. One request in Day 11's cache
#
# A server that cannot know the answer's length reserves the whole context it allows, here
# 2,048 positions. Build that cache, run a 37-token prompt (the length of Day 11's chat prompt)
# and 16 greedy tokens through it exactly as Day 11 does (prefill, then one token a step), and
# count the positions whose keys are no longer zeros: those are the ones the request wrote.
# The run uses the course's tiny random-weight Llama, since only the positions matter here;
# the bytes are SmolLM2's, a cache of the same length built with its config.

# %%
torch.manual_seed(0)
prompt = torch.randint(0, tiny.cfg.vocab_size, (37,)).tolist()
cache = ContiguousKVCache(tiny.cfg, waste.MAX_LEN)
ids, positions, last = torch.tensor(prompt), torch.arange(len(prompt)), torch.tensor([len(prompt) - 1])
with torch.inference_mode():
    for _ in range(16):
        cache.begin(positions)
        token = int(tiny(ids, positions, cache, logits_at=last).argmax())
        ids, positions = torch.tensor([token]), torch.tensor([cache.length])
        last = torch.zeros(1, dtype=torch.long)
touched = (cache.k[0] != 0).any(dim=(0, 2))  # (max_len,): a position some head wrote
written = int(touched.sum())
print(f"prompt {len(prompt)} tokens, 16 generated: positions written {written} of {cache.max_len}")
assert written == len(prompt) + 16 - 1 == cache.length and not touched[written:].any()
smol = ContiguousKVCache(cfg, waste.MAX_LEN)
reserved = sum(t.numel() * t.element_size() for t in smol.k + smol.v)
print(f"SmolLM2's cache: {len(smol.k)} K and {len(smol.v)} V tensors of", tuple(smol.k[0].shape))
print(f"reserved {reserved:,} bytes, written {written * per_slot:,} ({written / smol.max_len:.1%})")
assert reserved == waste.MAX_LEN * per_slot
del smol

# %% [markdown]
# The request wrote 52 positions: the 37 of the prompt and 15 of the 16 tokens it generated.
# The 16th is never fed back, so its K/V is never computed. In SmolLM2's shape the cache holds
# 94.4 MB for 2.4 MB of keys and values. That is one request with a short answer. What a server
# loses depends on how long requests really are, so the next step is a workload.
#
# ## 2. The workload
#
# `waste.draw_requests` draws each request's prompt and output length from two independent
# lognormals. Lengths are positive and right-skewed: most requests are short and a few are many
# times longer. A lognormal is the usual first model for that shape, and it is easy to state:
# the log of the length is normal. The parameters are assumptions, since no trace is used
# here. Prompts have a median of 256 tokens, outputs 128, and both have sigma 1.0 in log space,
# so the middle half of the draws spans about a factor of four (in the table below, prompts
# run from 132 to 504 tokens between the quartiles and outputs from 66 to 250). Prompts
# are cut at 1,536 tokens and outputs at the request's `max_tokens` of 512, so every request
# fits the 2,048-token context. Arrivals are a Poisson stream (exponential gaps, 0.25 requests
# a step) for section 4. Everything comes from one `random.Random(13)`.

# %%
requests = waste.draw_requests(waste.REQUESTS)
print(f"{len(requests):,} requests; the first five:")
for r in requests[:5]:
    print(f"   {r}: writes {r.written} slots")
lengths = waste.lengths_table(requests)
assert as_text(lengths) == read_csv(waste.CSV_LENGTHS), "rerun days/day13/waste.py"
show(lengths, ["quantile", "prompt", "output", "written"])
cut = sum(r.prompt == waste.MAX_PROMPT for r in requests), sum(r.output == waste.MAX_TOKENS for r in requests)
print(f"cut at the limits: {cut[0]} prompts at {waste.MAX_PROMPT}, {cut[1]} outputs at {waste.MAX_TOKENS}")

# %% [markdown]
# The draws' median prompt is 260 tokens and median output 129, close to the medians asked
# for. About a tenth of the requests write more than 1,136 slots and a tenth fewer than 177.
# The cuts matter more than they look: 379 prompts (3.8%) sit at 1,536 and 818 outputs (8.2%)
# at 512, requests that ran into their budget. Those are the requests a worst-case
# reservation is sized for, and the only ones that fill it.
#
# ## 3. Internal fragmentation: reserved, never written
#
# Three ways to hold a request, each priced in slots at the request's end:
#
# * `max_len`: the whole context, 2,048 slots, as in section 1;
# * `prompt+max_tokens`: the prompt plus the token budget, which is how Day 11's `decode_loop`
#   sizes its cache. It needs the prompt's length, which is known on arrival, and is still a
#   worst case for the output;
# * `paged16`: 16-slot blocks taken one at a time as the sequence grows, so only the last
#   block can be partly empty.
#
# By hand, for the first five requests:

# %%
for r in requests[:5]:
    by_hand = {
        "max_len": waste.MAX_LEN - r.written,
        "prompt+max_tokens": r.prompt + waste.MAX_TOKENS - r.written,
        "paged16": -r.written % 16,  # the empty tail of the last block
    }
    print(f"request {r.rid} writes {r.written:>4}: never written", by_hand)
    assert by_hand == {p: waste.held(p, r) - r.written for p in waste.POLICIES}

# %% [markdown]
# The paged count is a formula, `ceil(written / 16) x 16`. The allocator the engine runs,
# `nanoserve.blocks.BlockAllocator`, must agree with it. Give five tables their prompts with
# `allocate_prompt` and grow them one token at a time with `append_slots`, as decode steps
# would, then compare what the allocator has handed out with the formula:

# %%
alloc = BlockAllocator(num_blocks=1024, block_size=16, enable_prefix_caching=False)
tables = []
for r in requests[:5]:
    t = BlockTable(16)
    alloc.allocate_prompt(t, [0] * r.prompt)
    for n in range(r.prompt + 1, r.written + 1):
        alloc.append_slots(t, n)
    tables.append(t)
alloc.check_invariants(tables)
print("blocks per table:", [len(t.blocks) for t in tables])
print(f"allocator: {alloc.num_used} blocks used = {alloc.num_used * 16} slots")
print(f"formula:   {sum(waste.paged_slots(r.written) for r in requests[:5])} slots")
assert alloc.num_used * 16 == sum(waste.paged_slots(r.written) for r in requests[:5])
assert [len(t.blocks) * 16 for t in tables] == [waste.paged_slots(r.written) for r in requests[:5]]

# %% [markdown]
# Over all 10,000 requests (`waste.waste_table`, equal to the committed `day-13-waste.csv`):

# %%
table = waste.waste_table(requests)
assert as_text(table) == read_csv(waste.CSV_WASTE), "rerun days/day13/waste.py"
show(table)
mb = {r["policy"]: r["slots_held"] * per_slot / len(requests) / 1e6 for r in table}
print("MB held per request, SmolLM2 fp32:", {k: round(v, 1) for k, v in mb.items()})
show(lengths, ["quantile"] + [f"wasted_{p}" for p in waste.POLICIES])

# %% [markdown]
# Reserving the whole context leaves 72.2% of the memory never written: a median request
# writes 461 slots and leaves 1,587 empty. Reserving the prompt plus the budget brings the
# waste to 36.9%, because the prompt is known. What remains is the budget the answer does not
# use, 333.2 slots a request on average. The paged pool wastes 1.3%, 7.4 slots a request on
# average and never more than 15, which the allocator's own count confirms. At SmolLM2's
# 46,080 bytes a slot, a request holds 94.4 MB, 41.6 MB or 26.6 MB.
#
# These are counts at each request's end, when it has written all it ever will. While a
# request is running it has written less, so at any moment the share of a reservation in use is
# lower. The simulation below measures it.
#
# ## 4. External fragmentation: one memory, many requests
#
# A contiguous reservation needs one unbroken range of slots. `waste.Arena` places them first
# fit: the lowest address with room. When a reservation is freed, its range is merged with any
# free neighbour, so holes never touch. Four reservations in a 16-slot memory, two freed:

# %%
arena = waste.Arena(16)
starts = {name: arena.alloc(n) for name, n in [("a", 5), ("b", 3), ("c", 4), ("d", 2)]}
print("placed:", starts, " holes (start, length):", arena.holes)
arena.free(starts["a"], 5)
arena.free(starts["c"], 4)
print("a and c freed: holes", arena.holes, f"free {arena.free_slots}", end=", ")
print("largest hole", max(n for _, n in arena.holes))
print("a reservation of 6 fits:", arena.alloc(6) is not None)
waste.check_arena(arena, {"b": (starts["b"], 3), "d": (starts["d"], 2)})
assert arena.holes == [(0, 5), (8, 4), (14, 2)] and arena.free_slots == 11

# %% [markdown]
# Eleven slots are free, and a request for six is refused: no single hole is longer than five.
# That is external fragmentation.
#
# `waste.simulate` runs a stream of requests through one memory of 32,768 slots (16 whole-
# context reservations of 94.4 MB each in SmolLM2 fp32). At each step, new arrivals join a queue.
# Requests are admitted first come, first served while the next one's reservation fits
# somewhere; the first that does not fit waits, and so does everyone behind it. Every running
# request then computes one token, its whole prompt on its first step. A request that has
# produced all its tokens leaves, and its range is freed. The running requests are mirrored,
# block by block, in a `BlockAllocator` (prefix caching off), which gives the slots a paged
# pool would hold for the very same requests. Arrivals come faster than either contiguous way
# can serve them, so a queue builds up and memory is the limit. The means are taken over the
# steps in which someone is waiting.
#
# First a short run of 300 requests with `check_arena` at every step:

# %%
short = waste.simulate(waste.draw_requests(300), "prompt+max_tokens", check_every=1)
row = waste.sim_row("prompt+max_tokens", short)
print(f"{row['steps']:,} steps, check_arena passed at each; mean running {row['mean_running']}")
print(
    f"while someone waited: reserved {row['reserved_pct']}%, written {row['written_pct']}%, "
    f"paged would hold {row['paged_pct']}%, free {row['free_pct']}% (largest hole {row['mean_largest_hole']})"
)

# %% [markdown]
# Then the script's run, 2,000 requests under both contiguous ways, equal to the committed
# `day-13-sim.csv`:

# %%
sim_requests = waste.draw_requests(waste.SIM_REQUESTS)
runs = {p: waste.simulate(sim_requests, p, trace=p != "max_len") for p in ("max_len", "prompt+max_tokens")}
sim = [waste.sim_row(p, runs[p]) for p in runs]
assert as_text(sim) == read_csv(waste.CSV_SIM), "rerun days/day13/waste.py"
show(sim)

# %% [markdown]
# **Whole-context reservations** fill the memory with 16 requests. While someone waits, the
# memory is 100.0% reserved and 26.3% written, a little under the 27.8% of section 3's count
# at the requests' ends. The same 16 requests in a paged pool would hold 26.7%. Since every
# reservation has the same size, a freed range always fits the next request: there is no
# external fragmentation at all (0 steps blocked by holes).
#
# **Prompt-plus-budget reservations** run about twice as many requests at once (30.2 on
# average, at most 39). They finish the 2,000 requests in 12,110 steps instead of 22,523. The
# memory is then 83.0% reserved and 49.7% written. The other 17.0% is free, in holes of 1,013
# slots on average at their largest, and in 11,547 of the 11,554 steps with someone waiting,
# the request at the head of the queue needed less than the free total but found no hole to
# fit. While someone waits, every free slot is in a hole too small for a new whole-context
# reservation (`stranded_pct` equals `free_pct`). That has to be so: a hole of 2,048 would have
# admitted whoever was first in line. The same running requests in a paged pool would hold
# 50.4% of the memory. Any of the other half's blocks would fit anyone.
#
# A rough count of what that buys: divide the paged slots by the running requests, and see
# how many such requests the whole memory would hold. This ignores the queue and the growth of
# each request, so it is an estimate only; Day 21 runs the paged engine against a contiguous
# one in the same memory.

# %%
for r in sim:
    per_request = r["paged_pct"] / 100 * r["memory_slots"] / r["mean_running"]
    print(
        f"{r['policy']}: {r['mean_running']} running, {per_request:.0f} paged slots each -> "
        f"about {r['memory_slots'] / per_request:.0f} requests in {r['memory_slots']:,} slots"
    )

# %% [markdown]
# Both estimates land near 60 requests in the memory that held 16 or 30 contiguous ones.
#
# ## 5. An arena built wrong
#
# A plausible slip in the arena: `free` puts the range back as a hole of its own and never
# merges it with the holes beside it. Nothing crashes. Reservations are still placed in
# free memory. But the free space splinters into pieces that are really one range, so requests
# wait for holes that are only there on paper. `check_arena` requires the holes and the live
# reservations to tile the memory in order, and two holes never to touch:


# %%
class NoMergeArena(waste.Arena):
    def free(self, start, n):
        self.holes.append((start, n))
        self.holes.sort()


for cls in (waste.Arena, NoMergeArena):
    try:
        waste.simulate(waste.draw_requests(300), "prompt+max_tokens", arena_cls=cls, check_every=1)
        print(f"{cls.__name__}: check_arena passed at every step")
    except AssertionError as e:
        print(f"{cls.__name__} caught by check_arena: {e}")
try:
    waste.simulate(waste.draw_requests(300), "prompt+max_tokens", arena_cls=NoMergeArena)
except RuntimeError as e:
    print(f"NoMergeArena, unchecked: {e}")
else:
    raise AssertionError("the unmerged arena should have wedged")

# %% [markdown]
# The check fails on the broken arena at step 90, the first time a freed range lands next to
# a hole. Without the check the broken arena runs on, more and more slowly, until it stops
# dead: at step 1,094 the whole memory is free, nothing is running, and request 68 cannot be
# placed, because the free memory is all there in pieces of at most 1,487 slots. A
# fragmentation study built on that arena would first overstate the waste it set out to
# measure, and then hang.
#
# ## 6. The diagram

# %%
samples = runs["prompt+max_tokens"]["samples"]
fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))

ax = axes[0, 0]
bins = np.logspace(0, np.log10(waste.MAX_LEN), 40)
ax.hist([r.prompt for r in requests], bins=bins, alpha=0.6, label="prompt", color="tab:blue")
ax.hist([r.output for r in requests], bins=bins, alpha=0.6, label="output", color="tab:orange")
for x, c in ((waste.MAX_PROMPT, "tab:blue"), (waste.MAX_TOKENS, "tab:orange")):
    ax.axvline(x, color=c, ls="--", lw=1)
ax.set_xscale("log")
ax.set_xlabel("tokens (log)")
ax.set_ylabel("requests")
ax.set_title("10,000 seeded lognormal draws (medians 256, 128; dashed: the cuts)")
ax.legend()

ax = axes[0, 1]
names = [r["policy"] for r in table]
written_mb = [r["slots_written"] * per_slot / len(requests) / 1e6 for r in table]
wasted_mb = [r["never_written"] * per_slot / len(requests) / 1e6 for r in table]
ax.bar(names, written_mb, color="tab:green", label="written")
ax.bar(names, wasted_mb, bottom=written_mb, color="tab:red", alpha=0.5, label="reserved, never written")
for i, r in enumerate(table):
    ax.text(i, written_mb[i] + wasted_mb[i] + 1, f"{r['wasted_pct']}% never written", ha="center")
ax.set_ylabel("MB per request at its end (SmolLM2, fp32)")
ax.set_title("Internal fragmentation (day-13-waste.csv)")
ax.legend()

ax = axes[0, 2]
keys = [
    ("written_pct", "written", "tab:green"),
    ("paged_pct", "a paged pool would hold", "tab:purple"),
    ("reserved_pct", "reserved", "tab:red"),
    ("stranded_pct", "free, in holes < 2,048", "tab:gray"),
]
x = np.arange(len(sim))
for j, (k, label, color) in enumerate(keys):
    ax.bar(x + (j - 1.5) * 0.2, [r[k] for r in sim], 0.2, label=label, color=color)
ax.set_xticks(x, [f"{r['policy']}\n{r['mean_running']} running" for r in sim])
ax.set_ylabel("% of the 32,768-slot memory, mean while someone waits")
ax.set_ylim(0, 125)
ax.set_title("The simulation (day-13-sim.csv)")
ax.legend(fontsize=8, ncol=2, loc="upper center")

for ax, policy in ((axes[1, 0], "max_len"), (axes[1, 1], "prompt+max_tokens")):
    s = runs[policy]["samples"][::10]  # every 10th step is plenty for the eye
    steps = [x["step"] for x in s]
    mem = runs[policy]["memory"]
    w = np.array([x["written"] for x in s]) / mem * 100
    res = np.array([x["reserved"] for x in s]) / mem * 100
    strand = np.array([x["stranded"] for x in s]) / mem * 100
    ax.stackplot(steps, w, res - w, strand, colors=["tab:green", "tab:red", "tab:gray"], alpha=0.7,
                 labels=["written", "reserved, not written", "free, in holes < 2,048"])  # fmt: skip
    ax.plot(steps, np.array([x["paged"] for x in s]) / mem * 100, color="tab:purple", lw=0.8,
            label="a paged pool, same requests")  # fmt: skip
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_xlabel("step")
    ax.set_ylabel("% of memory")
    ax.set_title(f"{policy}: 2,000 requests over time")
    ax.legend(fontsize=8, ncol=2, loc="upper center")

ax = axes[1, 2]
first, count, cell = 3000, 400, 64  # steps shown, and slots per pixel
image = np.zeros((count, runs["prompt+max_tokens"]["memory"] // cell))
for i, layout in enumerate(runs["prompt+max_tokens"]["layouts"][first : first + count]):
    row_ = np.zeros(runs["prompt+max_tokens"]["memory"])
    for start, size, filled in layout:
        row_[start : start + size] = 1
        row_[start : start + filled] = 2
    image[i] = row_.reshape(-1, cell).mean(1)
cmap = matplotlib.colors.ListedColormap(["lightgray", "tab:red", "tab:green"])
ax.imshow(image, aspect="auto", cmap=cmap, interpolation="nearest", vmin=0, vmax=2,
          extent=(0, runs["prompt+max_tokens"]["memory"], first + count, first))  # fmt: skip
ax.set_xlabel("slot address (first fit from the left)")
ax.set_ylabel("step")
ax.set_title(
    f"prompt+max_tokens, steps {first}-{first + count}: the memory\n"
    "(green written, red reserved not written, gray free)"
)

fig.suptitle("Day 13: what contiguous K/V reservations waste, against 16-token blocks", fontsize=14)
fig.tight_layout()
png = diagram_path("day13-waste.png")
fig.savefig(png, dpi=80)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** grew out of this measurement. The PagedAttention paper (Kwon et al., SOSP 2023)
#   describes systems that reserve a contiguous chunk per request for its largest possible
#   length and splits their loss three ways: slots reserved for tokens not produced yet,
#   internal fragmentation in the slots never used, and external fragmentation left by the
#   memory allocator between chunks. In the systems the paper profiled, only 20.4% to 38.2% of
#   the K/V memory held token states (quoted). vLLM itself never reserves per request.
#   `gpu_worker.determine_available_memory` measures what is left after a profiling run and
#   `--gpu-memory-utilization` caps it. The rest becomes one pool of blocks (`block_size`, 16
#   by default on CUDA), handed out by `BlockPool` as sequences grow. `--max-model-len` only
#   caps a sequence's length; it reserves nothing.
# * **TensorRT-LLM** has both kinds of K/V cache, and its attention documentation
#   (`docs/source/advanced/gpt-attention.md`) describes them. The contiguous one is one tensor
#   per layer of shape `[max_batch_size * max_beam_width, 2, num_heads, max_seqlen,
#   hidden_dim_per_head]`, which is today's `max_len` policy for every batch slot. The paged one
#   cuts the cache into blocks of `tokens_per_block` that a cache manager hands out to
#   requests as they run.
# * **llama.cpp**'s server splits the context `-c` evenly over its `-np` slots: each slot gets
#   `n_ctx / n_seq_max` cells, which is a fixed per-request reservation again. With
#   `--kv-unified` all slots draw cells from one shared buffer, so a long request can use
#   cells a short one leaves alone.
# * **transformers**' `StaticCache` reserves `max_cache_len` positions per batch row, like
#   `ContiguousKVCache`. It gets fixed tensor addresses for `torch.compile` in exchange, which is
#   the same trade Days 50-55 make for captured graphs, but on top of a paged pool.
#
# ## Try it
#
# 1. **Break the paged count.** Change `waste.paged_slots` to `written // block_size *
#    block_size` (rounding down) and rerun section 3: the assert against
#    `BlockAllocator.num_used` must fail. Put it back.
# 2. **Shrink the block.** Rerun `waste_table` with block sizes 1, 8, 16, 32 and 128 by giving
#    `paged_slots` another `block_size`. The paged waste must never pass `block_size - 1`
#    slots per request. Predict the 16-token value from the mean before you look: about half a
#    block, 7.4 in the committed table.
# 3. **Give the contiguous way a better guess.** Reserve `prompt + 256` instead of
#    `prompt + 512` (outputs over 256 would then have to be refused or moved). Count, over
#    `waste.draw_requests(10_000)`, the requests whose `output` passes 256. Check: the share lies
#    between 10% and 25%, because the lengths table puts the outputs' 0.75 quantile at 250 and
#    their 0.9 quantile at 459.

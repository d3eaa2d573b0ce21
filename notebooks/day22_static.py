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
# # Day 22 — Static batching and its padding
#
# Day 21 ended on the batch: 16 requests in one batch made 3.5 times the tokens a second of
# the same requests one after another, because a decode step reads the weights once however
# many rows it carries. Phase 3 is about how to batch well. It starts with the simplest way,
# the one `transformers`' `generate` offers and `nanoserve.bench throughput` measures the
# engine against: take the next few requests, make them one rectangular tensor, and run the
# rectangle until its last row is done.
#
# A rectangle needs every row to be the same length. The prompts are not, so the short ones
# are padded, on the left so that every row's last prompt token sits in the last column and the
# first new token of every row is predicted from the same place. The outputs are not the same
# length either, so every row keeps computing until the batch's longest output is finished;
# what a row computes after its own last token is thrown away. Today counts both costs, by hand
# and then from a real run, and puts the engine's own static policy (`schedule="static"`) next
# to it: same batches, no padding, a finished row's seat left empty.
#
# 1. the requests, and the three counts of a static batch by hand: padded prompt tokens,
#    wasted row-steps, useful tokens,
# 2. what `run_transformers_workload` really ran, read from the run: the attention mask, the
#    output lengths, the shape of every forward pass, and a miscount that the run catches,
# 3. the tokens: every row of a left-padded batch equals its request run alone; right padding
#    does not, and the check says which row,
# 4. the engine's `schedule="static"` on the same requests: idle seats instead of wasted rows,
# 5. an aside on what `min_new_tokens` does that `ignore_eos` does not,
# 6. the script's count at the benchmark's own size (`days/day22/staticbench.py`),
# 7. the diagram.

# %%
import sys
import warnings

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display
from matplotlib.colors import ListedColormap

from nanocourse import REPO, diagram_path, read_csv, same_or_near_tie
from nanoserve.bench import cpu_line, throughput_workload
from nanoserve.generate import greedy_tokens

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by transformers
sys.path.insert(0, str(REPO / "days" / "day22"))
import staticbench  # the day's script: the notebook runs its measurements and reads its table

# One thread: the counts do not depend on it, and the tiny model's ops are too small to split.
torch.set_num_threads(1)
print(cpu_line())
hf, tiny = staticbench.tiny_pair()  # one set of random weights, in transformers and in nanoserve
probe = torch.arange(1, 21)
with torch.inference_mode():
    diff = (hf(probe[None]).logits[0] - staticbench.logits_of(tiny, probe.tolist())).abs().max().item()
print(f"transformers against nanoserve, the same weights: logits differ by at most {diff:.1e}")
assert diff < 1e-5
SIZE = staticbench.SMALL
BATCH = SIZE["batch"]
reqs = throughput_workload(SIZE["requests"], SIZE["prompt"], SIZE["new"], tiny.cfg.vocab_size, seed=0)
print(f"{len(reqs)} requests in static batches of {BATCH}; tiny Llama, vocab {tiny.cfg.vocab_size}")
for b in range(0, len(reqs), BATCH):
    lengths = ", ".join(f"{len(p)}+{n}" for p, n in reqs[b : b + BATCH])
    print(f"  batch {b // BATCH}: prompt+output tokens {lengths}")

# %% [markdown]
# `throughput_workload` draws each request's prompt length, then its output length, then its
# prompt ids, from one seeded generator; `run_transformers_workload` cuts the list into
# consecutive batches in order. Nothing here is sorted by length, as a server taking requests
# as they arrive could not sort them either.
#
# ## 1. The counts, by hand
#
# For one batch, with prompt lengths p and output lengths n: the rectangle is max(p) wide, so
# a row's padding is max(p) - p; every row generates max(n) tokens, so a row wastes max(n) - n
# of them; the useful tokens are the n that were asked for.


# %%
def static_counts(reqs, batch):
    out = []
    for i in range(0, len(reqs), batch):
        prompts = [len(p) for p, _ in reqs[i : i + batch]]
        outputs = [n for _, n in reqs[i : i + batch]]
        width, longest = max(prompts), max(outputs)
        out.append(
            {
                "padded": sum(width - p for p in prompts),
                "wasted": sum(longest - n for n in outputs),
                "useful": sum(outputs),
            }
        )
    return out


hand = static_counts(reqs, BATCH)
for i, c in enumerate(hand):
    print(f"batch {i}: {c['padded']} padded prompt tokens, {c['wasted']} wasted row-steps, "
          f"{c['useful']} useful")  # fmt: skip
print("all:", {k: sum(c[k] for c in hand) for k in hand[0]})

# %% [markdown]
# The first batch as the rectangle it becomes: one line per row, `.` a pad, `p` a prompt token,
# `g` a generated token that was asked for, `x` one generated after the row had its tokens.

# %%
first = reqs[:BATCH]
width, longest = max(len(p) for p, _ in first), max(n for _, n in first)
for r, (p, n) in enumerate(first):
    print(f"row {r}: " + "." * (width - len(p)) + "p" * len(p) + "|" + "g" * n + "x" * (longest - n))

# %% [markdown]
# Row 2 asked for 2 tokens and computes 16; row 1, with the longest output and the shortest
# prompt, pads 10 positions. The batch's 26 pads are more than a third of its 66 real prompt
# tokens.
#
# ## 2. What transformers ran
#
# `staticbench.measure_transformers` calls the package's `run_transformers_workload` on the
# tiny model in transformers (the weights are `tiny`'s, and their logits agreed above) and
# reads back from the run itself: the attention mask of every batch (its zeros are the pads),
# how many tokens `generate` returned per row beyond the input, and, from a hook on the
# decoder, the (rows, tokens) shape of every forward pass.

# %%
theirs = staticbench.measure_transformers(hf, reqs, BATCH)
for i, (got, c) in enumerate(zip(theirs["batches"], hand)):
    print(
        f"batch {i}: input {got['rows']} x {got['width']}, mask zeros {got['padded']}, "
        f"generated per row {got['generated']}, positions computed {got['positions']}"
    )
    assert got["padded"] == c["padded"]
    assert sum(got["generated"]) - c["useful"] == c["wasted"]
assert theirs["useful"] == sum(c["useful"] for c in hand)

# %% [markdown]
# Each row of a batch came back with the same number of new tokens, the batch's longest
# output, and the mask's zeros are the padding by hand. The forward passes of the first batch:
# one prefill over the whole rectangle, then one pass per new token, every row every time.

# %%
calls = []
record = lambda module, args, kw, out: calls.append(tuple(kw["input_ids"].shape))  # noqa: E731
hook = hf.model.register_forward_hook(record, with_kwargs=True)
staticbench.run_transformers_workload(hf, first, BATCH, staticbench.PAD_ID)
hook.remove()
print(f"{calls[0]} once, then {calls[1]} x {len(calls) - 1}")
assert calls == [(BATCH, width)] + [(BATCH, 1)] * (longest - 1)
assert theirs["batches"][0]["positions"] == BATCH * (width + longest - 1)

# %% [markdown]
# The first batch computed 4 x (23 + 15) = 152 token positions. Its useful work was the 66
# prompt tokens and, per row, one position per token generated after the first (the first new
# token comes out of the prefill): 66 + 37 = 103, two thirds.
#
# The counts are easy to get subtly wrong. A version that measures the waste from the shortest
# member instead of the longest, as if the batch stopped when its first row did, gives a number
# that looks as plausible as the right one; the run's output lengths say otherwise:

# %%
def wasted_from_shortest(reqs, batch):  # wrongly built: the batch does not stop at its shortest row
    return [sum(n - min(o for _, o in reqs[i : i + batch]) for _, n in reqs[i : i + batch])
            for i in range(0, len(reqs), batch)]  # fmt: skip


measured = [sum(b["generated"]) - c["useful"] for b, c in zip(theirs["batches"], hand)]
try:
    planted = wasted_from_shortest(reqs, BATCH)
    assert planted == measured, f"counted {planted} wasted row-steps; the run generated {measured} extra"
    raise RuntimeError("the miscount went unnoticed")
except AssertionError as e:
    print("caught:", e)

# %% [markdown]
# ## 3. The same tokens, and why the padding goes on the left
#
# Padding only costs work if the answers stay right. `measure_transformers` kept the first n
# generated tokens of every row; each must equal the request run alone through nanoserve's
# eager path (`greedy_tokens`, one sequence, no padding). Different shapes round differently,
# so, as in `tests/test_engine.py`, a difference would be excused only where the reference's
# top two logits are within 1e-4 (`nanocourse.same_or_near_tie`).

# %%
with torch.inference_mode():
    alone = [greedy_tokens(tiny, p, n) for p, n in reqs]
check = same_or_near_tie
verdicts = [check(tiny, p, ref, got) for (p, _), ref, got in zip(reqs, alone, theirs["tokens"])]
print("left-padded batches against each request alone:", verdicts)
assert verdicts == ["equal"] * len(reqs)

# %% [markdown]
# The planted version pads on the right: the prompt first, then the pads, the mask still
# marking which is which. `generate` appends after the last column, so a short row's first new
# token is predicted from a pad's position, and the check has to catch it.


# %%
def right_padded(hf, batch_reqs):
    width = max(len(p) for p, _ in batch_reqs)
    ids = torch.full((len(batch_reqs), width), staticbench.PAD_ID)
    mask = torch.zeros_like(ids)
    for r, (p, _) in enumerate(batch_reqs):
        ids[r, : len(p)], mask[r, : len(p)] = torch.tensor(p), 1  # wrongly built: pads after the prompt
    longest = max(n for _, n in batch_reqs)
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                          do_sample=False, pad_token_id=staticbench.PAD_ID)  # fmt: skip
    return [out[r, width : width + n].tolist() for r, (_, n) in enumerate(batch_reqs)]


wrong = right_padded(hf, first)
for r, ((p, _), ref, got) in enumerate(zip(first, alone, wrong)):
    try:
        same_or_near_tie(tiny, p, ref, got)
        print(f"row {r} ({len(p)} prompt tokens, {width - len(p)} pads): equal")
    except AssertionError as e:
        print(f"row {r} ({len(p)} prompt tokens, {width - len(p)} pads): caught: {e}")
assert wrong[3] == alone[3] and all(wrong[r] != alone[r] for r in range(3))

# %% [markdown]
# Only row 3, the batch's longest prompt, has no pads and so comes out right; the other three
# go wrong at their first token. Left padding is not a convention but the condition for the
# rectangle to give each row its own answer.
#
# ## 4. The engine's static batches
#
# The engine as it stands today, `engine_config(22)`, schedules with `schedule="static"`, the
# first policy it has (later days add others and keep this one as a named variant): a batch is
# admitted only when nothing is running, as many waiting requests as there are rows,
# and nobody joins until its last member is done. Two things differ from the rectangle. The
# prompts go into one ragged prefill step, packed end to end with no padding (the model reads a
# flat list of tokens, Day 23), and a row that has its tokens leaves the step, so its seat is
# empty instead of computing. `staticbench.static_engine` gives it 4 rows and a step budget that
# takes a whole batch's prompts at once, as the rectangle's prefill does;
# `run_static_engine` records, for every step, the rows it computed and how many members of the
# running batch had already finished. (The engine's `add_request` and `step` are the loop Day 34
# builds its API on; here they only carry the schedule.)

# %%
engine = staticbench.static_engine(tiny, reqs, BATCH)
mine = staticbench.run_static_engine(engine, reqs)
steps = mine["steps"]
print("step | batch | kind    | rows | idle seats | tokens")
for i, s in enumerate(steps[:17]):
    print(f"{i:>4} | {s['batch']:>5} | {s['kind']:<7} | {s['rows']:>4} | {s['idle']:>10} | {s['tokens']:>6}")
print(f"... {len(steps)} steps in all, step_kinds {engine.step_kinds}")

# %% [markdown]
# Batch 0's prefill step carries 66 tokens, exactly its prompts; each following step carries
# one token per unfinished row. Row 2 (2 tokens) leaves after step 1, and from step 12 on three
# of the four seats are empty. Counted per batch against section 1:

# %%
for i, c in enumerate(hand):
    mine_b = [s for s in steps if s["batch"] == i]
    idle, prefill = sum(s["idle"] for s in mine_b), mine_b[0]["tokens"]
    prompts = sum(len(p) for p, _ in reqs[i * BATCH : (i + 1) * BATCH])
    longest_b = max(n for _, n in reqs[i * BATCH : (i + 1) * BATCH])
    print(f"batch {i}: {len(mine_b)} steps, prefill {prefill} tokens for {prompts} prompt tokens, "
          f"{idle} idle row-steps (transformers wasted {c['wasted']})")  # fmt: skip
    assert prefill == prompts and idle == c["wasted"] and len(mine_b) == longest_b
engine_tokens = [check(tiny, p, ref, got) for (p, _), ref, got in zip(reqs, alone, mine["tokens"])]
assert engine_tokens == ["equal"] * len(reqs)
print("the engine's static tokens against each request alone: all", len(reqs), "equal")

# %% [markdown]
# The engine spends no position on padding and none on a finished row, and its steps are as
# many as the rectangle's: a batch still lasts as long as its longest output. The idle
# row-steps equal transformers' wasted ones exactly, because they are the same seats, held by
# requests that are done, while the batch's longest member runs on. In the rectangle a wasted
# row-step costs a position of compute; in the engine it costs only the seat: a request
# waiting in the queue that could have used it. That cost is the next one to remove, on Day 27.
#
# ## 5. An aside: `min_new_tokens` is not `ignore_eos`
#
# Both ways here are told to produce exactly n tokens whatever they pick: nanoserve with
# `SamplingParams(ignore_eos=True)`, transformers with `min_new_tokens`. They are not the same
# rule. The tiny model's transformers config has no end-of-sequence id (`tiny_pair` removes
# it); with the default id 2 put back, request 52 of the benchmark-sized workload goes like this:

# %%
full = throughput_workload(64, (16, 256), (16, 128), tiny.cfg.vocab_size, seed=0)
p52, n52 = full[52]
hf.generation_config.eos_token_id = 2
ids = torch.tensor([p52])
with torch.inference_mode():
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n52, min_new_tokens=n52,
                      do_sample=False, pad_token_id=staticbench.PAD_ID)  # fmt: skip
    ours52 = greedy_tokens(tiny, p52, n52)
hf.generation_config.eos_token_id = None
theirs52 = out[0, len(p52) :].tolist()
k = next(i for i, (a, b) in enumerate(zip(ours52, theirs52)) if a != b)
print(f"nanoserve (ignore_eos): {ours52[: k + 3]}")
print(f"transformers (min_new_tokens, eos 2): {theirs52[: k + 3]}")
print(f"first difference at token {k}: {ours52[k]} against {theirs52[k]}")
assert ours52[k] == 2 and len(theirs52) == len(ours52) == n52

# %% [markdown]
# At token 7 the greedy choice is the end-of-sequence id. nanoserve takes it and carries on
# past it; transformers meets `min_new_tokens` by removing that id from the choice
# (`MinNewTokensLengthLogitsProcessor`), so it takes the runner-up, and from there the two
# continue differently. Both produce 50 tokens, so `bench throughput`'s useful-token counts
# agree, but its two sides do not generate the same text for every request. With SmolLM2 the
# end-of-sequence token is a real one, so a benchmark that compares tokens across the two has
# to take this into account.
#
# ## 6. At the benchmark's size
#
# `days/day22/staticbench.py`'s default run is `bench throughput`'s workload: 64 requests,
# prompts of 16 to 256 tokens, outputs of 16 to 128, static batches of 16. The workload's
# lengths come from the generator before any token id is drawn, and a draw of ids takes the
# same share of the generator whatever the vocabulary, so these lengths are the ones the bench
# gives SmolLM2 (asserted below); the script runs both static ways on the tiny model, checks
# every count against the run as section 2 did and every request's tokens against the request
# alone, and writes `day-22-static.csv`:

# %%
smol = throughput_workload(64, (16, 256), (16, 128), 49152, seed=0)
assert [(len(p), n) for p, n in smol] == [(len(p), n) for p, n in full]
table = read_csv(staticbench.CSV)
cols = ["batch", "prompt_tokens", "width", "padded_prompt_tokens", "longest_output", "useful_tokens",
        "wasted_row_steps", "hf_positions", "engine_positions", "engine_idle_row_steps",
        "useful_share"]  # fmt: skip
print(" | ".join(cols))
for r in table:
    print(" | ".join(r[c] for c in cols))
by_batch = [r for r in table if r["batch"] != "all"]
got = [(int(r["padded_prompt_tokens"]), int(r["wasted_row_steps"]), int(r["useful_tokens"]))
       for r in by_batch]  # fmt: skip
assert got == [(c["padded"], c["wasted"], c["useful"]) for c in static_counts(full, 16)]

# %% [markdown]
# Over the 64 requests transformers padded 7,606 prompt positions, more than the 7,386 real
# prompt tokens: with prompt lengths spread evenly from 16 to 256, a batch of 16 nearly always
# holds one close to 256, and the average row is half as long. The outputs go the same way:
# every batch's longest is 117 to 128 tokens, so 3,851 row-steps were generated past their
# request's end against 4,133 that were asked for. Of the 22,912 token positions the four
# rectangles computed, the engine's static batches needed 11,455, one position short of half
# (`useful_share` prints it rounded, 0.5).
#
# A position is not a unit of time, though. A padded prompt position costs what a real one
# does, since prefill's matrix products grow with every row of the rectangle. A wasted decode
# row costs less than its count suggests, since one decode step reads the weights once for all
# its rows (Day 12, Day 21), and a row more adds only its share of the arithmetic and of the
# attention over its padded context. Day 33 measures the time; today's table is the work. And
# the engine's static batches, for all their saved positions, take exactly as many steps as the
# rectangles (499 here, the sum of the four longest outputs), because a step still waits for
# the batch's longest member.
#
# ## 7. The diagram

# %%
PAD, PROMPT, USEFUL, WASTED = 1, 2, 3, 4
cmap = ListedColormap(["white", "#bbbbbb", "#e0b070", "tab:blue", "tab:red"])


def rectangles(reqs, batch, gap=1):
    """The static batches as one image: a line per row, prompts right-aligned at one column."""
    wmax = max(len(p) for p, _ in reqs)
    lmax = max(max(n for _, n in reqs[i : i + batch]) for i in range(0, len(reqs), batch))
    lines = []
    for i in range(0, len(reqs), batch):
        chunk = reqs[i : i + batch]
        width, longest = max(len(p) for p, _ in chunk), max(n for _, n in chunk)
        for p, n in chunk:
            line = np.zeros(wmax + lmax, dtype=int)
            line[wmax - width : wmax - len(p)] = PAD
            line[wmax - len(p) : wmax] = PROMPT
            line[wmax : wmax + n] = USEFUL
            line[wmax + n : wmax + longest] = WASTED
            lines.append(line)
        lines += [np.zeros(wmax + lmax, dtype=int)] * gap
    return np.array(lines[:-gap]), wmax


fig, axes = plt.subplots(2, 2, figsize=(14, 10), gridspec_kw={"hspace": 0.35, "wspace": 0.22})
ax = axes[0, 0]
img, wmax = rectangles(reqs, BATCH)
ax.imshow(img, cmap=cmap, vmin=0, vmax=4, aspect="auto", interpolation="nearest")
ax.axvline(wmax - 0.5, color="black", lw=1)
ax.set_xlabel("token position (prompts end at the black line; generated tokens to its right)")
ax.set_ylabel("row, batch by batch")
ax.set_yticks([])
tot = {k: sum(c[k] for c in hand) for k in hand[0]}
ax.set_title(f"transformers, {len(reqs)} requests in batches of {BATCH}: {tot['padded']} pads, "
             f"{tot['wasted']} wasted, {tot['useful']} useful", fontsize=10)  # fmt: skip
handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(k)) for k in (PAD, PROMPT, USEFUL, WASTED)]
ax.legend(handles, ["pad", "prompt", "generated, asked for", "generated past the row's end"], fontsize=8,
          loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=4)  # fmt: skip

ax = axes[0, 1]
x = np.arange(len(steps))
rows = np.array([s["rows"] for s in steps])
idle = np.array([s["idle"] for s in steps])
ax.bar(x, rows, color=["#e0b070" if s["kind"] == "prefill" else "tab:blue" for s in steps], width=0.9)
ax.bar(x, idle, bottom=rows, color="white", edgecolor="tab:red", hatch="///", width=0.9)
for i in range(1, len(steps)):
    if steps[i]["batch"] != steps[i - 1]["batch"]:
        ax.axvline(i - 0.5, color="black", lw=1)
ax.set_xlabel("engine step (prefill steps in tan; black lines: a new static batch)")
ax.set_ylabel("rows of the step")
ax.set_yticks(range(BATCH + 1))
ax.set_title(f"the engine's schedule=\"static\", same requests: no pads, "
             f"{int(idle.sum())} idle seats (hatched)", fontsize=10)  # fmt: skip

ax = axes[1, 0]
b = [r for r in table if r["batch"] != "all"]
xb = np.arange(len(b))
get = lambda k: np.array([int(r[k]) for r in b])  # noqa: E731
prompt, pads = get("prompt_tokens"), get("padded_prompt_tokens")
dec_useful, wasted = get("useful_tokens") - get("rows"), get("wasted_row_steps")
bottom = np.zeros(len(b))
parts = [(prompt, "#e0b070", "prompt"), (pads, "#bbbbbb", "pads"),
         (dec_useful, "tab:blue", "decode, asked for"), (wasted, "tab:red", "decode, past the end")]
for vals, color, label in parts:
    ax.bar(xb - 0.2, vals, 0.38, bottom=bottom, color=color, label=label)
    bottom += vals
ax.bar(xb + 0.2, prompt, 0.38, color="#e0b070")
ax.bar(xb + 0.2, dec_useful, 0.38, bottom=prompt, color="tab:blue")
for i, r in enumerate(b):
    ax.text(i - 0.2, int(r["hf_positions"]) + 60, r["hf_positions"], ha="center", fontsize=8)
    ax.text(i + 0.2, int(r["engine_positions"]) + 60, r["engine_positions"], ha="center", fontsize=8)
ax.set_xticks(xb, [f"batch {r['batch']}\ntransf. | engine" for r in b], fontsize=8)
ax.set_ylabel("token positions computed")
ax.set_title("the benchmark's 64 requests, batches of 16 (day-22-static.csv)", fontsize=10)
ax.legend(fontsize=8, loc="upper right", ncols=2)
ax.set_ylim(0, 7600)

ax = axes[1, 1]
img, wmax = rectangles(full, 16, gap=3)
ax.imshow(img, cmap=cmap, vmin=0, vmax=4, aspect="auto", interpolation="nearest")
ax.axvline(wmax - 0.5, color="black", lw=1)
ax.set_yticks([])
ax.set_xlabel("token position")
ax.set_ylabel("row, batch by batch")
every = next(r for r in table if r["batch"] == "all")
ax.set_title(f"the same 64 requests as rectangles: {int(every['engine_positions']):,} of "
             f"{int(every['hf_positions']):,} positions useful, just under half", fontsize=10)  # fmt: skip
fig.suptitle("Day 22: static batches, left-padded, each until its longest member", fontsize=14)
png = diagram_path("day22-static.png")
fig.savefig(png, dpi=100, bbox_inches="tight")
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **transformers**' `generate` is today's rectangle. A decoder-only model is meant to be fed
#   left-padded batches (the tokenizer's `padding_side="left"`); `generate` logs a warning when
#   it sees a pad in the last column ("right-padding was detected"), because it knows the first
#   new token would come from a pad. Position ids are rebuilt from the attention mask, so a
#   padded row's first real token still sits at position 0. Newer releases add a separate
#   continuous-batching path, `generate_batch` over a `ContinuousBatchingManager`, which is what
#   `transformers serve` builds on; plain `generate` is still the static one.
# * **TensorRT-LLM** had both ways in its executor API, `BatchingType.STATIC` and
#   `BatchingType.INFLIGHT` (the Triton backend's `gpt_model_type` "V1" against
#   "inflight_fused_batching"). Recent releases refuse the static type and keep static
#   batches as a capacity scheduler policy of in-flight batching, `STATIC_BATCH`, which
#   schedules nothing new until the current batch has completed: the engine's own
#   `schedule="static"`. In-flight batching needs packed inputs, built with
#   `trtllm-build --remove_input_padding enable`: the prompts of a step go end to end as one
#   flat token list, which is how the engine's prefill step above took 66 tokens for 66.
# * **Orca** (Yu et al., OSDI 2022) is the paper that named the cost: scheduling a whole
#   request at a time keeps a finished request's row busy until the batch ends and keeps a new
#   request waiting for it. Its answer, iteration-level scheduling, decides the batch again at
#   every step; to batch rows of different lengths it runs the matrix products on the flattened
#   tokens of all rows and attention per request ("selective batching"), the split nanoserve's
#   flat `input_ids` and per-row `context_lens` make.
# * **vLLM** and **llama.cpp** never had a static mode to speak of. llama.cpp's `llama_batch`
#   is a flat list of tokens, each with its own position and sequence id, so a batch of
#   different lengths needs no padding by construction; its server assigns requests to slots
#   (`-np`) as they come.
#
# ## Try it
#
# 1. **Sort first.** Sort `reqs` by output length before batching and rerun sections 1 and 4:
#    the wasted row-steps must drop (predict by how much with `static_counts` before running),
#    and the engine's idle row-steps must still equal them. Why can a server not do this?
# 2. **Break the engine's count.** In `staticbench.run_static_engine`, count `idle` from the
#    rows still running (`len(sched.running)`) instead of the finished members; the script's
#    assert `engine_idle_row_steps == wasted_row_steps` must fail on the first batch
#    (`python days/day22/staticbench.py --requests 12 --batch 4 --prompt-len 4 24 --output-len
#    2 16 --out /tmp/t.csv`).
# 3. **A batch of one.** Rerun the script with `--batch 1`: every count of waste must be 0 and
#    `useful_share` 1.0, and the engine's steps become the sum of all outputs. What is lost?

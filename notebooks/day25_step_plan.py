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
# # Day 25 — The step plan
#
# Days 23 and 24 ran two kinds of step through one forward: a packed row of prompt tokens, and
# one token for each of many rows. Both times the model was told the same things in the same
# form, a `StepPlan`: the flat tokens and their positions, where each token's K/V goes, and for
# each row which slots it reads, how many of them, and which token's logits to keep. Today is
# about that object on its own. The scheduler decides which sequences get how many tokens;
# `plan.py` turns the decision and the block tables into tensors; the cache and the model read
# nothing else. Whatever goes wrong in addressing goes wrong in the plan, which is why it is the
# place to check it.
#
# 1. a real engine's steps on SmolLM2, prefill steps and decode steps, each plan printed whole,
# 2. every plan built by hand from the batch and the block tables first, and asserted equal to
#    the engine's, step after step,
# 3. two checks of our own that read nothing but the plan and the block tables: every window
#    agrees with its table, and every row's span is in order and written where it should be,
# 4. the checks refusing plans built wrong: a slot outside its table, a write to another row's
#    slot, positions out of order,
# 5. what a plan holds per kind of step, over a longer workload (`days/day25/planbench.py`),
# 6. the diagram.

# %%
import dataclasses
import inspect
import sys

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, engine_config, read_csv
from nanoserve.engine import Engine
from nanoserve.models import load_model
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day25"))
import planbench  # the day's script: its per-kind sizes, and the table it wrote

torch.set_num_threads(1)
MODEL_DIR = fetch_default_model()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
BS = 4  # small blocks: a short prompt already owns several
per_block = model.cfg.kv_bytes_per_token(model.dtype) * BS
# the engine as of today: static batches (Day 22), attention by gather, the model's own linears;
# the default step budget of 512 tokens takes every prompt here whole (its add_request and step
# are the loop Day 34 builds its API on)
config = engine_config(25, block_size=BS, max_batch=4, max_model_len=128, kv_budget=64 * per_block)
eng = Engine(model, tok, config)
ARRIVALS = {0: ["Rain falls from the sky when", "The moon is"],
            2: ["A recipe for bread needs flour, water, salt and yeast"]}  # fmt: skip
for step, texts in ARRIVALS.items():
    for t in texts:
        print(f"step {step}: {len(tok.encode(t)):>2} tokens  {t!r}")
print(f"blocks of {BS} tokens, a step budget of {config.max_num_batched_tokens} tokens, "
      f"schedule {config.schedule!r}")  # fmt: skip

# %% [markdown]
# ## 1. and 2. Every plan, built by hand first
#
# The hand-built plan starts from what the engine's static schedule hands the runner (Day 26
# opens the scheduler), a `Batch`: either decode rows (a sequence whose prompt is in the
# cache, one token: its newest) or prompt chunks (a sequence and a range of its positions,
# here always its whole prompt). `Batch.as_chunks` writes both as chunks, a decode row being
# the chunk `[len - 1, len)`. From each chunk and the sequence's block table:
#
# * its tokens, and their positions `start .. end - 1`, go on the end of the flat row;
# * position `p` lives in slot `blocks[p // block_size] * block_size + p % block_size`, where
#   its K/V is written;
# * the row attends over `end` positions, and reads them through a window of slots for
#   positions `0 .. W - 1`, W being the most blocks any row has times the block size, a short
#   table padded with block 0;
# * the row's logits are taken at its last token, the end of its span in the flat row.


# %%
def plan_by_hand(batch, bs):
    """The step's addressing from the batch and the block tables, as plain lists."""
    chunks = batch.as_chunks()
    ids, pos, slots, spans = [], [], [], []
    for seq, start, end in chunks:
        blocks = seq.block_table.blocks
        n0 = len(ids)
        ids += seq.token_ids[start:end]
        pos += range(start, end)
        slots += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
        spans.append((n0, len(ids), end))
    width = max(len(s.block_table.blocks) for s, _, _ in chunks) * bs
    window = []
    for seq, _, _ in chunks:
        blocks = seq.block_table.blocks + [0] * (width // bs - len(seq.block_table.blocks))
        window.append([blocks[j // bs] * bs + j % bs for j in range(width)])
    return {"input_ids": ids, "positions": pos, "write_slots": slots,
            "context_lens": [e for _, _, e in spans], "slot_window": window,
            "logits_at": [n1 - 1 for _, n1, _ in spans], "row_spans": spans}  # fmt: skip


def as_lists(plan, fields):
    return {f: v.tolist() if isinstance(v := getattr(plan, f), torch.Tensor) else v for f in fields}


seen = []  # (step, kind, batch summary, the engine's plan, its rows' block tables then)
build = eng.runner.plan


def planned(batch):
    """The runner's plan, after checking it against the hand-built one."""
    mine = plan_by_hand(batch, BS)
    plan = build(batch)
    theirs = as_lists(plan, mine)
    assert theirs == mine, {f: (mine[f], theirs[f]) for f in mine if mine[f] != theirs[f]}
    chunks = [(s.request_id, a, b) for s, a, b in batch.chunks]
    decode = [s.request_id for s in batch.decode]
    seen.append((len(seen), planbench.kind_of(batch), decode, chunks, plan, planbench.tables_of(plan)))
    return plan


eng.runner.plan = planned
for step in range(5):
    for t in ARRIVALS.get(step, []):
        eng.add_request(t, SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
for step, kind, decode, chunks, *_ in seen:
    print(f"step {step}: {kind:<8} decode rows {decode}, chunks {chunks}; equal to the hand-built plan")
assert [k for _, k, *_ in seen] == ["prefill", "decode", "decode", "prefill", "decode"]

# %% [markdown]
# Five steps, five plans, each equal field by field to the one built from the batch and the
# block tables in the cell above. Step 0 packs both prompts (Day 23) and steps 1 and 2 decode
# both rows (Day 24). The third request arrives before step 2, but the static schedule admits
# nobody into a running batch: it waits until both rows have their 3 tokens, and step 3 is a
# new batch of one, its prompt packed alone, step 4 its first decode. Here are the plans of
# steps 0, 2 and 3 in full:

# %%
FIELDS = ["input_ids", "positions", "write_slots", "context_lens", "logits_at", "row_spans"]


def show_plan(step):
    _, kind, decode, chunks, plan, _ = seen[step]
    print(f"--- step {step}, {kind}: {type(plan).__name__}, is_decode={plan.is_decode}, "
          f"{plan.num_tokens} tokens, {len(plan.rows)} rows")  # fmt: skip
    for f in FIELDS:
        print(f"  {f:<13}", as_lists(plan, [f])[f])
    if not plan.is_decode:
        print(f"  {'chunks':<13}", [(s.request_id, a, b) for s, a, b in plan.chunks])
    print(f"  {'slot_window':<13}", tuple(plan.slot_window.shape))
    for r, s in enumerate(plan.rows):
        print(f"    row {r} ({s.request_id}): {plan.slot_window[r].tolist()}")


for step in (0, 2, 3):
    show_plan(step)

# %% [markdown]
# What to read in them:
#
# * **The flat row.** `input_ids`, `positions` and `write_slots` have one entry per token the
#   step computes (9, 2 and 12 here); everything else has one per row. A prefill row has a
#   prompt's tokens, a decode row has one.
# * **Positions restart per row** and say where each token sits in its own sequence; in the
#   decode rows they are each sequence's length minus one. `context_lens` is the end of each
#   row's chunk: everything up to and including its last new token.
# * **Slots** are block arithmetic. In step 2 req-1 (the moon prompt) writes its newest token,
#   position 4, to slot 12: 4 // 4 = 1 picks its second block, block 3, which the scheduler
#   gave it for this very token, and 4 % 4 = 0 its first slot, 3 x 4 + 0.
# * **The window is the only 2-D tensor**, rows by W. W is set by the row with the most blocks,
#   and shorter rows are padded with block 0's slots, which `context_lens` hides.
# * **A prefill plan is a `PrefillPlan`**, which also keeps the chunks it was built from; a
#   decode plan is the base `StepPlan` with `is_decode` set, and nothing else. (Day 57's mixed
#   step is a prefill plan whose first rows are decode rows.)
#
# ## 3. Two checks of a plan
#
# Whatever goes wrong in addressing goes wrong in the plan, so a plan can be checked before
# any forward reads it, from nothing but itself and the block tables. `planbench` holds two
# such checks, run on every plan the script builds. `check_windows`: each row's window agrees
# with its block table at every position the row attends to. `check_spans`: a row whose span
# holds n tokens and whose context is c has positions c - n to c - 1 in order, writes each where
# its window maps that position, and samples at the end of its span; for a decode row (n = 1)
# that is the rule that a row at position p attends over p + 1 positions. (A finished request's
# block table is emptied when its blocks go back, so `planned` kept a copy of each plan's tables
# as it was built, `planbench.tables_of`, and the cells below check against those.)

# %%
print(inspect.getsource(planbench.check_windows))
print(inspect.getsource(planbench.check_spans))
for *_, plan, tables in seen:
    planbench.check_windows(plan, tables)  # the tables as they were when the plan was built
    planbench.check_spans(plan)
print(f"check_windows and check_spans passed on all {len(seen)} plans")

# %% [markdown]
# ## 4. Plans built wrong
#
# Each planted plan is a copy of one the engine built, with one thing changed, and both checks
# run on it. Four mistakes: a window entry pointing outside the row's table, a decode row
# writing into another row's slot, a prompt chunk with two positions swapped, and a decode row
# one position off:


# %%
def planted(step, change):
    plan = seen[step][4]
    copy = dataclasses.replace(plan, **{f: getattr(plan, f).clone() for f in
                                        ("input_ids", "positions", "write_slots", "context_lens",
                                         "slot_window", "logits_at")})  # fmt: skip
    change(copy)
    return copy


other = seen[2][4].write_slots[0].item()  # req-0's newest slot in step 2
cases = {  # name: (step, change)
    "window slot outside the table (decode, row 1)": (2, lambda p: p.slot_window[1, :1].fill_(200)),
    "write into another row's slot (decode, row 1)": (2, lambda p: p.write_slots[1:2].fill_(other)),
    "positions swapped (prefill, chunk)": (0, lambda p: p.positions[2:4].copy_(p.positions[[3, 2]])),
    "position one off (decode, row 1)": (2, lambda p: p.positions[1:2].add_(1)),
}  # fmt: skip
checks = {"check_windows": planbench.check_windows, "check_spans": planbench.check_spans}
verdicts = {}
for name, (step, change) in cases.items():
    bad, tables = planted(step, change), seen[step][5]
    print(f"{name}:")
    for cname, check in checks.items():
        try:
            check(bad, tables) if cname == "check_windows" else check(bad)
            verdicts[name, cname] = "passed"
            print(f"  {cname}: passed")
        except AssertionError as e:
            verdicts[name, cname] = "refused"
            print(f"  {cname}: refused, {e}")
for *_, plan, _ in seen:  # the engine's own plans are untouched by the planting
    planbench.check_spans(plan)
assert all(any(v == "refused" for (n, _), v in verdicts.items() if n == name) for name in cases)

# %% [markdown]
# Every planted plan is refused by at least one check, and neither catches everything.
# `check_windows` looks only at windows: it names slot 200 in row 1, which no block of row 1
# holds, and passes the three plans whose windows are right. `check_spans` catches the wrong
# write, the swapped positions inside a prompt chunk and the position one off; it does not
# compare windows with block tables, so it passes the bad window (its write still goes where
# the bad window says position 4 is, and the bad entry is at position 0).
#
# The swapped positions are the case a forward would never notice. Nothing in the model checks
# that positions are in order: the two tokens' keys are rotated for each other's positions and
# written to each other's slots, the logits come out finite, and the next step reads K/V that
# never belonged where it sits. (Day 54 builds the package's own checks of a plan, for
# captured steps, on the same rules.)
#
# ## 5. What a plan holds, by kind of step
#
# `planbench` runs 16 requests (prompts of 8 to 200 tokens, 8 to 48 new tokens, one arriving
# every 3 steps) through the engine as of today with 16-token blocks, 8 rows and a step budget
# of 2,048 tokens (room for a whole static batch's prompts), and records every plan's sizes,
# checking each as the notebook did. The tiny random-weight model stands in for SmolLM2: with
# `ignore_eos` the schedule depends on the lengths alone. The sizes of the largest plan of each
# kind, and the checks that passed (`days/day25/day-25-plans.csv`; `build_us`, the mean time to
# build one plan, is this machine's):

# %%
committed = read_csv(planbench.CSV_PLANS)
keys = ["kind", "steps", "tokens_max", "rows_min", "rows_max", "largest_rows", "largest_width",
        "per_token_bytes", "per_row_bytes", "window_bytes", "window_share", "checks_passed",
        "build_us"]  # fmt: skip
print(" | ".join(keys))
for r in committed:
    print(" | ".join(r[k] for k in keys))
for r in committed:  # every plan passed both checks
    assert int(r["checks_passed"]) == 2 * int(r["steps"])

# %% [markdown]
# The per-token tensors grow with the step's tokens, 24 bytes a token, and the per-row ones
# with its rows, 16 bytes a row; the window grows with rows times the widest context. A decode
# step of 7 rows carries 168 bytes of tokens and 11,648 bytes of window, 0.977 of the plan; the
# largest prefill step, a static batch's 836 prompt tokens in 7 rows, is the one plan where the
# tokens weigh more (a `window_share` of 0.348). The static schedule shows in the counts too:
# with one request arriving every 3 steps, the first batch held only the first request, the
# next ones 8 and 7, so 3 prefill steps served all 16 prompts and 123 decode steps the rest.
# That the window is most of every decode plan is why Day 51 keeps the windows in a slot table
# written in place as sequences grow, instead of rebuilding them every step, and why Day 58's
# native kernel reads the K/V in place through the window instead of gathering a padded copy.
#
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
colors = {"req-0": "tab:blue", "req-1": "tab:orange", "req-2": "tab:green"}
for ax, step in zip((axes[0, 0], axes[0, 1], axes[1, 0]), (0, 2, 3)):
    _, kind, _, _, plan, _ = seen[step]
    n, (rows, width) = plan.num_tokens, plan.slot_window.shape
    # the flat row on top: one cell per token, its position inside, its write slot below
    for r, (a, b, _) in enumerate(plan.row_spans):
        for i in range(a, b):
            face = colors[plan.rows[r].request_id]
            ax.add_patch(plt.Rectangle((i, -2.2), 0.95, 0.9, color=face))
            ax.text(i + 0.47, -1.75, str(plan.positions[i].item()), ha="center", va="center", fontsize=7)
            ax.text(i + 0.47, -0.95, str(plan.write_slots[i].item()), ha="center", va="center", fontsize=6)
    # the window below: one row per plan row, faded past its context
    for r in range(rows):
        ctx = plan.context_lens[r].item()
        face = colors[plan.rows[r].request_id]
        for j in range(width):
            ax.add_patch(plt.Rectangle((j, r + 0.2), 0.95, 0.9, color=face, alpha=1.0 if j < ctx else 0.2))
            slot = plan.slot_window[r, j].item()
            ax.text(j + 0.47, r + 0.65, str(slot), ha="center", va="center", fontsize=6)
    ax.set_xlim(-0.2, max(n, width) + 0.2)
    ax.set_ylim(rows + 0.3, -2.4)
    ticks = ["position", "write slot"] + [f"window, row {r}" for r in range(rows)]
    ax.set_yticks([-1.75, -0.95] + [r + 0.65 for r in range(rows)], ticks, fontsize=8)
    ax.set_xticks([])
    ax.set_title(f"Step {step}, {kind}: {n} tokens, window {rows} x {width}", fontsize=10)
axes[0, 0].legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()],
                  ["rain prompt", "moon prompt", "bread prompt"], fontsize=8, loc="center right")  # fmt: skip

ax = axes[1, 1]
labels = [r["kind"] for r in committed]
parts = [("per_token_bytes", "tokens: ids, positions, slots", "tab:blue"),
         ("per_row_bytes", "rows: context_lens, logits_at", "tab:orange"),
         ("window_bytes", "slot_window", "tab:gray")]  # fmt: skip
bottom = [0.0] * len(committed)
for key, label, color in parts:
    vals = [int(r[key]) / 1024 for r in committed]
    ax.bar(range(len(committed)), vals, bottom=bottom, color=color, label=label)
    bottom = [b + v for b, v in zip(bottom, vals)]
ax.set_xticks(range(len(committed)), labels, fontsize=8)
ax.set_ylabel("KiB in the largest plan of the kind")
ax.set_title("Where a plan's bytes are (day-25-plans.csv, 16 requests)", fontsize=10)
ax.legend(fontsize=8)

fig.suptitle("Day 25: the plans of a real engine's steps, SmolLM2, blocks of 4, static batches", fontsize=13)
fig.tight_layout()
png = diagram_path("day25-step-plan.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** V1 splits the same information in two. The scheduler's `SchedulerOutput`
#   (`vllm/v1/core/sched/output.py`) says what to compute: `num_scheduled_tokens` per request,
#   new requests with their block ids, and the block ids each running request gained. The
#   model runner's `_prepare_inputs` (`vllm/v1/worker/gpu_model_runner.py`) turns it into
#   tensors: `input_ids` and `positions` for the flat batch, and a `CommonAttentionMetadata`
#   (`vllm/v1/attention/backends/utils.py`) with `query_start_loc` (our span starts, plus the
#   end), `seq_lens` (our `context_lens`), `block_table_tensor` (our block tables, where we
#   expand to a window of slots) and `slot_mapping` (our `write_slots`). Each attention backend
#   then builds its own metadata from it. The block table and its slot mapping live in
#   persistent buffers of the runner's input batch, updated in place, the idea Day 53 takes up.
# * **SGLang**'s `ForwardBatch` (`python/sglang/srt/model_executor/forward_batch_info.py`)
#   carries `input_ids`, `positions`, `out_cache_loc` (the write slots), `seq_lens`, and for
#   prefill `extend_seq_lens`, `extend_prefix_lens` and `extend_start_loc`; which slots a
#   request reads comes from `req_to_token_pool` indexed by `req_pool_indices`. Its
#   `forward_mode` says what kind of step it is (`EXTEND`, `DECODE`, `MIXED`, and more).
# * **TensorRT-LLM** passes the plan as engine inputs: packed `input_ids` and `position_ids`,
#   `context_lengths` and `sequence_length` per request, `host_request_types` saying which
#   requests are in their context (prefill) phase and which are generating, and the paged
#   cache's `kv_cache_block_offsets`.
# * **llama.cpp** keeps it per token: a `llama_batch` holds each token's id, `pos`, `seq_id`s
#   and a `logits` flag (our `logits_at`), and the context finds each token a KV cell
#   (`find_slot`) before the graph runs.
# * I found none of them running addressing checks like today's on every step; they rely on
#   tests and on asserts along the way. vLLM's input batch does keep a CPU copy of each
#   tensor next to the GPU one (`CpuGpuBuffer`), which is where such a check could read.

# %% [markdown]
# ## Try it
#
# 1. **Break the hand-built plan.** In `plan_by_hand`, pad short windows with the row's own
#    first block instead of block 0. Re-run section 2: the assert must fail at step 0, naming
#    `slot_window`, while `planbench.check_windows` still passes the engine's plan (padding is
#    outside every row's context). Which of the two is a rule of the engine and which is a rule
#    of the package's implementation?
# 2. **Sample from the wrong token.** Set `logits_at[0] = 3` in a copy of step 0's plan (use
#    `planted`) and run `planbench.check_spans`: it must refuse it with "row 0 samples token 3,
#    not its last, 5". Then run the model on it through `eng.cache.view(...)`: the forward
#    succeeds, and row 0's logits are those of its prompt's fourth token.
# 3. **Bigger static batches.** Run `python days/day25/planbench.py --max-batch 16 --out
#    /tmp/p.csv`. Check: the prefill steps stay 3, since a static batch takes only the requests
#    that have arrived when it forms (the second now holds 11, its `rows_max`), and
#    `checks_passed` is still twice `steps` on both rows. Why do more rows not help here?

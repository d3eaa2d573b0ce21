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
# # Day 23 — Ragged prefill
#
# Yesterday's static batch put its prompts in a rectangle: one row per prompt, every row as long
# as the longest, the short ones filled out with pad tokens that go through every matrix product
# like real ones. Prefill is the step where that hurts most, because a prompt is many tokens at
# once and the pads are many tokens too.
#
# The model does not need a rectangle. Since Day 7 it has taken its tokens flat, `(N,)` ids and
# `(N,)` positions, and asked the cache for attention; nothing in a linear layer, a norm or the
# MLP cares which token belongs to which prompt. Only attention does. So several prompts can sit
# end to end in one row of tokens, each token keeping the position it has in its own prompt,
# provided attention lets a token see only the earlier tokens of its own prompt. Over the
# packed row that rule is a block-diagonal causal mask: one lower triangle per prompt, nothing
# between them.
#
# 1. three prompts packed by hand: the ids, the positions, which prompt each token is from, and
#    the mask, printed,
# 2. one forward of SmolLM2 over the packed row against each prompt prefilled alone: every
#    position's logits and the greedy next token,
# 3. the package's way, `plan_prefill` and the paged cache, then the engine's prefill step:
#    the same numbers, without ever building the mask,
# 4. two wrong versions: a plain causal mask over the whole row, caught at once, and positions
#    that run on through the row, which prefill cannot see and the first decode step catches,
# 5. packed against one prompt at a time and against padding to the longest: tokens computed
#    and time (`days/day23/raggedbench.py`),
# 6. the diagram.

# %%
import sys

import matplotlib
import torch
import torch.nn.functional as F

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, engine_config, read_csv
from nanoserve.bench import cpu_line
from nanoserve.cache import BatchedPagedKVCache
from nanoserve.contiguous import NoCache
from nanoserve.engine import Engine
from nanoserve.models import load_model
from nanoserve.plan import plan_decode, plan_prefill
from nanoserve.sampling import SamplingParams
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day23"))
import raggedbench  # the day's script: the notebook builds its plans with it and reads its table

# One thread: on a machine shared with other jobs two threads that wait for each other at every
# op slow down far more than one.
torch.set_num_threads(1)
MODEL_DIR = fetch_default_model()
model, tok = load_model(MODEL_DIR), Tokenizer.from_dir(MODEL_DIR)
TOL = raggedbench.TOL
TEXTS = ["The capital of France is", "def add(a, b):", "Once upon a time, there was a little"]
prompts = [tok.encode(t) for t in TEXTS]
for t, p in zip(TEXTS, prompts):
    print(f"{len(p)} tokens  {t!r}: {p}")

# %% [markdown]
# ## 1. Packing, by hand
#
# The packed row is the three prompts' ids one after another. Each token keeps two more facts:
# its position inside its own prompt (which rotary embedding rotates by) and which prompt it
# came from (which the mask reads). Token i may attend to token j when both come from the same
# prompt and j's position is not after i's:

# %%
ids = torch.tensor([t for p in prompts for t in p])  # (N,)
positions = torch.cat([torch.arange(len(p)) for p in prompts])  # (N,) restarts at 0 per prompt
owner = torch.cat([torch.full((len(p),), i) for i, p in enumerate(prompts)])  # (N,)
mask = (owner[:, None] == owner[None, :]) & (positions[None, :] <= positions[:, None])  # (N, N)
N = len(ids)
print(f"N = {N} tokens")
print("positions:", positions.tolist())
print("prompt:   ", owner.tolist())
print("mask (row i: the keys token i sees; # yes, . no):")
print("     " + "".join(str(j % 10) for j in range(N)))
for i in range(N):
    print(f"{i:>3}  " + "".join("#" if m else "." for m in mask[i].tolist()))
print(f"allowed pairs: {mask.sum().item()} of {N * N}")
assert mask.sum().item() == sum(len(p) * (len(p) + 1) // 2 for p in prompts)

# %% [markdown]
# Three triangles on the diagonal, of 5, 7 and 9 tokens: 15 + 28 + 45 = 88 allowed pairs of the
# 441 in the square. Everything off the triangles is a pair of tokens from different prompts.
#
# ## 2. One forward over the packed row
#
# The model asks its cache object for two things per layer, `write(layer, k, v)` and
# `attention(layer, q)` (Day 11). A cache for today's experiment keeps the step's keys and
# values and runs SDPA over the whole packed row under a given mask; that is all it takes to
# prefill three prompts in one forward. The reference is each prompt alone through `NoCache`,
# the plain causal attention of Day 8.


# %%
class PackedRow:
    """Attention over one packed row of N tokens under an (N, N) boolean mask."""

    def __init__(self, mask):
        self.mask = mask

    def write(self, layer, k, v):
        self.k, self.v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, kv, N, hd)

    def attention(self, layer, q):
        qh = q.transpose(0, 1)[None]  # (1, nh, N, hd)
        out = F.scaled_dot_product_attention(qh, self.k, self.v, attn_mask=self.mask, enable_gqa=True)
        return out[0].transpose(0, 1)  # (N, nh, hd)


def alone(p):
    cache, pos = NoCache(), torch.arange(len(p))
    cache.begin(pos)
    return model(torch.tensor(p), pos, cache)  # (n, vocab): every position's logits


starts = [0] + torch.tensor([len(p) for p in prompts]).cumsum(0).tolist()
refs = [alone(p) for p in prompts]


def check_alone(packed_logits):
    """Each prompt's slice of the packed row's logits equals the prompt prefilled alone."""
    for i, ref in enumerate(refs):
        got = packed_logits[starts[i] : starts[i + 1]]
        diff = (got - ref).abs().max().item()
        if diff > TOL:
            raise AssertionError(f"prompt {i}'s logits differ from it alone by {diff:.2f} (tolerance {TOL})")
        if got[-1].argmax() != ref[-1].argmax():
            raise AssertionError(f"prompt {i}'s next token differs from the prompt alone")


packed = model(ids, positions, PackedRow(mask))  # (N, vocab)
check_alone(packed)
largest = max(r.abs().max().item() for r in refs)
print(f"logits of all {N} positions, packed against alone (fp32, largest |logit| {largest:.1f}):")
for i, ref in enumerate(refs):
    got = packed[starts[i] : starts[i + 1]]
    nxt = got[-1].argmax().item()
    print(f"  prompt {i}: max |difference| {(got - ref).abs().max().item():.1e}, "
          f"next token {nxt} {tok.decode([nxt])!r} both ways")  # fmt: skip
next_tokens = [r[-1].argmax().item() for r in refs]

# %% [markdown]
# Equal within the stated tolerance of 1e-3, on fp32 logits as large as 37.9; the measured
# differences are a few times 1e-5, the rounding of matrix products that see 21 rows instead of
# 5, 7 or 9. The greedy next tokens are the same: " Paris", a newline, " girl".
#
# ## 3. The package's way
#
# The engine never builds that N x N mask. `plan_prefill` (Day 25 looks at it field by field)
# packs the chunks of a step into the same flat `input_ids` and `positions`, and records for
# each row where its tokens sit in the packed row (`row_spans`: start, end, context length) and
# which K/V slots it owns (`slot_window`, from its block table). The paged cache then runs
# attention one row at a time: the row's queries against the row's own keys, under a causal
# triangle of the row's own size. Each triangle is computed on its own, the empty off-diagonal
# blocks never at all. `raggedbench.sequences` gives every prompt a block table (blocks of 16):

# %%
seqs, alloc = raggedbench.sequences(prompts)
plan = plan_prefill([(s, 0, len(s.token_ids)) for s in seqs], raggedbench.BLOCK_SIZE)
for name in ("input_ids", "positions", "write_slots", "context_lens", "logits_at"):
    print(f"{name:<13}", getattr(plan, name).tolist())
print("row_spans    ", plan.row_spans)
print("block tables ", [s.block_table.blocks for s in seqs], "| slot_window", tuple(plan.slot_window.shape))
assert torch.equal(plan.input_ids, ids) and torch.equal(plan.positions, positions)
assert [(a, b) for a, b, _ in plan.row_spans] == list(zip(starts, starts[1:]))
assert plan.logits_at.tolist() == [b - 1 for b in starts[1:]]

cache = BatchedPagedKVCache(model.cfg, alloc.num_blocks * raggedbench.BLOCK_SIZE, attention="gather")
paged = model(plan.input_ids, plan.positions, cache.view(plan), logits_at=plan.logits_at)  # (3, vocab)
diff = (paged - packed[plan.logits_at]).abs().max().item()
print(f"paged forward against the masked packed row, at the three last tokens: max |difference| {diff:.1e}")
assert diff <= TOL and paged.argmax(-1).tolist() == next_tokens

# %% [markdown]
# And through the engine as of today, `engine_config(23)`: the three prompts as requests, one
# token each (its `add_request` and `step` are the loop Day 34 builds its API on). Its static
# schedule of Day 22 admits all three at once and, with the default step budget of 512 tokens,
# prefills them in its first step; the cell catches the logits that step's runner returns. As
# of today the engine's linears are the model's own (`linear="plain"`) and it reads the pool by
# gathering (`attention="gather"`), as the cache above does.

# %%
per_block = model.cfg.kv_bytes_per_token(model.dtype) * 16
config = engine_config(23, max_model_len=256, kv_budget=64 * per_block)
eng = Engine(model, tok, config)
caught = []
execute = eng.runner.execute
eng.runner.execute = lambda plan: caught.append(execute(plan)) or caught[-1]
for p in prompts:
    eng.add_request(p, SamplingParams(max_tokens=1))
outs = eng.step()
print("prefill steps:", eng.step_kinds["prefill"], "| decode steps:", eng.step_kinds["decode"],
      "| has_unfinished:", eng.has_unfinished())  # fmt: skip
print("first tokens:", [o.new_token_ids for o in outs], [repr(o.text_delta) for o in outs])
diff = (caught[0] - paged).abs().max().item()
print(f"the engine's prefill logits against the paged forward above: max |difference| {diff:.1e}")
assert eng.step_kinds["prefill"] == 1 and sum(eng.step_kinds.values()) == 1 and not eng.has_unfinished()
assert [o.new_token_ids[0] for o in outs] == next_tokens and diff <= TOL

# %% [markdown]
# The engine's step computed the same logits as the plan built in the cell before, to the last
# bit: it is the same plan, run the same way.
#
# ## 4. The wrong mask
#
# The easy mistake is to pack the row and keep the mask a plain causal one, as if the row were
# one long prompt. The forward runs, the shapes are all right, and every prompt after the first
# now attends to the prompts before it. The check of section 2 catches it:

# %%
causal = torch.ones(N, N, dtype=torch.bool).tril()  # (N, N): every earlier token of the row
print(f"pairs the plain causal mask allows: {causal.sum().item()}, of which across prompts: "
      f"{(causal & ~mask).sum().item()}")  # fmt: skip
wrong = model(ids, positions, PackedRow(causal))
try:
    check_alone(wrong)
    raise RuntimeError("the plain causal mask passed the check")
except AssertionError as e:
    print("caught:", e)
for i, ref in enumerate(refs):
    got = wrong[starts[i] : starts[i + 1]]
    nxt = got[-1].argmax().item()
    worst = (got - ref).abs().max().item()
    print(f"  prompt {i}: max |difference| {worst:.2f}, next token {nxt} {tok.decode([nxt])!r}")
assert (wrong[: starts[1]] - refs[0]).abs().max().item() <= TOL  # the first prompt has nothing before it

# %% [markdown]
# Prompt 0 comes out exact: nothing comes before it in the row, so the wrong mask takes nothing
# from it. Prompt 1's logits moved by about 20 and its greedy token survived anyway, which is
# why a test that only compares generated text would pass a prompt like that one; prompt 2's
# token changed. The check compares logits at every position, against the prompt alone.
#
# The second mistake is subtler: keep the right mask, but number the packed row's positions 0
# to N - 1 straight through, as if it were one sequence. Rotary embeddings turn positions into
# angles, and a query's score against a key depends only on the difference of their angles, so
# a prompt whose positions are all shifted by the same amount scores exactly as before: the
# prefill check passes. What changed is the K/V left in the cache, rotated for positions 5 to 11
# and 12 to 20 instead of 0 to 6 and 0 to 8. The next decode step puts each prompt's new token
# at its true position (`plan_decode` takes it from the sequence's length), and against those
# keys the distances are wrong:

# %%
after = {}
for way in ("right", "run-on"):
    seqs_w, alloc_w = raggedbench.sequences(prompts)
    plan_w = plan_prefill([(s, 0, len(s.token_ids)) for s in seqs_w], raggedbench.BLOCK_SIZE)
    if way == "run-on":
        plan_w.positions = torch.arange(plan_w.num_tokens)  # (N,) 0..N-1 through every prompt
    cache_w = BatchedPagedKVCache(model.cfg, alloc_w.num_blocks * raggedbench.BLOCK_SIZE, attention="gather")
    first = model(plan_w.input_ids, plan_w.positions, cache_w.view(plan_w), logits_at=plan_w.logits_at)
    for s, t in zip(seqs_w, first.argmax(-1).tolist()):
        s.token_ids.append(t)  # each prompt's first token; its block has room (16 slots)
    step = plan_decode(seqs_w, raggedbench.BLOCK_SIZE)
    second = model(step.input_ids, step.positions, cache_w.view(step), logits_at=step.logits_at)
    after[way] = (first, second)
    print(f"{way:<7} prefill next tokens {first.argmax(-1).tolist()}, decode step at positions "
          f"{step.positions.tolist()}: next tokens {second.argmax(-1).tolist()}")  # fmt: skip
prefill_diff = (after["run-on"][0] - after["right"][0]).abs().max().item()
print(f"prefill logits, run-on against right: max |difference| {prefill_diff:.1e} (passes the check)")
decode_diff = (after["run-on"][1] - after["right"][1]).abs().amax(-1)
print("decode step logits, per prompt: max |difference|", [f"{d:.2f}" for d in decode_diff.tolist()])
try:
    if (decode_diff > TOL).any():
        bad = int((decode_diff > TOL).nonzero()[0])
        off = decode_diff[bad]
        raise AssertionError(f"prompt {bad}'s decode step is off by {off:.2f} after run-on positions")
    raise RuntimeError("run-on positions went unnoticed at the decode step too")
except AssertionError as e:
    print("caught:", e)
assert prefill_diff <= TOL and decode_diff[0] == 0

# %% [markdown]
# The prefill logits of the run-on row agree with the right ones within the tolerance, so no
# check on prefill alone could tell them apart; the first decode step's logits move by about 7
# and 14 for prompts 1 and 2, and both greedy tokens change. Prompt 0 started at position 0 either
# way and is untouched. Positions restart at 0 for each prompt because the cache outlives the
# step.
#
# ## 5. Packed, one at a time, padded
#
# Three ways to prefill the same prompts, all through the package's own forward
# (`raggedbench.prefill`): packed, one plan with every prompt; one at a time, a plan and a
# forward per prompt; padded, every prompt filled out to the longest with token 0 after its
# end, so the causal triangle keeps the pads out of every real token's attention while they are
# still computed in full. (Day 22 found right padding wrong for `generate`, where every row
# samples from the rectangle's last column; here `logits_at` takes each row's logits at its own
# last real token, which no pad can reach.) `raggedbench.counts` prices each way in tokens and
# attention scores (n queries over n keys are n * n scores per head and layer; SDPA computes
# the masked half too), and the three ways must give the same logits at each prompt's last
# token:

# %%
cells = ["real_tokens", "computed_tokens", "padding_pct", "forwards", "scores"]
timed, last_logits = {}, {}
for way in raggedbench.WAYS:
    last_logits[way], timed[way] = raggedbench.prefill(model, way, prompts)
    c = raggedbench.counts(way, prompts)
    print(f"{way:<14}" + "  ".join(f"{k} {c[k]}" for k in cells))
for got in last_logits.values():
    assert (got - paged).abs().max().item() <= TOL and got.argmax(-1).tolist() == next_tokens

# %%
# NBVAL_IGNORE_OUTPUT
print(cpu_line())
for way, seconds in timed.items():
    print(f"{way:<14} {1e3 * seconds:7.1f} ms  ({seconds / timed['packed']:.2f}x packed)")

# %% [markdown]
# On three prompts of 21 tokens the padded way computes 27 tokens, 6 of them pads, and one at a
# time computes the same 21 as packed in three forwards; the times are one run of each way, and
# small enough for per-forward overhead to matter. The script runs the comparison on SmolLM2 with
# eight prompts in three mixes of lengths (random token ids, every way twice in turn, fastest
# kept, one thread), and asserts the same logits and next tokens every way. Its table:

# %%
committed = read_csv(raggedbench.CSV_RAGGED)
print(" | ".join(committed[0]))
for r in committed:
    print(" | ".join(r.values()))
for name in raggedbench.WORKLOADS:  # the counts are arithmetic: they must reproduce here
    again = raggedbench.workload(name, 8, model.cfg.vocab_size)
    for r in (r for r in committed if r["workload"] == name):
        mine = {k: str(v) for k, v in raggedbench.counts(r["way"], again).items()}
        assert mine == {k: r[k] for k in cells + ["prompts"]}

# %% [markdown]
# Padding costs what the lengths say it costs. Eight prompts of similar lengths (96 to 128
# tokens) padded to the longest carry 7.8% pads, and the padded forward took 0.99 times the
# packed one: no cost this run can see. With lengths spread from 16 to 128, 32.2% of the padded
# tokens are pads and it took 1.54 times as long; with one prompt of 128 and seven of 16 to 32,
# 70.4% are pads, and it took 3.61 times as long. Attention grows faster than the tokens: that
# padded batch computes 1,024 tokens against packed's 303, and 131,072 scores against its 20,853
# per head and layer.
#
# One at a time computes exactly packed's tokens and scores. On the similar prompts it took 0.98
# times as long, level with packing, and 1.18 and 1.43 times on the two workloads with short
# prompts: every forward reads all of the weights once, and eight forwards of 16 to 32 tokens
# read them eight times for little work each. Of the three ways only packing both computes no
# pads and reads the weights once a step.
#
# The times are one run on a quiet machine; only the ratios, measured with the ways taking
# turns, are worth quoting. The token and score counts do not depend on the machine.
#
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 10))
edges = [s - 0.5 for s in starts]

ax = axes[0, 0]
ax.imshow(mask, cmap="Greens", vmin=0, vmax=1.4)
ax.set_title("The block-diagonal causal mask over the packed row (green: may attend)")
for ax_ in (axes[0, 0], axes[0, 1]):
    for e in edges[1:-1]:
        ax_.axhline(e, color="gray", lw=0.8)
        ax_.axvline(e, color="gray", lw=0.8)
    ax_.set_xticks(range(N), [str(p) for p in positions.tolist()], fontsize=7)
    ax_.set_yticks(range(N), [f"{o}:{p}" for o, p in zip(owner.tolist(), positions.tolist())], fontsize=7)
    ax_.set_xlabel("key: its position in its own prompt")
    ax_.set_ylabel("query: prompt:position")

ax = axes[0, 1]
leak = (causal & ~mask).float() * 2 + mask.float()  # 0 hidden, 1 allowed, 2 allowed by mistake
ax.imshow(leak, cmap=matplotlib.colors.ListedColormap(["white", "tab:green", "tab:red"]), vmin=0, vmax=2)
ax.set_title("Plain causal over the packed row: red pairs cross prompts")

ax = axes[1, 0]
names = list(raggedbench.WORKLOADS)
x = torch.arange(len(names)).float()
for j, way in enumerate(raggedbench.WAYS):
    rows = [next(r for r in committed if r["workload"] == n and r["way"] == way) for n in names]
    real = [int(r["real_tokens"]) for r in rows]
    pads = [int(r["computed_tokens"]) - int(r["real_tokens"]) for r in rows]
    color = ("tab:green", "tab:blue", "tab:orange")[j]
    ax.bar(x + (j - 1) * 0.27, real, 0.27, color=color, label=f"{way}: prompt tokens")
    ax.bar(x + (j - 1) * 0.27, pads, 0.27, bottom=real, color=color, alpha=0.35, hatch="//")
ax.set_xticks(x.tolist(), names)
ax.set_ylabel("tokens computed (hatched: pads)")
ax.set_title("SmolLM2, 8 prompts per workload: tokens each way computes")
ax.legend(fontsize=8, loc="upper left")

ax = axes[1, 1]
for j, way in enumerate(raggedbench.WAYS):
    rows = [next(r for r in committed if r["workload"] == n and r["way"] == way) for n in names]
    ms = [float(r["ms"]) for r in rows]
    ax.bar(x + (j - 1) * 0.27, ms, 0.27, color=("tab:green", "tab:blue", "tab:orange")[j], label=way)
    for xi, r in zip(x.tolist(), rows):
        ax.text(xi + (j - 1) * 0.27, float(r["ms"]), f"{r['x_packed']}x", ha="center", va="bottom", size=8)
ax.set_xticks(x.tolist(), names)
ax.set_ylabel("prefill time, ms (fastest of 2, 1 thread, shared machine)")
ax.set_title("SmolLM2: time of each way (label: against packed)")
ax.legend(fontsize=8)

fig.suptitle("Day 23: ragged prefill, several prompts in one row of tokens (fp32, CPU)", fontsize=14)
fig.tight_layout()
png = diagram_path("day23-ragged.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** flattens every step the same way. In V1 the model runner hands each attention
#   backend a `CommonAttentionMetadata` (`vllm/v1/attention/backends/utils.py`) whose
#   `query_start_loc`, shape (requests + 1,), is the cumulative count of each request's new
#   tokens in the flat batch (our `row_spans` starts and ends), with `seq_lens` the context each
#   request attends over. The FlashAttention backend (`vllm/v1/attention/backends/flash_attn.py`)
#   passes them as `cu_seqlens_q` to `flash_attn_varlen_func`, a kernel that walks each
#   sequence's own triangle and never forms a mask, which is the package's per-row loop done in
#   one launch. The older V0 xFormers backend said the same thing as a mask object,
#   `BlockDiagonalCausalMask.from_seqlens`, which xFormers likewise never materializes.
# * **SGLang** calls prefill "extend" (`ForwardMode.EXTEND` in
#   `python/sglang/srt/model_executor/forward_batch_info.py`): a `ForwardBatch` carries the
#   packed `input_ids` and `positions`, `extend_seq_lens` and `extend_start_loc` (each request's
#   new tokens and where they start) and `extend_prefix_lens` (what is already cached), and its
#   FlashInfer backend turns them into the `qo_indptr` of a batched prefill wrapper.
# * **TensorRT-LLM** names the choice outright: `remove_input_padding`, a plugin setting, picks
#   the packed mode of its GPT attention operator over the padded one; its documentation says
#   the packed mode is always the more efficient of the two and that the padded mode may go away.
# * **llama.cpp** packs by token, not by prompt: a `llama_batch` lists, for every token, its id,
#   its `pos` and the `seq_id` it belongs to, and the attention mask built for the batch lets a
#   token see only cells of its own sequence at earlier positions. The server puts every slot's
#   prompt tokens into one such batch.
# * **transformers**' `generate` pads: a batch of prompts is a rectangle with an
#   `attention_mask` (left padding for decoder-only models), the static batching of Day 22. For
#   training, its `DataCollatorWithFlattening` packs examples end to end with per-example
#   `position_ids`, and FlashAttention 2 reads the boundaries from them, today's idea again.

# %% [markdown]
# ## Try it
#
# 1. **Shift a prompt on purpose.** Run section 2's packed forward with the same mask and
#    `positions[starts[1] : starts[2]] += 100` (a copy of `positions`): `check_alone` must still
#    pass, for the reason section 4 gives. Then add 1 to the position of prompt 1's last token
#    only: the check must now catch prompt 1, since one distance changed.
# 2. **Pad on the left.** Build the padded batch with the pads before each prompt, as
#    transformers does for generation, and keep the causal triangle: the check must fail for
#    every padded prompt, because its real tokens now see the pads. Then add the pads' keys to
#    the mask's hidden set and make it pass (the positions must start at 0 at the first real
#    token).
# 3. **Count before you time.** For four prompts of 10, 20, 30 and 200 tokens, work out
#    `raggedbench.counts("padded", ...)`'s `padding_pct` and `scores` by hand
#    (`100 * (800 - 260) / 800` and `4 * 200 * 200`), then check them with the function.

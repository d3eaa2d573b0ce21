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
# # Day 8 — Greedy generation without a cache
#
# Day 7 ended with a forward that agrees with transformers'. Today the model answers a question.
# The plainest way to generate: run the model over the whole sequence, take the most likely next
# token (greedy), append it, and run the model over the whole sequence again. Nothing is kept
# between steps, so step i re-computes the keys and values of every earlier token. This notebook
# builds that loop, checks its tokens against the package's cached reference path, and measures
# what the re-computation costs.
#
# 1. a chat prompt through the chat template,
# 2. the loop in a few lines, and the model's first answer,
# 3. the same tokens as `nanoserve.generate.greedy_tokens` (the cached path), with a near-tie
#    rule for when they could fairly differ, and a wrong loop the check refuses,
# 4. how much work the loop repeats, counted,
# 5. how long a step takes as the sequence grows, measured and fitted (`days/day08/nocache.py`),
# 6. the day's tables and diagram.

# %%
import csv
import sys
import time

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path
from nanoserve.contiguous import NoCache
from nanoserve.generate import greedy_tokens
from nanoserve.models import load_model
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day08"))
import nocache  # the day's script: the notebook calls the functions that write its CSVs

# One thread here: on a 2-core machine that is also running other work, a second thread spends
# much of its time waiting for the first, and this notebook runs many short forwards. The
# script's CSVs were measured with torch's default, 2 threads, as their cpu column says.
torch.set_num_threads(1)
MODEL_DIR = fetch_default_model()
tok = Tokenizer.from_dir(MODEL_DIR)
t0 = time.perf_counter()
model = load_model(MODEL_DIR)  # fp32
print(f"loaded in {time.perf_counter() - t0:.1f} s | threads: {torch.get_num_threads()}")

# %% [markdown]
# ## 1. The prompt
#
# SmolLM2-Instruct was tuned on ChatML: each turn opens with `<|im_start|>` and a role and
# closes with `<|im_end|>`. Day 1's template writes a default system turn when there is none,
# and ends with an open assistant turn, so the model's next token is the start of its answer.

# %%
messages = [{"role": "user", "content": "What is the capital of France?"}]
print(tok.apply_chat_template(messages))
prompt = tok.encode_chat(messages)
print("prompt tokens:", len(prompt), "| end-of-sequence ids:", sorted(tok.eos_ids))
assert len(prompt) == 37

# %% [markdown]
# ## 2. The loop
#
# Every step is a fresh forward over `seq`, the prompt plus whatever was generated so far.
# `NoCache` is the package's cache object that keeps nothing: attention sees exactly the keys
# and values of the current call. `logits_at` asks the model for the last position's logits
# only, (1, 49152); argmax picks the token.

# %%
seq = list(prompt)
answer, step_lengths = [], []
for _ in range(32):
    cache = NoCache()
    positions = torch.arange(len(seq))  # (L,): 0 .. L-1, every step
    cache.begin(positions)
    logits = model(torch.tensor(seq), positions, cache, logits_at=torch.tensor([len(seq) - 1]))  # (1, V)
    token = int(logits[0].argmax())
    step_lengths.append(len(seq))
    answer.append(token)
    seq.append(token)
    if token in tok.eos_ids:
        break
print(
    "logits:",
    tuple(logits.shape),
    "| new tokens:",
    len(answer),
    "| last is end of turn:",
    answer[-1] in tok.eos_ids,
)
print("ids:", answer)
print("answer:", repr(tok.decode(answer)))
assert answer[-1] in tok.eos_ids

# %% [markdown]
# ## 3. The same tokens as the cached path
#
# `greedy_tokens` is different code: one prefill over the prompt, then one token a step against
# a contiguous K/V cache (Day 11 takes it apart). The two must give the same ids. (The script's
# `nocache.greedy_no_cache` is the loop above with a timer around each step; section 6 checks it
# writes the same answer.)
#
# Could they fairly differ? A no-cache step computes the last position as one row of an (L, 576)
# prefill; a cached step computes it as a lone (1, 576) row. Matrix kernels may round those
# differently (Day 6 saw one-row products move by about 1e-6), and if the top two logits of some
# step were within that of each other, the argmax could flip and the texts would part for good.
# So the rule, the same as the engine's tests: equal ids, or a first difference at a step whose
# top-1 and top-2 logits are within 1e-4 (`nocache.compare`). Anything else is a bug.

# %%
cached = greedy_tokens(model, prompt, 32, eos_ids=tok.eos_ids)
print("no cache vs greedy_tokens:", nocache.compare(model, prompt, cached, answer))
# every step's logits at once: one forward over prompt + answer, rows p-1 .. p+n-2
full = prompt + answer[:-1]
cache = NoCache()
cache.begin(torch.arange(len(full)))
rows_at = torch.arange(len(prompt) - 1, len(full))
step_logits = model(torch.tensor(full), torch.arange(len(full)), cache, logits_at=rows_at)  # (n, V)
top2 = step_logits.topk(2, dim=-1).values  # (n, 2)
gaps = (top2[:, 0] - top2[:, 1]).tolist()
print("argmax of every step's logits is the answer:", step_logits.argmax(-1).tolist() == answer)
print(f"smallest top-1/top-2 gap along the answer: {min(gaps):.3f} (near-tie threshold {nocache.TIE:g})")
assert answer == cached and min(gaps) > 100 * nocache.TIE

# %% [markdown]
# Now a loop built wrong: it keeps no cache, like ours, but runs only the newest token each step
# (at its right position), as if the model could remember the rest by itself. Its first token is
# right (the first step is the full prompt), and after that each step sees one token of context.
# `compare` refuses it: the first difference is not a near-tie.


# %%
def greedy_forgetful(model, prompt, max_tokens, eos_ids):
    """WRONG on purpose: after the prompt, each step runs the newest token alone."""
    out, ids, positions = [], torch.tensor(prompt), torch.arange(len(prompt))
    for _ in range(max_tokens):
        cache = NoCache()
        cache.begin(positions)
        token = int(model(ids, positions, cache, logits_at=torch.tensor([len(ids) - 1]))[0].argmax())
        out.append(token)
        if token in eos_ids:
            break
        ids, positions = torch.tensor([token]), torch.tensor([positions[-1].item() + 1])
    return out


forgetful = greedy_forgetful(model, prompt, len(answer), tok.eos_ids)
print("forgetful:", repr(tok.decode(forgetful, skip_special_tokens=False)))
try:
    nocache.compare(model, prompt, cached, forgetful)
    caught = False
except AssertionError as e:
    caught = True
    print("caught:", str(e).split(":")[0])
assert caught and forgetful[0] == cached[0]

# %% [markdown]
# ## 4. The work it repeats
#
# Step i runs L = p + i tokens (p the prompt's length), so n new tokens cost
# n p + n (n - 1) / 2 token-forwards: linear in the prompt, quadratic in the answer. With a cache
# the prompt runs once and every later step runs one token: p + n - 1.

# %%
p, n = len(prompt), len(answer)
print("tokens per step, no cache:", step_lengths)
print(f"this answer: {sum(step_lengths)} token-forwards without a cache, {p + n - 1} with one")
for n_new in (8, 64, 256, 1024):
    without, with_cache = n_new * p + n_new * (n_new - 1) // 2, p + n_new - 1
    print(f"  {n_new:>5} new tokens: {without:>8,} vs {with_cache:>5,} ({without / with_cache:.0f}x)")
assert sum(step_lengths) == n * p + n * (n - 1) // 2

# %% [markdown]
# ## 5. Time per step
#
# `nocache.step_rows` times one step at a given sequence length L two ways: without a cache (a
# forward over L tokens) and with one (a single token attending over L cached positions). It
# also prices each in FLOPs: the matmuls cost 2 FLOPs per weight per token run, causal attention
# 2 x 2 x 9 x 64 per layer per query-key pair, and the LM head one row. A third timing is the
# no-cache step's attention alone (30 layers of `causal_attention` on random Q, K, V of that
# length): the only part whose work grows with L squared. Here at two short
# lengths, one timed call each (after a warm-up) on this notebook's one thread, so the timings
# are rough; the script's default is lengths 32 to 512, fastest of three, and its CSV is read
# below.

# %%
quick = nocache.step_rows(model, lengths=(16, 48), repeats=1)
for r in quick:
    print(
        f"L={r['length']:>3}: no cache {r['gflop_nocache']} GFLOP in {r['nocache_ms']} ms,",
        f"cached {r['gflop_cached']} GFLOP in {r['cached_ms']} ms, attention alone {r['attention_ms']} ms",
    )

# %% [markdown]
# The full run, `day-08-steps.csv`, as committed. The deterministic columns (tokens run, GFLOP)
# are recomputed here and must equal it. The fit is least squares of
# t(L) = a + b L + c L^2 over the no-cache steps (`nocache.fit_quadratic`); the attention-alone
# times get a fit of their own.

# %%
with open(nocache.HERE / "day-08-steps.csv") as f:
    steps = list(csv.DictReader(f))
shown = [c for c in steps[0] if c != "cpu"]  # the cpu column is the same on every row: printed once
print(" | ".join(shown))
for r in steps:
    print(" | ".join(r[c] for c in shown))
print("measured on", steps[0]["cpu"])
for r in steps:
    L = int(r["length"])
    assert r["gflop_nocache"] == f"{nocache.step_flops(model, L, cached=False) / 1e9:.2f}"
    assert r["gflop_cached"] == f"{nocache.step_flops(model, L, cached=True) / 1e9:.3f}"
lengths = np.array([int(r["length"]) for r in steps])
t_nocache = np.array([float(r["nocache_ms"]) for r in steps]) / 1e3  # seconds
t_cached = np.array([float(r["cached_ms"]) for r in steps]) / 1e3
t_attn = np.array([float(r["attention_ms"]) for r in steps]) / 1e3
a, b, c = nocache.fit_quadratic(lengths, t_nocache)
aa, ba, ca = nocache.fit_quadratic(lengths, t_attn)


def poly(a, b, c, digits=1, x=" x "):
    """a + b L + c L^2 (seconds) as text in ms, us and ns, each term with its own sign."""
    terms = (f"{abs(1e6 * b):.{digits}f} us{x}L", f"{abs(1e9 * c):.{digits}f} ns{x}L^2")
    return f"{1e3 * a:.1f} ms" + "".join(f" {'-' if v < 0 else '+'} {t}" for v, t in zip((b, c), terms))


print(f"fit, whole step:     t(L) = {poly(a, b, c)}")
print(f"fit, attention only: t(L) = {poly(aa, ba, ca)}")
print(
    f"no cache, L={lengths[0]} -> {lengths[-1]}: {1e3 * t_nocache[0]:.0f} ms -> {1e3 * t_nocache[-1]:.0f} ms"
)
print(f"cached step over the same range: {1e3 * t_cached.min():.0f} ms to {1e3 * t_cached.max():.0f} ms")
print(f"attention alone at L={lengths[-1]}: {1e3 * t_attn[-1]:.0f} ms of {1e3 * t_nocache[-1]:.0f} ms")
L_max = lengths.max()
fitted = lambda L: a + b * L + c * L**2  # noqa: E731
print(f"the whole-step fit at L={L_max}: {1e3 * fitted(L_max):.0f} ms, of which the L^2 term", end=" ")
print(f"{1e3 * c * L_max**2:.0f} ms and the linear term {1e3 * b * L_max:.0f} ms")
gf = np.array([float(r["gflop_nocache"]) for r in steps])
parts = nocache.step_flop_parts(model, int(L_max), cached=False)
attn_share = parts["attention"] / sum(parts.values())
print(f"attention's share of a no-cache step's FLOPs at L={L_max}: {100 * attn_share:.1f}%,", end=" ")
print(f"of its time: {100 * t_attn[-1] / t_nocache[-1]:.1f}%")
rate_nc = gf / t_nocache
rate_c = np.array([float(r["gflop_cached"]) for r in steps]) / t_cached
print(f"GFLOP/s achieved: no cache {rate_nc.min():.0f} to {rate_nc.max():.0f},", end=" ")
print(f"cached {rate_c.min():.1f} to {rate_c.max():.1f}")
b_c, a_c = np.polyfit(lengths, t_cached, 1)  # the cached step, as a line
for n_new in (64, 256):
    steps_at = len(prompt) + np.arange(n_new)  # the sequence length at each step
    total_nc = fitted(steps_at).sum()
    total_c = fitted(len(prompt)) + (a_c + b_c * steps_at[1:]).sum()  # one prefill, then decode
    print(f"{n_new} new tokens after this {len(prompt)}-token prompt, from the fits:", end=" ")
    print(f"no cache {total_nc:.0f} s, cached {total_c:.0f} s")

# %% [markdown]
# Read with the noise in mind (each time is the fastest of three calls). A no-cache step grows
# mostly linearly over this range, because most of its work is the weight matmuls, which are
# linear in L; the fit's squared term is 155 ms of the 701 ms it gives at 512 tokens, against
# 513 ms for the linear term. Attention alone is the part that bends upwards, and on this CPU
# (the `measured on` line) it is slower per FLOP than the matmuls: a larger share of the step's
# time than of its FLOPs. The cached step
# barely moves with L: it runs one token, and it is limited by reading the weights, not by
# arithmetic, which is why it achieves a small fraction of the no-cache step's FLOP rate. So the
# quadratic cost of generating without a cache comes less from attention than from adding up
# steps that each grow linearly: the sum of 1 .. n is quadratic (the diagram's top right).

# %% [markdown]
# ## 6. Five prompts
#
# `day-08-greedy.csv` runs Day 7's five chat prompts for up to 24 tokens both ways, through
# `nocache.greedy_rows`. The first row is recomputed here: its text must be the answer of the
# loop in section 2, and its deterministic columns must equal the committed ones. The other four
# are read back.

# %%
row = nocache.greedy_rows(model, tok, prompts=nocache.PROMPTS[:1])[0]
with open(nocache.HERE / "day-08-greedy.csv") as f:
    greedy_table = list(csv.DictReader(f))
RUN = {"nocache_s", "cached_s", "cpu"}  # this run's own: its two times and the CPU that took them
shown = [c for c in greedy_table[0] if c != "cpu"]
print(" | ".join(shown))
for r in greedy_table:
    print(" | ".join(r[c] for c in shown))
print("measured on", greedy_table[0]["cpu"])
assert row["text"] == tok.decode(answer)
assert {k: str(v) for k, v in row.items() if k not in RUN} == {
    k: v for k, v in greedy_table[0].items() if k not in RUN
}
assert all(r["vs_cached"] == "identical" for r in greedy_table)
ratio = sum(int(r["tokens_run_nocache"]) for r in greedy_table) / sum(
    int(r["tokens_run_cached"]) for r in greedy_table
)
print(f"all five identical; token-forwards without a cache / with one: {ratio:.1f}x")

# %% [markdown]
# ## 7. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
grid = np.linspace(0, L_max, 200)

ax = axes[0, 0]
ax.plot(lengths, 1e3 * t_nocache, "o", color="tab:red", label="no cache, measured (day-08-steps.csv)")
ax.plot(grid, 1e3 * (a + b * grid + c * grid**2), "-", color="tab:red", alpha=0.6,
        label=f"fit {poly(a, b, c, digits=2, x=' ')}")  # fmt: skip
ax.plot(lengths, 1e3 * t_attn, "d", color="tab:purple", label="no cache, attention alone, measured")
ax.plot(grid, 1e3 * (aa + ba * grid + ca * grid**2), "-", color="tab:purple", alpha=0.6,
        label=f"fit {poly(aa, ba, ca, digits=2, x=' ')}")  # fmt: skip
ax.plot(lengths, 1e3 * t_cached, "s-", color="tab:green", label="cached: one token over L positions")
ax.set_xlabel("sequence length L")
ax.set_ylabel("one step (ms)")
ax.set_title("Time of one greedy step as the sequence grows")
ax.legend(fontsize=8)

ax = axes[0, 1]
n_new = np.arange(1, L_max - p + 1)
cum_nocache = np.cumsum(fitted(p + n_new - 1))
cum_cached = np.concatenate([[fitted(p)], fitted(p) + np.cumsum(a_c + b_c * (p + n_new[1:] - 1))])
ax.plot(n_new, cum_nocache, color="tab:red", label="no cache: sum of fitted steps")
ax.plot(n_new, cum_cached, color="tab:green", label="cached: one prefill, then decode steps")
ax.set_xlabel(f"new tokens generated after a {p}-token prompt")
ax.set_ylabel("total time (s), from the fits")
ax.set_title("Time to generate n tokens: quadratic without a cache")
ax.legend(fontsize=8)

ax = axes[1, 0]
ax.plot(lengths, rate_nc, "o-", color="tab:red", label="no cache (L tokens a step)")
ax.plot(lengths, rate_c, "s-", color="tab:green", label="cached (1 token a step)")
ax.set_xlabel("sequence length L")
ax.set_ylabel("GFLOP/s achieved")
ax.set_title("Same model, different regime: FLOPs per second of a step")
ax.legend(fontsize=8)

ax = axes[1, 1]
steps_x = range(len(answer))
pieces = [tok.decode([t], skip_special_tokens=False) for t in answer]
ax.bar(steps_x, step_lengths, color="tab:red", alpha=0.7, label="tokens run, no cache")
ax.bar(steps_x, [p] + [1] * (len(answer) - 1), color="tab:green", alpha=0.9, label="tokens run, cached")
for i, piece in enumerate(pieces):
    ax.text(i, step_lengths[i] + 0.5, repr(piece), ha="center", va="bottom", fontsize=8, rotation=60)
ax.set_xticks(list(steps_x))
ax.set_xlabel("greedy step")
ax.set_ylabel("tokens through the model")
ax.set_ylim(0, max(step_lengths) * 1.35)
ax.set_title("The first answer, token by token: what each step runs")
ax.legend(fontsize=8, loc="upper left")

fig.suptitle("Day 8: greedy generation without a cache (SmolLM2-135M, fp32, CPU)", fontsize=14)
fig.tight_layout()
png = diagram_path("day08-nocache.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **transformers** has the same loop behind a flag: `model.generate(..., use_cache=False)`.
#   In `GenerationMixin._sample` (`generation/utils.py`), each step asks
#   `prepare_inputs_for_generation` for `next_sequence_length = 1 if model_kwargs["use_cache"]
#   else None`: with the cache off, the whole sequence goes back into the model every step.
#   Greedy is `do_sample=False`, which takes `torch.argmax(next_token_scores, dim=-1)`.
# * **llama.cpp** builds its Llama graph (`src/models/llama.cpp`) in two variants:
#   `llm_graph_input_attn_kv` for generation and `llm_graph_input_attn_no_cache` (chosen by
#   `build_attn_inp_no_cache()`) when the model is built for embeddings, where one pass over the
#   input is all there is. Generation always goes through the KV cache. Its greedy choice is a
#   sampler of its own, `llama_sampler_init_greedy` (`src/llama-sampler.cpp`), a scan for the
#   largest logit.
# * **vLLM** has no cacheless mode at all: the paged KV cache is allocated at startup and every
#   request runs through it. Greedy is a request whose temperature is below `_SAMPLING_EPS`
#   (1e-5, `vllm/v1/sample/sampler.py`); Day 9 looks at that line.
# * **nano-vllm** always caches too, and refuses greedy outright: its `SamplingParams`
#   (`nanovllm/sampling_params.py`) asserts `temperature > 1e-10` with the message
#   "greedy sampling is not permitted".
#
# ## Try it
#
# 1. **Break the loop on purpose.** In section 2's loop, replace `positions = torch.arange(len(seq))`
#    with `positions = torch.zeros(len(seq), dtype=torch.long)` (every token at position 0:
#    RoPE then tells the model nothing about order). Run `nocache.compare(model, prompt, cached,
#    answer)`: it must raise `AssertionError`, here already at step 0, because the very first
#    token changes.
# 2. **Reproduce the tables.** `python days/day08/nocache.py --out-dir /tmp/d8`, then compare
#    `/tmp/d8/day-08-greedy.csv` with the committed one: every column but `nocache_s` and
#    `cached_s` must be equal (all five `identical`, and 16.9 times as many token-forwards
#    without a cache as with one). In `/tmp/d8/day-08-steps.csv` the GFLOP columns must equal the
#    committed ones; the times are your machine's.
# 3. **Where attention takes over.** From the two fits of section 5, compute the length at which
#    the attention-alone quadratic term equals the whole step's linear term, `b / ca` (1001.5 us
#    over 505.0 ns in the committed run). Then, with `nocache.step_flop_parts`, find the length at
#    which a no-cache step's attention FLOPs equal its matmul FLOPs (`assert` it is 2 x 3,072 - 1:
#    causal attention's queries see (L + 1)/2 keys on average, so this is one less than twice
#    Day 6's 3,072). The ratio of
#    the two lengths is how much slower per FLOP attention ran than the matmuls on your machine.

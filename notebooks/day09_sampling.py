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
# # Day 9 — Sampling: temperature, top-k, top-p, seeds
#
# Day 8 always took the most likely token. That makes one answer per prompt, forever, and the
# most likely path is often a dull or repetitive one. Sampling draws the next token from the
# model's distribution instead, reshaped by three knobs: temperature (sharpen or flatten), top-k
# (keep the k most likely), top-p (keep the smallest set holding probability p). A request asks
# for them through `nanoserve.sampling.SamplingParams`; `sample` and `sample_rows` turn a batch
# of logits into one token per row, each row under its own parameters and its own random
# generator.
#
# 1. one real next-token distribution,
# 2. temperature, top-k and top-p by hand, each asserted equal to `filter_logits`,
# 3. `SamplingParams` and the sampler on that distribution (`days/day09/sampling.py`),
# 4. seeds: per request, unaffected by what else shares the batch,
# 5. the edges: temperature 0 and nearly 0, a top-p that keeps one token, a row of non-finite
#    logits, values `validate` refuses,
# 6. the day's tables and diagram.

# %%
import csv
import math
import sys
import time

import matplotlib
import torch

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path
from nanoserve.models import load_model
from nanoserve.sampling import SAMPLING_EPS, SamplingParams, filter_logits, sample, sample_rows
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model

sys.path.insert(0, str(REPO / "days" / "day09"))
import sampling  # the day's script: the notebook calls the functions that write its CSVs

# Sampling is many small operations on one row of 49,152 numbers. Split over two threads, each
# of them costs more in synchronization than it saves (on a busy 2-core machine, many times
# more), and the one forward this notebook needs is short: one thread it is.
torch.set_num_threads(1)
MODEL_DIR = fetch_default_model()
tok = Tokenizer.from_dir(MODEL_DIR)
t0 = time.perf_counter()
model = load_model(MODEL_DIR)
print(f"loaded in {time.perf_counter() - t0:.1f} s")

# %% [markdown]
# ## 1. One next-token distribution
#
# A question with many fair answers makes the knobs visible. The reply's own first token is
# dull ("One", "The"), so the prompt includes the start of the reply, written for the model
# (`sampling.PREFIX`): the next token is the animal. One forward, no cache, gives its logits.

# %%
ids = sampling.prompt_ids(tok)
logits = sampling.next_logits(model, ids)  # (V,) fp32
probs = logits.softmax(-1)
top = probs.topk(10)
print(f"user: {sampling.PROMPT!r} | reply so far: {sampling.PREFIX!r}")
print(f"{len(ids)} tokens | logits {tuple(logits.shape)}")
for p_, i in zip(top.values.tolist(), top.indices.tolist()):
    print(f"  {p_:.3f}  {i:>6}  {tok.decode([i])!r}")
print(
    f"top 10 hold {top.values.sum().item():.3f} of the mass; entropy {sampling.entropy_bits(probs):.2f} bits"
)

# %% [markdown]
# ## 2. The three knobs by hand
#
# **Temperature** divides the logits before the softmax. Below 1 it widens the gaps between
# them (the top token gains), above 1 it shrinks them (the tail gains). It never changes the
# order, so the argmax is the same at every temperature.

# %%
for t in (0.5, 1.0, 1.5):
    mine = (logits / t).softmax(-1)
    theirs = sampling.distribution(logits, SamplingParams(temperature=t))
    assert torch.allclose(mine, theirs, atol=1e-7) and mine.argmax() == logits.argmax()
    print(f"t={t}: p(top) {mine.max().item():.3f}, entropy {sampling.entropy_bits(mine):.2f} bits")

# %% [markdown]
# **Top-k** keeps the k largest logits and sets the rest to -inf, so after the softmax they
# have probability exactly 0 and the k survivors share the whole mass.

# %%
for k in (5, 50):
    kth = logits.topk(k).values[-1]
    mine = logits.masked_fill(logits < kth, float("-inf"))
    assert torch.equal(mine, filter_logits(logits, k, 1.0))
    left = int(torch.isfinite(mine).sum())
    print(f"top_k={k}: {left} tokens left, p(top) now {mine.softmax(-1).max().item():.3f}")

# %% [markdown]
# **Top-p** (nucleus) sorts the tokens by probability and keeps the shortest prefix whose mass
# reaches p. The package's rule, token by token down the sorted list: drop a token when the mass
# of the tokens before it already reaches p. So the most likely token always stays, and the last
# token kept is the one that carries the total past p.

# %%
for top_p in (0.5, 0.9):
    sorted_p, order = probs.sort(descending=True)
    before = sorted_p.cumsum(0) - sorted_p  # mass strictly in front of each token
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(0, order, keep_sorted)  # back to vocabulary order
    mine = logits.masked_fill(~keep, float("-inf"))
    assert torch.equal(torch.isfinite(mine), torch.isfinite(filter_logits(logits, 0, top_p)))
    n_keep = int(keep.sum())
    print(f"top_p={top_p}: keeps {n_keep} tokens holding {sorted_p[:n_keep].sum().item():.3f}")

# %% [markdown]
# The order is part of the definition. `sample` applies temperature first, then top-k, then top-p
# (the nucleus is measured on the tempered distribution), as vLLM and transformers do. The same
# top_p keeps fewer tokens at a lower temperature:

# %%
for t in (0.5, 1.0, 1.5):
    kept = int(torch.isfinite(filter_logits(logits / t, 0, 0.9)).sum())
    print(f"t={t} then top_p=0.9: {kept} tokens kept")

# %% [markdown]
# ## 3. The sampler on this distribution
#
# `sampling.settings_rows` runs a list of settings through the package: for each, the
# distribution `sample` draws from (`sampling.distribution`, asserted above), and then draws
# through `sample` itself with seed 1. The script draws 1,000 times a setting; here 20, so the
# draw columns differ from the CSV's (which is printed after) while the columns that describe
# the distribution must not.

# %%
rows = sampling.settings_rows(tok, logits, draws=20)
with open(sampling.HERE / "day-09-settings.csv") as f:
    table = list(csv.DictReader(f))
DIST_COLS = ["setting", "temperature", "top_k", "top_p", "kept", "p_top1", "entropy_bits"]
print(" | ".join(rows[0]))
for r in rows:
    print(" | ".join(str(v) for v in r.values()))
assert [{c: str(r[c]) for c in DIST_COLS} for r in rows] == [{c: r[c] for c in DIST_COLS} for r in table]
print("\nday-09-settings.csv (1,000 draws a setting):")
for r in table:
    print(" | ".join(r.values()))

# %% [markdown]
# ## 4. Seeds
#
# A request with a seed gets its own `torch.Generator` (`SamplingParams.make_generator`), and
# its row draws only from it. So what else runs in the same batch cannot change its tokens: not
# another seeded request, not a request without a seed (which gets a generator seeded from the
# OS), not a greedy request. Below, requests A and B (seeds 7 and 8) draw 20 tokens each, first
# alone, then together in one batch, then in a batch of four with an unseeded row and a greedy
# row, and with the global RNG reseeded in between.

# %%
pa = SamplingParams(temperature=1.0, seed=7)
pb = SamplingParams(temperature=0.8, top_p=0.9, seed=8)
others = [SamplingParams(temperature=1.2), SamplingParams(temperature=0.0)]
rows_of = lambda n: logits[None].expand(n, -1)  # (n, V): the same logits on every row  # noqa: E731
STEPS = 20


def draw(params_list, steps=STEPS):
    gens = [p.make_generator() for p in params_list]
    out = [[] for _ in params_list]
    for _ in range(steps):
        for row, t in zip(out, sample(rows_of(len(params_list)), params_list, gens).tolist()):
            row.append(t)
    return out


alone_a, alone_b = draw([pa])[0], draw([pb])[0]
together = draw([pa, pb])
torch.manual_seed(12345)  # the global RNG: the seeded rows must not notice
crowd = draw([others[0], pa, others[1], pb])
print("A alone:", alone_a[:12], "...")
print("A with B:", together[0] == alone_a, "| B with A:", together[1] == alone_b)
print(
    "A and B in a batch of 4 (with an unseeded and a greedy row):",
    crowd[1] == alone_a and crowd[3] == alone_b,
)
print("the greedy row is the argmax every time:", set(crowd[2]) == {int(logits.argmax())})
print(f"distinct tokens A drew in {STEPS}:", len(set(alone_a)))
assert together == [alone_a, alone_b] and crowd[1] == alone_a and crowd[3] == alone_b

# %% [markdown]
# The same holds for a whole generation: `decode_loop` makes one generator per sequence from the
# params, so the same prompt, params and seed give the same text, and another seed another one.
# `sampling.text_rows` writes `day-09-texts.csv`; the notebook recomputes two of its rows (the
# repeated seed) and reads the others back.

# %%
with open(sampling.HERE / "day-09-texts.csv") as f:
    texts = list(csv.DictReader(f))
again = sampling.text_rows(model, tok, ids, text_settings=sampling.TEXT_SETTINGS[1:3])
for r in texts:
    print(f"t={r['temperature']} top_p={r['top_p']} seed={r['seed']}: {r['text']!r}")
assert [{k: str(v) for k, v in r.items()} for r in again] == texts[1:3]
assert texts[1]["text"] == texts[2]["text"] != texts[3]["text"]

# %% [markdown]
# ## 5. The edges
#
# **Temperature 0** is greedy by definition: `SamplingParams.greedy`, no division, no draw; the
# row takes the batched argmax. **Temperature near 0** is the trap. Mathematically, softmax(l / t)
# tends to the one-hot argmax as t shrinks. In fp32, l / t overflows once t is small enough, and
# then the softmax of a row holding +inf is NaN (inf - inf), which `multinomial` refuses for the
# whole call:

# %%
t_tiny = 1e-39
scaled = logits / t_tiny
print(
    "logits / 1e-39: +inf entries",
    int((scaled == float("inf")).sum()),
    "| -inf entries",
    int((scaled == float("-inf")).sum()),
)
nan_probs = scaled.softmax(-1)
print("softmax of that: NaN entries", int(nan_probs.isnan().sum()), "of", nan_probs.numel())
try:
    torch.multinomial(nan_probs, 1)
    print("multinomial drew a token (should not)")
except RuntimeError as e:
    print("caught:", str(e).split("\n")[0])
t_over = sampling.overflow_temperature(logits)
print(f"the division overflows for t below max|logit| / fp32 max = {t_over:.1e}")
assert nan_probs.isnan().all() and 1e-39 < t_over < 1e-36

# %% [markdown]
# So the package draws a line well above the overflow: a temperature below `SAMPLING_EPS`
# (1e-5, the same value vLLM uses) is greedy. Nothing is lost by it. At t = 1e-5 the draw is
# already the argmax unless the top two logits are closer than about 1e-3 (then
# exp(-gap / t) is still above fp32's smallest normal number); here the gap is far larger.

# %%
gap = (logits.topk(2).values[0] - logits.topk(2).values[1]).item()
print(f"SAMPLING_EPS = {SAMPLING_EPS:g} | top-1/top-2 gap here {gap:.2f}")
for t in (0.0, 1e-39, 1e-6):
    p = SamplingParams(temperature=t, seed=3)
    tok_id = int(sample(logits[None], [p], [p.make_generator()])[0])
    print(f"t={t:g}: greedy={p.greedy}, sampled {tok_id} == argmax: {tok_id == int(logits.argmax())}")
p5 = SamplingParams(temperature=1e-5, seed=3)
g5 = p5.make_generator()
at_eps = {int(sample(logits[None], [p5], [g5])[0]) for _ in range(20)}
print(f"t=1e-5 (not greedy: {not p5.greedy}), 20 draws, all the argmax: {at_eps == {int(logits.argmax())}}")
assert SAMPLING_EPS == 1e-5 and SamplingParams(temperature=1e-39).greedy and at_eps == {int(logits.argmax())}

# %% [markdown]
# **A top-p that keeps one token.** The first token always stays (nothing is in front of it), so
# any top_p at or below the top token's probability leaves exactly one, and sampling is greedy
# by another road. Just above it, a second token joins.

# %%
p1 = probs.max().item()
for top_p in (1e-9, p1 * 0.999, p1 * 1.001):
    kept = int(torch.isfinite(filter_logits(logits, 0, top_p)).sum())
    print(f"top_p={top_p:.4g}: {kept} kept")
assert int(torch.isfinite(filter_logits(logits, 0, 1e-9)).sum()) == 1
assert int(torch.isfinite(filter_logits(logits, 0, p1 * 1.001)).sum()) == 2

# %% [markdown]
# **A row of non-finite logits.** A model that overflowed (or a bug upstream) can hand the
# sampler NaN or inf. `sample_rows` checks each row: that row comes back as a sentence saying
# why, and the other rows of the step keep their tokens, so one broken request does not take the
# batch down. `sample`, for callers that want an exception, raises `ValueError` with the same
# sentence.

# %%
batch = torch.stack([logits, logits.clone().fill_(float("nan")), logits])  # (3, V), row 1 broken
params3 = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.7, seed=2), SamplingParams()]
picked = sample_rows(batch, params3, [p.make_generator() for p in params3])
print("sample_rows:", picked)
try:
    sample(batch, params3, [p.make_generator() for p in params3])
except ValueError as e:
    print("sample raised ValueError:", e)
assert isinstance(picked[0], int) and isinstance(picked[1], str) and picked[2] == int(logits.argmax())

# %% [markdown]
# **Values `validate` refuses**, each with a sentence a client can act on (the server days turn
# these into 400 responses):

# %%
for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-5), dict(seed=2**64), dict(max_tokens=0)):
    try:
        SamplingParams(**bad).validate()
        print(bad, "accepted (should not be)")
    except ValueError as e:
        print(f"{bad}: {e}")

# %% [markdown]
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
N_SHOW = 15
order = probs.argsort(descending=True)[:N_SHOW]
labels = [repr(tok.decode([i]))[1:-1] for i in order.tolist()]

ax = axes[0, 0]
width = 0.27
for j, t in enumerate((0.5, 1.0, 1.5)):
    pt = (logits / t).softmax(-1)[order]
    ax.bar([x + (j - 1) * width for x in range(N_SHOW)], pt.numpy(), width, label=f"temperature {t}")
ax.set_xticks(range(N_SHOW), labels, rotation=60, ha="right", fontsize=8)
ax.set_ylabel("probability")
ax.set_title(f"Next token after '...{' '.join(sampling.PREFIX.split()[-4:])}', at three temperatures")
ax.legend(fontsize=8)

ax = axes[0, 1]
sorted_p = probs.sort(descending=True).values
cum = sorted_p.cumsum(0)
ranks = torch.arange(1, len(cum) + 1)
ax.semilogx(ranks.numpy(), cum.numpy(), color="k", label="cumulative probability (t=1)")
for top_p, c in ((0.5, "tab:blue"), (0.9, "tab:orange")):
    n_keep = int(torch.isfinite(filter_logits(logits, 0, top_p)).sum())
    ax.axvline(n_keep, color=c, ls="--", label=f"top_p={top_p}: {n_keep} tokens")
for k, c in ((5, "tab:green"), (50, "tab:red")):
    ax.axvline(k, color=c, ls=":", label=f"top_k={k}: holds {cum[k - 1].item():.2f}")
ax.set_xlabel("tokens, most likely first (log)")
ax.set_ylabel("mass of the first n tokens")
ax.set_title("What top-k and top-p keep")
ax.legend(fontsize=8, loc="lower right")

ax = axes[1, 0]
temps = torch.logspace(-2, math.log10(3), 60)
ent = [sampling.entropy_bits((logits / t).softmax(-1)) for t in temps.tolist()]
ptop = [(logits / t).softmax(-1).max().item() for t in temps.tolist()]
ax.semilogx(temps.numpy(), ent, color="tab:purple", label="entropy (bits, left)")
ax.set_xlabel("temperature (log)")
ax.set_ylabel("entropy of the distribution (bits)")
ax2 = ax.twinx()
ax2.semilogx(temps.numpy(), ptop, color="tab:green", label="p(top token) (right)")
ax2.set_ylabel("probability of the top token")
ax2.set_ylim(0, 1.05)
ax.set_title("Temperature: from the argmax to the whole vocabulary")
lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
ax.legend(lines, [h.get_label() for h in lines], fontsize=8, loc="center left")

ax = axes[1, 1]
ts = torch.logspace(-45, 1, 200, dtype=torch.float64)
big = logits.abs().max().item()
with torch.no_grad():
    scaled_max = [(logits.abs().max() / torch.tensor(t, dtype=torch.float32)).item() for t in ts.tolist()]
finite = [math.isfinite(v) for v in scaled_max]
ax.loglog([t for t, f in zip(ts.tolist(), finite) if f], [v for v, f in zip(scaled_max, finite) if f],
          color="tab:blue", label="max |logit / t| in fp32")  # fmt: skip
ax.axhline(torch.finfo(torch.float32).max, color="tab:red", ls="--", label="fp32 max (3.4e38): beyond is inf")
ax.axvline(t_over, color="tab:red", ls=":", label=f"overflow below t = {t_over:.0e}: softmax is NaN")
ax.axvline(SAMPLING_EPS, color="tab:green", ls="-", label=f"SAMPLING_EPS = {SAMPLING_EPS:g}: greedy below")
ax.set_xlabel("temperature t (log)")
ax.set_ylabel("largest scaled logit (log)")
ax.set_title("Why a tiny temperature is greedy, not a division")
ax.legend(fontsize=8, loc="lower left")

fig.suptitle("Day 9: sampling the next token (SmolLM2-135M, fp32)", fontsize=14)
fig.tight_layout()
png = diagram_path("day09-sampling.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM**'s `Sampler` (`vllm/v1/sample/sampler.py`) draws the same line with the same number,
#   `_SAMPLING_EPS = 1e-5`: `apply_temperature` replaces a temperature below it by 1.0 before
#   dividing (so a greedy row never divides by 0), and the output takes the greedy token where
#   `temperature < _SAMPLING_EPS`. The filters are `apply_top_k_top_p`
#   (`vllm/v1/sample/ops/topk_topp_sampler.py`), on a batch at once: top-p there sorts ascending
#   and masks where `probs_sum <= 1 - p`, keeping at least one token. It does not call
#   `multinomial`: `random_sample` divides the probabilities by exponential noise and takes the
#   argmax (the exponential-race form of the same draw), filling the noise of requests with
#   their own `torch.Generator` row by row (`q[i].exponential_(generator=generator)`). The model
#   runner (`vllm/v1/worker/gpu_model_runner.py`) creates that generator, with
#   `generator.manual_seed(sampling_params.seed)`, for each request whose sampling type is
#   `RANDOM_SEED`; unseeded requests share the global one.
# * **transformers** samples with warpers in `generation/logits_process.py`:
#   `TemperatureLogitsWarper` raises for a temperature that is not strictly positive (and for
#   0.0 suggests `do_sample=False`), `TopKLogitsWarper`, and `TopPLogitsWarper`, which sorts
#   ascending, removes `cumulative_probs <= (1 - top_p)` and keeps `min_tokens_to_keep` (1)
#   whatever happens. The draw in `GenerationMixin._sample` is
#   `torch.multinomial(probs, num_samples=1)` on the global RNG: one seed for the whole call
#   (`transformers.set_seed`), not one per row.
# * **llama.cpp** chains samplers (`src/llama-sampler.cpp`): `llama_sampler_temp_impl` divides
#   by the temperature, and for `temp <= 0` keeps only the largest logit (greedy at exactly 0,
#   no epsilon); `llama_sampler_init_top_k` truncates the candidate array to k;
#   `llama_sampler_init_top_p(p, min_keep)`; and the draw, `llama_sampler_init_dist(seed)`, owns
#   its own `std::mt19937` seeded with its `seed` argument (or from `std::random_device` for
#   `LLAMA_DEFAULT_SEED`): each `dist` sampler carries its own generator, like our rows.
# * **nano-vllm** has temperature only (`nanovllm/layers/sampler.py`: divide, softmax, then the
#   same exponential-noise argmax as vLLM, under `torch.compile`), no top-k, top-p or seeds, and
#   its `SamplingParams` refuses greedy (`temperature > 1e-10`).
#
# ## Try it
#
# 1. **Break the guard on purpose.** Set `nanoserve.sampling.SAMPLING_EPS = 0.0` (the
#    `greedy` property reads the module constant each time it is asked), then call
#    `sample(logits[None], [SamplingParams(temperature=1e-39, seed=0)], [None])`. It must raise
#    `ValueError` with the sentence "sampling failed for this request (...)": the division
#    overflowed and `multinomial` refused the NaN. Put the constant back to `1e-5` and the same
#    call returns `int(logits.argmax())`.
# 2. **Top-k as greedy.** Check that `SamplingParams(temperature=1.0, top_k=1, seed=s)` draws the
#    argmax for 20 different seeds, and that `top_p=p1` (the top token's own probability, `p1`
#    above) does too. Then find the smallest `top_p` that keeps exactly 10 tokens. Check:
#    `filter_logits(logits, 0, top_p)` leaves 10 finite entries at your value and 9 at any
#    value a little below it.
# 3. **Reproduce the tables.** `python days/day09/sampling.py --out-dir /tmp/d9` and compare with
#    the committed CSVs: `day-09-settings.csv` must be identical (the draws are seeded, 1,000 a
#    setting), and so must `day-09-texts.csv`. With `--draws 10000`, the `top1_share` of
#    `t=1.0` should move towards its `p_top1`.

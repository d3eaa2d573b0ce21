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
# # Day 4 — Rotary position embeddings
#
# Attention compares a query with every key by a dot product, and a dot product knows nothing
# about where the two tokens sit. Rotary embeddings (RoPE) put the position in by rotating:
# each head's 64 coordinates form 32 pairs, and at position `m` pair `i` is turned by the angle
# `m * theta_i`, a different speed for every pair. Nothing is added to the hidden state and no
# parameter is learned; the rotation is applied to Q and K after their projections, inside
# every block (`nanoserve.models.rope_tables` and `apply_rope`).
#
# 1. one pair rotated by hand, then whole heads, against the package and transformers,
# 2. the frequencies, by hand against both,
# 3. why it works: the score depends on the distance `m - n` only,
# 4. which coordinates pair up: rotate-half against interleaved, and why Day 2 reorders Q/K rows,
# 5. the spectrum over the context, and Llama-3 scaling computed from its formula,
# 6. the day's table (`days/day04/spectrum.py`) and its diagram.
#
# Everything runs on block 0's real queries and keys for a chat prompt, computed from the
# checkpoint with the package's own `rms_norm` and `linear`; no full model is needed today.

# %%
import csv
import math
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by transformers

import matplotlib
import torch
import transformers

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from nanocourse import REPO, diagram_path
from nanoserve.models import LlamaConfig, apply_rope, linear, rms_norm, rope_inv_freq, rope_tables
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model, load_state_dict, unpermute_rotary_rows

sys.path.insert(0, str(REPO / "days" / "day04"))
import spectrum  # the day's script: the notebook prints the same table it writes

MODEL_DIR = fetch_default_model()
cfg = LlamaConfig.from_dir(MODEL_DIR)
tok = Tokenizer.from_dir(MODEL_DIR)
sd = load_state_dict(MODEL_DIR)
HD, HALF, NH, NKV = cfg.head_dim, cfg.head_dim // 2, cfg.num_heads, cfg.num_kv_heads
ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
N = len(ids)

# block 0's queries and keys, before any rotation
x = sd["model.embed_tokens.weight"][torch.tensor(ids)]  # (N, H)
h = rms_norm(x, sd["model.layers.0.input_layernorm.weight"], cfg.rms_norm_eps)
q = linear(h, sd["model.layers.0.self_attn.q_proj.weight"]).view(N, NH, HD)  # (N, 9, 64)
k = linear(h, sd["model.layers.0.self_attn.k_proj.weight"]).view(N, NKV, HD)  # (N, 3, 64)
print(f"theta {cfg.rope_theta:g} | head_dim {HD} -> {HALF} pairs | context {cfg.max_position_embeddings}")
print(f"prompt {N} tokens | q {tuple(q.shape)} | k {tuple(k.shape)}")

# %% [markdown]
# ## 1. One pair, then whole heads
#
# Take the query of the last prompt token, head 0, and its pair 3: coordinates 3 and 35 (the
# rotate-half layout pairs `i` with `i + 32`). At position `m` the pair is multiplied by the
# 2x2 rotation matrix of angle `m * theta_3`. A rotation keeps the pair's length.

# %%
inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(HALF, dtype=torch.float64) * 2 / HD)  # (32,), by hand
v = q[-1, 0]  # (64,)
pair = torch.stack([v[3], v[3 + HALF]]).double()  # (2,)
for m in (0, 1, 7, 1000):
    a = m * inv_freq[3]
    R = torch.tensor([[math.cos(a), -math.sin(a)], [math.sin(a), math.cos(a)]], dtype=torch.float64)
    turned = R @ pair
    print(
        f"m = {m:4}: angle {a:8.3f} rad ({a / (2 * math.pi):5.1f} turns) ->",
        f"({turned[0]:+.4f}, {turned[1]:+.4f}), length {turned.norm():.4f}",
    )
    assert abs(turned.norm() - pair.norm()) < 1e-12

# %% [markdown]
# For all 32 pairs at once, write the two halves of a head as `a` and `b`: the rotated head is
# `(a cos - b sin, a sin + b cos)`. The package writes the same thing as `x * cos + rotate_half(x)
# * sin`, with cos and sin tables of width 64 (each angle twice) built once for every position;
# transformers does it with `LlamaRotaryEmbedding` and `apply_rotary_pos_emb`. Here all three
# rotate block 0's queries and keys at the prompt's positions 0..36.


# %%
def rope_by_hand(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate t (N, heads, 64) pair (i, i + 32) by positions[n] * inv_freq[i], in fp32."""
    angle = (positions[:, None].double() * inv_freq).float()[:, None, :]  # (N, 1, 32)
    a, b = t[..., :HALF], t[..., HALF:]  # (N, heads, 32) each
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1)


def check_close(got: torch.Tensor, want: torch.Tensor, what: str, bound: float = 1e-5) -> None:
    """max |got - want| within `bound` of max |want|."""
    err = ((got - want).abs().max() / want.abs().max()).item()
    if not err <= bound:
        raise AssertionError(f"{what}: relative difference {err:.2g} exceeds {bound:g}")
    print(f"{what}: within {bound:g}")


positions = torch.arange(N)
cos, sin = rope_tables(cfg, cfg.max_position_embeddings)  # (8192, 64) each
print(
    "package tables:", tuple(cos.shape), cos.dtype, "| per token:", tuple(cos[positions].unsqueeze(1).shape)
)
q_pkg = apply_rope(q, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))  # (N, 9, 64)
k_pkg = apply_rope(k, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))  # (N, 3, 64)

hf_config = transformers.LlamaConfig.from_pretrained(MODEL_DIR)
hf_rope = LlamaRotaryEmbedding(hf_config)
hf_cos, hf_sin = hf_rope(q, positions[None])  # (1, N, 64) each
q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
print("transformers' tables:", tuple(hf_cos.shape), "| rotated q:", tuple(q_hf.shape), "(1, heads, N, 64)")
check_close(rope_by_hand(q, positions), q_pkg, "q: hand vs nanoserve apply_rope")
check_close(rope_by_hand(k, positions), k_pkg, "k: hand vs nanoserve apply_rope")
check_close(q_pkg, q_hf[0].transpose(0, 1), "q: nanoserve vs transformers' apply_rotary_pos_emb")
check_close(k_pkg, k_hf[0].transpose(0, 1), "k: nanoserve vs transformers' apply_rotary_pos_emb")
lengths = (q_pkg.norm(dim=-1) / q.norm(dim=-1) - 1).abs().max().item()
print("every head's length kept within 1e-6 by the rotation:", lengths < 1e-6)
assert torch.equal(q_pkg[0], q[0]) and lengths < 1e-6  # position 0: angle 0, nothing moves

# %% [markdown]
# ## 2. The frequencies
#
# `theta_i = theta^(-2i / 64)` with SmolLM2's theta of 100,000 (the original RoPE paper used
# 10,000). Pair 0 turns one radian per position; each next pair is slower by the factor
# 100,000^(1/32) = 1.43; pair 31 turns once in about 438,000 positions. The by-hand float64
# values above against the package's fp32 `rope_inv_freq` and transformers' `inv_freq`:

# %%
ours_f, theirs_f = rope_inv_freq(cfg), hf_rope.inv_freq
print(
    "inv_freq:", tuple(ours_f.shape), ours_f.dtype, "| first three", [f"{f:.4f}" for f in ours_f[:3].tolist()]
)
print("nanoserve == transformers, bit for bit:", torch.equal(ours_f, theirs_f))
check_close(ours_f.double(), inv_freq, "package fp32 vs by-hand float64", bound=1e-6)
print(f"ratio between neighbours: {(inv_freq[:-1] / inv_freq[1:]).mean():.4f}")
wave = 2 * math.pi / inv_freq  # (32,)
print(f"wavelengths: pair 0 {wave[0]:.2f}, pair 31 {wave[-1]:,.0f} positions")
assert torch.equal(ours_f, theirs_f)

# %% [markdown]
# ## 3. The score depends on the distance only
#
# Rotate a query to position `m` and a key to position `n`: their dot product is the unrotated
# query against the key turned by `n - m`: for rotations of a plane, `R(m)^T R(n) = R(n - m)`,
# since turning both vectors by the same extra angle changes nothing between them. So shifting
# both tokens by the same offset leaves the score where it was. Numerically, with the last
# token's query (head 0) and the key of token 5 (K/V head 0, the one head 0 reads): the 128 x
# 128 matrix of scores over positions is constant along every diagonal, and a distance measured
# at offset 8,000 gives the score it gives at offset 0, to the rounding of fp32 angles.


# %%
def rotated(t: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """One head vector t (64,) rotated to each position in `at` (P,) -> (P, 64), the package's way."""
    return apply_rope(t.expand(len(at), 1, HD), cos[at].unsqueeze(1), sin[at].unsqueeze(1))[:, 0]


qv, kv = q[-1, 0], k[5, 0]
grid = torch.arange(128)
S = rotated(qv, grid) @ rotated(kv, grid).T  # (128, 128): query at row m, key at column n
spread = max((S.diagonal(-d).max() - S.diagonal(-d).min()).item() for d in range(128))
print(f"score matrix {tuple(S.shape)}: scores {S.min():.2f} to {S.max():.2f}")
print("every diagonal constant within 1e-5 of the largest score:", spread < 1e-5 * S.abs().max().item())
distances = torch.arange(64)
at_zero = (rotated(qv, distances) * rotated(kv, torch.zeros_like(distances))).sum(-1)  # (64,)
for offset in (1, 100, 1000, 8000):
    shifted = (rotated(qv, distances + offset) * rotated(kv, torch.full_like(distances, offset))).sum(-1)
    check_close(shifted, at_zero, f"distances 0..63 at offset {offset:>4} vs offset 0", bound=1e-5)
assert spread < 1e-5 * S.abs().max()

# %% [markdown]
# Distance changes the score (here from 26.3 at distance 0 to 28.0 at distance 7, and far
# lower once the two tokens are a thousand positions apart), position alone does not. That is
# all attention ever learns about order, and it is what lets a KV cache keep a key rotated
# once, at the position it was written: whatever query comes later, its distance to that key
# is fixed.

# %%
print("score at distance 0..7:", [f"{s:.2f}" for s in at_zero[:8].tolist()])
far_off = torch.arange(1000, 4096)
far_scores = (rotated(qv, far_off) * rotated(kv, torch.zeros_like(far_off))).sum(-1)
print(f"score at distances 1,000 to 4,095: {far_scores.min():.1f} to {far_scores.max():.1f}")
assert (at_zero[7] - at_zero[0]).abs() > 1 and far_scores.max() < at_zero.min()

# %% [markdown]
# ## 4. Which coordinates pair up
#
# The rotate-half layout (GPT-NeoX's, and Hugging Face's for Llama) pairs coordinate `i` with
# `i + 32`. The interleaved layout (the original RoPE paper's, and llama.cpp's for Llama) pairs
# `2i` with `2i + 1`. Either works if the weights were trained for it, and the two are the same
# rotation on coordinates listed in a different order: interleaved on rows `(0, 32, 1, 33, ...)`
# equals rotate-half, reordered. That is the order llama.cpp's converter writes Q and K rows in,
# and why Day 2's `unpermute_rotary_rows` puts them back: our `apply_rope` rotates halves, so it
# needs the rows in Hugging Face's order.


# %%
def rope_interleaved(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate pair (2i, 2i + 1) of t (N, heads, 64) by positions[n] * inv_freq[i]."""
    angle = (positions[:, None].double() * inv_freq).float()[:, None, :]  # (N, 1, 32)
    a, b = t[..., 0::2], t[..., 1::2]  # (N, heads, 32) each
    return torch.stack(
        [a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1
    ).flatten(-2)


gguf_order = torch.stack([torch.arange(HALF), torch.arange(HALF) + HALF], dim=1).flatten()  # (64,)
print("GGUF row order inside a head:", gguf_order[:8].tolist(), "...")
assert torch.equal(unpermute_rotary_rows(gguf_order, 1), torch.arange(HD))  # Day 2's inverse undoes it
q_gguf, k_gguf = q[..., gguf_order], k[..., gguf_order]  # what llama.cpp's rows give
check_close(
    rope_interleaved(q_gguf, positions),
    q_pkg[..., gguf_order],
    "interleaved on GGUF rows == halves, reordered",
)


def scores(qr: torch.Tensor, kr: torch.Tensor) -> torch.Tensor:
    """Query head 0 against K/V head 0 at every pair of prompt positions: (N, N)."""
    return qr[:, 0] @ kr[:, 0].T


right = scores(q_pkg, k_pkg)
check_close(
    scores(rope_interleaved(q_gguf, positions), rope_interleaved(k_gguf, positions)),
    right,
    "scores, llama.cpp's way",
)
mixed = scores(rope_by_hand(q_gguf, positions), rope_by_hand(k_gguf, positions))  # halves on GGUF rows
try:
    check_close(mixed, right, "scores, rotate-half on GGUF rows")
    raise RuntimeError("mixing the layouts should break the scores")
except AssertionError as e:
    print("caught:", e)
print(
    "position 0 still right (angle 0, the same reordering on q and k):",
    torch.allclose(mixed[0, 0], right[0, 0]),
)

# %% [markdown]
# ## 5. The spectrum, and stretching it
#
# A pair whose wavelength is far shorter than the context wraps around many times and tells
# near positions apart; a pair whose wavelength is longer than the context never completes a
# turn and varies smoothly across it. Over SmolLM2's 8,192 positions, 12 of the 32 pairs never
# complete one turn. The day's script tabulates the spectrum as the package computes it.
#
# Llama 3.1's longer context came with one change to the architecture, and it is to these
# frequencies (`rope_type: llama3`, `_compute_llama3_parameters` in transformers'
# `modeling_rope_utils.py`, whose comments give the original values). With `L = 8192` (the
# context the model was first trained at), `factor = 8`, `low = 1`, `high = 4`, a pair of
# wavelength `lambda`:
#
# * `lambda < L / high`, a quarter of the context: kept as it is,
# * `lambda > L / low`, the whole context (8,192): frequency divided by `factor`,
# * in between: `s = (L / lambda - low) / (high - low)`, frequency `(1 - s) f / factor + s f`.
#
# The short wavelengths that resolve neighbouring tokens stay, and the ones that only ever saw
# part of a turn get eight times the room. Here is that formula by hand, on SmolLM2's frequencies,
# against the package (`rope_inv_freq` with `rope_scaling`) and transformers' own function.

# %%
L, factor, low, high = 8192, 8.0, 1.0, 4.0
wavelength = 2 * math.pi / inv_freq  # (32,) float64
smooth = (L / wavelength - low) / (high - low)
by_hand = torch.where(
    wavelength < L / high,
    inv_freq,
    torch.where(
        wavelength > L / low, inv_freq / factor, (1 - smooth) * inv_freq / factor + smooth * inv_freq
    ),
)
scaled_cfg = spectrum.llama3_config(cfg)  # Llama 3.1's parameters on SmolLM2's shape
hf_scaled = transformers.LlamaConfig.from_pretrained(
    MODEL_DIR, rope_parameters={"rope_type": "llama3", "rope_theta": cfg.rope_theta, **spectrum.LLAMA31}
)
theirs_scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_scaled)
print("rope_scaling:", scaled_cfg.rope_scaling)
check_close(rope_inv_freq(scaled_cfg).double(), by_hand, "package llama3 vs by hand", bound=1e-6)
print(
    "package == transformers' _compute_llama3_parameters:",
    torch.equal(rope_inv_freq(scaled_cfg), theirs_scaled),
)
kept = int((by_hand == inv_freq).sum())
slowed = int(torch.isclose(by_hand, inv_freq / factor, rtol=1e-12).sum())
print(f"pairs kept {kept}, slowed by 8 {slowed}, blended {HALF - kept - slowed}")
assert torch.equal(rope_inv_freq(scaled_cfg), theirs_scaled) and (kept, slowed) == (17, 12)

# %% [markdown]
# ## 6. The day's table
#
# `spectrum.spectrum_rows` is what `python days/day04/spectrum.py` writes to
# `day-04-spectrum.csv`: one row per pair, its frequency and wavelength, the turns it makes over
# 8,192 positions, and what Llama 3.1's rule would make of it.

# %%
rows = spectrum.spectrum_rows(cfg, scaled_cfg)
cols = list(rows[0])
print(" | ".join(cols))
for r in rows[:3] + rows[15:22] + rows[-2:]:
    print(" | ".join(str(r[c]) for c in cols))
with open(spectrum.CSV) as f:
    assert [{k: str(v) for k, v in r.items()} for r in rows] == list(csv.DictReader(f)), "rerun spectrum.py"
never = [r["pair"] for r in rows if float(r["wavelength"]) > cfg.max_position_embeddings]
print(f"pairs that never complete a turn in {cfg.max_position_embeddings} positions: {never[0]}..{never[-1]}")
assert never == list(range(20, 32))

# %% [markdown]
# ## The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))

ax = axes[0, 0]
walk = torch.arange(25)
turned = rotated(v, walk)  # (25, 64): the last token's query, head 0, at positions 0..24
for i, color in ((0, "tab:red"), (3, "tab:blue"), (9, "tab:green")):
    a, b = turned[:, i], turned[:, i + HALF]
    r = math.hypot(v[i].item(), v[i + HALF].item())
    circle = torch.linspace(0, 2 * math.pi, 200)
    ax.plot(r * circle.cos(), r * circle.sin(), color=color, lw=0.6, alpha=0.4)
    label = f"pair {i} ({i} & {i + HALF}): wavelength {2 * math.pi / inv_freq[i]:.1f}"
    ax.scatter(a, b, s=14, color=color, label=label, zorder=3)
    ax.annotate("", (a[1], b[1]), (a[0], b[0]), arrowprops=dict(arrowstyle="->", color=color, lw=1.5))
    ax.annotate("m=0", (a[0], b[0]), fontsize=8, xytext=(4, 4), textcoords="offset points")
ax.set_aspect("equal")
ax.set_xlabel("coordinate i")
ax.set_ylabel("coordinate i + 32")
ax.set_title("One query at positions 0..24 (dots); arrow: position 0 to 1")
ax.legend(fontsize=8, loc="upper right")

ax = axes[0, 1]
far = torch.arange(0, 4096)
for offset, style in ((0, "-"), (4000, "--")):
    curve = (rotated(qv, far + offset) * rotated(kv, torch.full_like(far, offset))).sum(-1)
    ax.plot(far, curve, style, lw=1 if offset == 0 else 1.5, label=f"query at {offset} + d, key at {offset}")
ax.set_xscale("symlog", linthresh=10)
ax.set_xlabel("distance d = m - n (symlog)")
ax.set_ylabel("q . k after rotation")
ax.set_title("Score against distance: the same curve at any offset")
ax.legend(fontsize=8)

ax = axes[1, 0]
pairs = range(HALF)
ax.semilogy(pairs, wavelength, "o-", color="tab:blue", ms=4, label=f"SmolLM2 (theta {cfg.rope_theta:g})")
ax.semilogy(pairs, 2 * math.pi / by_hand, "s--", color="tab:orange", ms=4, label="with Llama 3.1's scaling")
ax.axhline(L, color="k", lw=1, label=f"context {L:,}")
ax.axhline(L * factor, color="k", ls=":", lw=1, label=f"{L * factor:,.0f} = context x factor")
ax.axhspan(1, L / high, color="tab:green", alpha=0.08)
ax.axhspan(L / high, L / low, color="tab:olive", alpha=0.15)
ax.axhspan(L / low, 1e7, color="tab:red", alpha=0.06)
for y, text in ((30, "kept"), (3200, "blended"), (3e5, "slowed 8x")):
    ax.text(0.5, y, text, fontsize=9)
ax.set_ylim(3, 1e7)
ax.set_xlabel("pair i (coordinates i and i + 32)")
ax.set_ylabel("wavelength in positions (log)")
ax.set_title("The 32 frequencies, and Llama-3 scaling applied to them")
ax.legend(fontsize=8, loc="lower right")

ax = axes[1, 1]
ax.scatter(
    right.flatten(), mixed.flatten(), s=6, color="tab:red", alpha=0.5, label="rotate-half on GGUF-order rows"
)
llama_cpp = scores(rope_interleaved(q_gguf, positions), rope_interleaved(k_gguf, positions))
ax.scatter(
    right.flatten(), llama_cpp.flatten(), s=6, color="tab:green", label="interleaved on GGUF-order rows"
)
lim = [right.min().item(), right.max().item()]
ax.plot(lim, lim, "k--", lw=0.8)
ax.set_xlabel("score, rotate-half on Hugging Face rows (ours)")
ax.set_ylabel("score, the other combination")
ax.set_title(f"Block 0, head 0: all {N} x {N} query-key scores")
ax.legend(fontsize=8, loc="upper left", markerscale=3)

fig.suptitle(
    "Day 4: rotary position embeddings in SmolLM2-135M (block 0's real queries and keys)", fontsize=14
)
fig.tight_layout()
png = diagram_path("day04-rope.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **transformers**: `LlamaRotaryEmbedding` (`models/llama/modeling_llama.py`) keeps only
#   `inv_freq`, picked by `rope_parameters["rope_type"]` from `ROPE_INIT_FUNCTIONS` in
#   `modeling_rope_utils.py` (`"llama3"` is `_compute_llama3_parameters`, the rule of section 5),
#   and computes cos and sin in every forward for the positions it is given (`torch.cat((freqs,
#   freqs))`, width 64 like ours). `apply_rotary_pos_emb` and `rotate_half` are the rotate-half
#   layout. We build the table for every position once, at load, and index it per step.
# * **vLLM**: `RotaryEmbedding` (`vllm/model_executor/layers/rotary_embedding/base.py`) builds a
#   `cos_sin_cache` for `max_position_embeddings` positions in the model's dtype, cos and sin of
#   the 32 angles side by side (width 64, each angle once). Its `is_neox_style` flag chooses the
#   layout: `rotate_neox` (halves) or `rotate_gptj` (neighbours) in `common.py`. On CUDA
#   `forward_cuda` calls its own kernel, `ops.rotary_embedding`, which rotates the query and key
#   in place. `get_rope` (`__init__.py`) picks the class from `rope_type`; `"llama3"` gives
#   `Llama3RotaryEmbedding` (`llama3_rope.py`), whose `_compute_inv_freq` is the same three-band
#   `torch.where`.
# * **nano-vllm**: `RotaryEmbedding` (`nanovllm/layers/rotary_embedding.py`) also caches cos and
#   sin for every position and rotates halves (`torch.chunk(x.float(), 2, dim=-1)`), in fp32 and
#   cast back, under `@torch.compile`. Its `get_rope` takes no scaling argument: `Qwen3Attention`
#   reads only `rope_theta` out of a `rope_scaling` dict, so a checkpoint that asks for llama3
#   scaling would run on unscaled frequencies there.
# * **llama.cpp**: the Llama graph (`src/models/llama.cpp`) rotates with `ggml_rope_ext(ctx0,
#   Qcur, inp_pos, rope_factors, n_rot, rope_type, ...)`. `rope_type` is one of
#   `enum llama_rope_type` (`include/llama.h`): `LLAMA_ROPE_TYPE_NORM` or `LLAMA_ROPE_TYPE_NEOX`.
#   In the CPU kernel (`ggml/src/ggml-cpu/ops.cpp`) `GGML_ROPE_TYPE_NORMAL` calls
#   `rotate_pairs(n_dims, 1, ...)`, neighbours, and NEOX `rotate_pairs(n_dims, n_dims/2, ...)`,
#   halves: section 4's two layouts as one function with a stride. Llama-3 scaling arrives as
#   per-frequency factors, the `rope_freqs` tensor (`n_rot/2` values) that `get_rope_factors`
#   hands to `ggml_rope_ext`; our converter recovers Meta's four parameters from those factors
#   (`_llama3_rope_scaling` in `nanoserve/gguf_file.py`).
#
# ## Try it
#
# 1. **Break the frequencies on purpose.** Rebuild the tables with the original paper's base,
#    `cos, sin = rope_tables(dataclasses.replace(cfg, rope_theta=10_000.0), 8192)`, and rerun
#    section 1's comparison against transformers: `check_close` raises. Which positions still
#    agree? Only position 0 (every angle is 0 there); at position 1 the cos tables already differ
#    by 0.04.
# 2. **Another stretching rule.** `python days/day04/spectrum.py --factor 4 --original-context
#    4096 --out /tmp/s.csv` must end with `llama3_bands={'high': 15, 'medium': 4, 'low': 13}`;
#    check by hand from section 5's formula which pairs moved from one band to another, and that
#    the package's `rope_inv_freq` on `spectrum.llama3_config(cfg, factor=4.0,
#    original_max_position_embeddings=4096)` still equals transformers' `_compute_llama3_parameters`.
# 3. **Absolute positions do not commute.** Replace the rotation in `rotated` by adding a fixed
#    random vector per position (`t + P[at]` with `P = torch.randn(8192, 64)`), and rerun
#    section 3: the diagonal check and `check_close` at every offset must now fail, while a
#    rotation passes them for any `cos`/`sin` table built from one set of frequencies.

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
# # Day 5 — Grouped-query attention
#
# SmolLM2 has 9 query heads in every block but only 3 key/value heads: each K/V head serves a
# group of 3 query heads. The queries are as many as ever; what shrinks is what a token leaves
# behind for later tokens to read, its keys and values, and that is what the KV cache of Day 11
# will store. Today builds the attention of one block by hand and checks it four ways:
#
# 1. the grouping: which query head reads which K/V head,
# 2. the causal mask,
# 3. scores, a softmax by hand, and the weighted values, against `F.scaled_dot_product_attention`,
#    the package's `causal_attention`, and transformers' `LlamaAttention` on the real weights,
# 4. multi-head attention as the case of groups of one,
# 5. the gate failing on a wrong grouping and on a missing mask,
# 6. what the grouping saves: K/V bytes per token for 3 K/V heads against 9
#    (`days/day05/kvbytes.py`), and the diagram.
#
# The inputs are block 0's real queries, keys and values for a chat prompt, computed from the
# checkpoint with the package's `rms_norm`, `linear` and `apply_rope` (Days 3 and 4).

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
import torch.nn.functional as F
import transformers

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display
from matplotlib.colors import LogNorm
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaRotaryEmbedding,
    eager_attention_forward,
)

from nanocourse import REPO, diagram_path
from nanoserve.contiguous import causal_attention
from nanoserve.models import LlamaConfig, apply_rope, linear, rms_norm, rope_tables
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model, load_state_dict

sys.path.insert(0, str(REPO / "days" / "day05"))
import kvbytes  # the day's script: the notebook prints the same table it writes

MODEL_DIR = fetch_default_model()
cfg = LlamaConfig.from_dir(MODEL_DIR)
tok = Tokenizer.from_dir(MODEL_DIR)
sd = load_state_dict(MODEL_DIR)
NH, NKV, HD, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
GROUP = NH // NKV
ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
N = len(ids)
positions = torch.arange(N)

# block 0 up to its attention: embedding, norm, the Q/K/V projections, RoPE
p = "model.layers.0."
x = sd["model.embed_tokens.weight"][torch.tensor(ids)]  # (N, H)
h = rms_norm(x, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
w_qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])  # (960, 576)
qkv = linear(h, w_qkv).view(N, NH + 2 * NKV, HD)  # (N, 15, 64)
cos, sin = rope_tables(cfg, N)
q = apply_rope(qkv[:, :NH], cos.unsqueeze(1), sin.unsqueeze(1))  # (N, 9, 64)
k = apply_rope(qkv[:, NH : NH + NKV], cos.unsqueeze(1), sin.unsqueeze(1))  # (N, 3, 64)
v = qkv[:, NH + NKV :]  # (N, 3, 64): values are not rotated
print(f"prompt {N} tokens | q {tuple(q.shape)} | k {tuple(k.shape)} | v {tuple(v.shape)}")
print(f"{NH} query heads, {NKV} K/V heads: groups of {GROUP}")

# %% [markdown]
# ## 1. The grouping
#
# Query head `h` reads K/V head `h // 3`: heads 0-2 share K/V head 0, heads 3-5 share head 1,
# heads 6-8 head 2. Spelled out for all 9 query heads, the keys are each K/V head repeated
# three times in a row (`repeat_interleave`): a (N, 9, 64) tensor that holds no more
# information than the (N, 3, 64) one, which is why only the small one needs storing.

# %%
kv_of = torch.arange(NH) // GROUP  # (9,): the K/V head of each query head
k_full = k.repeat_interleave(GROUP, dim=1)  # (N, 9, 64)
v_full = v.repeat_interleave(GROUP, dim=1)
print("K/V head of query heads 0..8:", kv_of.tolist())
print("keys as the 9 query heads see them:", tuple(k_full.shape))
print("k_full == k[:, kv_of]:", torch.equal(k_full, k[:, kv_of]))
print(
    "query heads 0, 1, 2 read identical keys:",
    torch.equal(k_full[:, 0], k_full[:, 1]) and torch.equal(k_full[:, 1], k_full[:, 2]),
)
assert torch.equal(k_full, k[:, kv_of]) and kv_of.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]

# %% [markdown]
# ## 2. The causal mask
#
# Token `i` may attend to token `j` only if `j <= i`: nothing can read the future. The mask
# comes from the positions, a lower triangle with N(N+1)/2 allowed entries; here is its corner.

# %%
mask = positions[None, :] <= positions[:, None]  # (N, N): row = query, column = key
print("mask:", tuple(mask.shape), mask.dtype, "| allowed entries:", int(mask.sum()), "=", N * (N + 1) // 2)
for row in mask[:6, :6].int().tolist():
    print("  ", " ".join(map(str, row)))
assert int(mask.sum()) == N * (N + 1) // 2

# %% [markdown]
# ## 3. Attention by hand
#
# For every query head, the scores are the dot products with the keys of its K/V head divided
# by sqrt(64) = 8, the masked ones set to minus infinity; the softmax subtracts each row's
# largest score (so `exp` cannot overflow), exponentiates and divides by the row's sum; the
# output is those weights times the values. The first token sees only itself, so its weights
# are exactly (1, 0, 0, ...).


# %%
def attention_by_hand(q, k, v, mask):
    """q (N, nh, hd), k/v (L, nkv, hd), mask (N, L) -> output (N, nh, hd), weights (nh, N, L)."""
    group = q.shape[1] // k.shape[1]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)  # (nh, L, hd)
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ kh.transpose(1, 2) / math.sqrt(q.shape[-1])  # (nh, N, L)
    scores = scores.masked_fill(~mask, float("-inf"))
    e = (scores - scores.amax(-1, keepdim=True)).exp()
    weights = e / e.sum(-1, keepdim=True)  # (nh, N, L)
    return (weights @ vh).transpose(0, 1), weights  # (N, nh, hd)


def check_attention_close(got, want, what, bound=1e-5):
    """max |got - want| within `bound` of max |want|."""
    err = ((got - want).abs().max() / want.abs().max()).item()
    if not err <= bound:
        raise AssertionError(f"{what}: relative difference {err:.2g} exceeds {bound:g}")
    print(f"{what}: within {bound:g}")


out, weights = attention_by_hand(q, k, v, mask)
print("scores and weights:", tuple(weights.shape), "| output:", tuple(out.shape))
print("every row of weights sums to 1:", torch.allclose(weights.sum(-1), torch.ones(NH, N)))
first = torch.zeros(N)
first[0] = 1
print("query 0 puts weight 1 on itself and 0 elsewhere, in every head:", bool((weights[:, 0] == first).all()))
print("weight on the future:", weights.masked_select(~mask.expand(NH, N, N)).abs().max().item())
assert (
    torch.equal(weights[:, 0, 0], torch.ones(NH))
    and weights.masked_select(~mask.expand(NH, N, N)).eq(0).all()
)

qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # (1, heads, N, 64)
sdpa_gqa = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
sdpa_full = F.scaled_dot_product_attention(
    qh, k_full.transpose(0, 1)[None], v_full.transpose(0, 1)[None], is_causal=True
)
check_attention_close(out, sdpa_gqa, "hand vs F.scaled_dot_product_attention(enable_gqa=True)")
check_attention_close(
    out, sdpa_full[0].transpose(0, 1), "hand vs F.scaled_dot_product_attention(is_causal) on repeated K/V"
)
package = causal_attention(q, k.transpose(0, 1), v.transpose(0, 1), positions)  # k, v as the cache holds them
check_attention_close(out, package, "hand vs nanoserve.contiguous.causal_attention")

# %% [markdown]
# transformers' `LlamaAttention`, built from the model's config and given block 0's real
# `q_proj`, `k_proj`, `v_proj` and `o_proj`, runs the whole attention sublayer in its eager mode
# (`eager_attention_forward`, which expands K/V with `repeat_kv` exactly as above) and returns
# its attention weights too. Ours ends with the output projection `o`.

# %%
hf_config = transformers.LlamaConfig.from_pretrained(MODEL_DIR)
hf_config._attn_implementation = "eager"
hf_attn = LlamaAttention(hf_config, layer_idx=0).eval()
prefix = p + "self_attn."
hf_attn.load_state_dict({n.removeprefix(prefix): t for n, t in sd.items() if n.startswith(prefix)})
hf_cos, hf_sin = LlamaRotaryEmbedding(hf_config)(h, positions[None])
additive = torch.zeros(N, N).masked_fill(~mask, float("-inf"))[None, None]  # (1, 1, N, N)
with torch.no_grad():
    hf_out, hf_weights = hf_attn(h[None], position_embeddings=(hf_cos, hf_sin), attention_mask=additive)
ours_out = linear(out.reshape(N, NH * HD), sd[prefix + "o_proj.weight"])  # (N, 576)
print("transformers:", tuple(hf_out.shape), "weights", tuple(hf_weights.shape))
check_attention_close(weights, hf_weights[0], "attention weights vs transformers' LlamaAttention")
check_attention_close(ours_out, hf_out[0], "sublayer output (after o_proj) vs transformers")
print(
    "eager_attention_forward is what ran:",
    hf_attn.config._attn_implementation,
    eager_attention_forward.__name__,
)

# %% [markdown]
# ## 4. Multi-head attention is the group of one
#
# Give every query head its own K/V head by copying each K/V head's 64 rows of `W_k` and `W_v`
# three times: a (576, 576) key matrix, 9 K/V heads, groups of 1, and attention takes the
# plain multi-head path (`causal_attention` passes `enable_gqa` only when the head counts
# differ). The result is the grouped one: GQA is multi-head attention whose K/V heads are tied
# in threes, and MHA is GQA with groups of one.

# %%
w_k, w_v = sd[prefix + "k_proj.weight"], sd[prefix + "v_proj.weight"]  # (192, 576) each
w_k9 = w_k.view(NKV, HD, H).repeat_interleave(GROUP, dim=0).reshape(NH * HD, H)  # (576, 576)
w_v9 = w_v.view(NKV, HD, H).repeat_interleave(GROUP, dim=0).reshape(NH * HD, H)
k9 = apply_rope(linear(h, w_k9).view(N, NH, HD), cos.unsqueeze(1), sin.unsqueeze(1))  # (N, 9, 64)
v9 = linear(h, w_v9).view(N, NH, HD)
mha = causal_attention(q, k9.transpose(0, 1), v9.transpose(0, 1), positions)
print("MHA keys:", tuple(k9.shape), "from W_k", tuple(w_k9.shape))
check_attention_close(mha, out, "9 K/V heads (MHA) vs 3 shared (GQA)")
extra = cfg.num_layers * 2 * (w_k9.numel() - w_k.numel())
print(f"the MHA version of the model would carry {extra:,} more parameters (K and V projections)")
assert extra == 13_271_040

# %% [markdown]
# ## 5. The gate on a wrong attention
#
# Two mistakes that raise no shape error. Tiling K/V heads (`repeat`, giving 0 1 2 0 1 2 ...)
# instead of repeating each in place (`repeat_interleave`) sends most query heads to the wrong
# keys; 3 of the 9 heads (0, 4, 8, where `h // 3 == h % 3`) happen to stay right. Leaving the
# mask out lets every token read the future; only the last token, which may see everything
# anyway, keeps its output. That is why `causal_attention` needs no mask for a single query at
# the end of the sequence, the decode step of Day 11.

# %%
tiled_k, tiled_v = (
    k.repeat(1, GROUP, 1),
    v.repeat(1, GROUP, 1),
)  # (N, 9, 64), heads in the order 0 1 2 0 1 2 ...
tiled, _ = attention_by_hand(q, tiled_k, tiled_v, mask)  # groups of 1 over the tiled heads
unmasked, _ = attention_by_hand(q, k, v, torch.ones(N, N, dtype=torch.bool))
for got, what in ((tiled, "K/V heads tiled, not interleaved"), (unmasked, "no causal mask")):
    try:
        check_attention_close(got, out, what)
        raise RuntimeError(f"{what} should fail the gate")
    except AssertionError as e:
        print("caught:", e)
right_heads = [hd for hd in range(NH) if torch.allclose(tiled[:, hd], out[:, hd], atol=1e-6)]
print(
    "heads still right when tiled:",
    right_heads,
    "| tiled K/V head of each:",
    (torch.arange(NH) % NKV).tolist(),
)
per_query = (unmasked - out).abs().amax(dim=(1, 2))  # (N,)
right_rows = (per_query <= 1e-6).nonzero().flatten().tolist()
print(f"query positions still right without the mask: {right_rows} (the last is {N - 1})")
assert right_heads == [0, 4, 8] and right_rows == [N - 1]

# %% [markdown]
# ## 6. What the grouping saves
#
# A token's K/V costs 2 (key and value) x 30 layers x K/V heads x 64 x bytes per element, and the
# number of query heads does not appear. `kvbytes.kv_rows` prices SmolLM2's shape with 9, 3 and
# 1 K/V heads (multi-head, SmolLM2's grouping, multi-query) in fp32 and bf16, using
# `LlamaConfig.kv_bytes_per_token`.

# %%
by_hand = 2 * cfg.num_layers * NKV * HD * 4
print(f"by hand, fp32, 3 K/V heads: 2 x {cfg.num_layers} x {NKV} x {HD} x 4 = {by_hand:,} bytes per token")
assert by_hand == cfg.kv_bytes_per_token(torch.float32) == 46_080
rows = kvbytes.kv_rows(cfg)
cols = list(rows[0])
print(" | ".join(cols))
for r in rows:
    print(" | ".join(str(r[c]) for c in cols))
with open(kvbytes.CSV) as f:
    assert [{k: str(v) for k, v in r.items()} for r in rows] == list(csv.DictReader(f)), "rerun kvbytes.py"

weights_fp32 = sum(t.numel() for t in sd.values()) * 4
for r in rows[:3]:
    at = weights_fp32 / r["bytes_per_token"]
    print(f"{r['layout']}: one sequence's fp32 cache equals the fp32 weights at {at:,.0f} tokens")
assert (
    weights_fp32 == 538_060_032 and weights_fp32 // rows[1]["bytes_per_token"] > cfg.max_position_embeddings
)

# %% [markdown]
# With its 3 K/V heads, a full 8,192-token sequence of SmolLM2 costs 377.5 MB of fp32 cache, 70%
# of the 538 MB of fp32 weights; with 9 it would cost 1,132.5 MB, twice the weights, reached
# at 3,892 tokens. A GiB of cache holds 23,301 fp32 tokens instead of 7,767. The KV pool
# of Day 16 (`nanoserve.pool.plan_pool`) divides its memory budget by exactly this number
# times the block size.
#
# ## The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))

ax = axes[0, 0]
shown = weights[0].masked_fill(~mask, float("nan")).clamp_min(1e-6)  # (N, N), head 0
image = ax.imshow(shown, norm=LogNorm(vmin=1e-6, vmax=1), cmap="viridis", interpolation="nearest")
fig.colorbar(image, ax=ax, fraction=0.046, label="attention weight (log)")
ax.set_xlabel("key position")
ax.set_ylabel("query position")
ax.set_title("Block 0, head 0: weights after the causal mask (white: masked)")

ax = axes[0, 1]
for hd in range(NH):
    ax.plot([0, 1], [hd, kv_of[hd] * GROUP + 1], color=f"C{kv_of[hd].item()}", lw=2)
    ax.plot([0, 1], [hd, (hd % NKV) * GROUP + 1], color="0.6", lw=1, ls="--", zorder=0)
for hd in range(NH):
    ax.text(-0.03, hd, f"query head {hd}", ha="right", va="center", fontsize=9)
for g in range(NKV):
    ax.text(1.03, g * GROUP + 1, f"K/V head {g}", ha="left", va="center", fontsize=10, color=f"C{g}")
ax.plot([], [], color="k", lw=2, label="h // 3 (repeat_interleave): the model's grouping")
ax.plot([], [], color="0.6", lw=1, ls="--", label="h % 3 (repeat): tiled, wrong for 6 of 9")
ax.set_xlim(-0.45, 1.4)
ax.set_ylim(NH - 0.5, -1.8)
ax.axis("off")
ax.legend(loc="upper center", fontsize=8, frameon=False)
ax.set_title("9 query heads share 3 K/V heads")

ax = axes[1, 0]
context = torch.arange(0, cfg.max_position_embeddings + 1, 64)
for r in rows:
    style = "-" if r["dtype"] == "float32" else "--"
    ax.plot(
        context,
        context * r["bytes_per_token"] / 1e6,
        style,
        color={"MHA": "tab:red", "GQA": "tab:blue", "MQA": "tab:green"}[r["layout"]],
        label=f"{r['layout']} ({r['kv_heads']} K/V heads), {r['dtype']}: {r['bytes_per_token']:,} B/token",
    )
ax.axhline(weights_fp32 / 1e6, color="k", lw=1, label="the weights in fp32 (538 MB)")
ax.axhline(weights_fp32 / 2e6, color="k", lw=1, ls=":", label="the weights in bf16 (269 MB)")
ax.set_xlabel("tokens in one sequence")
ax.set_ylabel("K/V cache, MB")
ax.set_title("KV cache of one sequence against its length")
ax.legend(fontsize=7, loc="upper left")

ax = axes[1, 1]
floor = 1e-9
ax.semilogy(positions, per_query.clamp_min(floor), "o-", ms=3, color="tab:red", label="no causal mask")
tiled_err = (tiled - out).abs().amax(dim=(1, 2)).clamp_min(floor)
ax.semilogy(positions, tiled_err, "s-", ms=3, color="tab:orange", label="K/V heads tiled (h % 3)")
pkg_err = (package - out).abs().amax(dim=(1, 2)).clamp_min(floor)
ax.semilogy(positions, pkg_err, "^-", ms=3, color="tab:green", label="causal_attention (package)")
ax.axhline(1e-5 * out.abs().max().item(), color="k", ls="--", lw=1, label="gate: 1e-5 x max |out|")
ax.set_xlabel("query position")
ax.set_ylabel(f"max |out - hand| over heads and channels (log; {floor:g} = exact)")
ax.set_title("Which positions each version gets wrong")
ax.legend(fontsize=8, loc="center left")

fig.suptitle(
    "Day 5: grouped-query attention in SmolLM2-135M (block 0, 9 query heads, 3 K/V heads)", fontsize=14
)
fig.tight_layout()
png = diagram_path("day05-gqa.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **transformers**' `LlamaAttention` (`models/llama/modeling_llama.py`) sets
#   `num_key_value_groups = num_attention_heads // num_key_value_heads`, and its eager path,
#   `eager_attention_forward`, expands K and V with `repeat_kv` ("the equivalent of
#   `torch.repeat_interleave(x, dim=1, repeats=n_rep)`", section 1), adds the float mask to the
#   scaled scores and takes the softmax in fp32. The SDPA path, `sdpa_attention_forward`
#   (`integrations/sdpa_attention.py`), passes `enable_gqa=True` when `use_gqa_in_sdpa` allows it
#   (on CPU and CUDA: no mask and a head size up to 256), regroups the query heads (`pack_gqa`)
#   for a single query token, and falls back to `repeat_kv` otherwise.
# * **vLLM**'s `LlamaAttention` (`vllm/model_executor/models/llama.py`) splits K/V heads across
#   tensor-parallel GPUs, and when there are more GPUs than K/V heads it replicates them:
#   `num_kv_heads = max(1, total_num_kv_heads // tp_size)`. Its cache is priced per layer by
#   `AttentionSpec.real_page_size_bytes` (`vllm/v1/kv_cache_interface.py`):
#   `2 * block_size * num_kv_heads * head_size * get_dtype_size(dtype)`, section 6's formula for
#   one layer and one block.
# * **nano-vllm** sizes its cache the same way in `ModelRunner.allocate_kv_cache`
#   (`nanovllm/engine/model_runner.py`): `block_bytes = 2 * num_hidden_layers * block_size *
#   num_kv_heads * head_dim * itemsize`, then one tensor of shape `(2, layers, blocks, block_size,
#   num_kv_heads, head_dim)`. Its `Attention` (`nanovllm/layers/attention.py`) hands K and V, with
#   their own head count, straight to flash-attn's `flash_attn_varlen_func` (prefill) and
#   `flash_attn_with_kvcache` (decode), both with `causal=True`; nothing is repeated in Python.
# * **llama.cpp** creates the K and V projections `n_embd_k_gqa` and `n_embd_v_gqa` wide
#   (`create_tensor_qkv` in `src/models/llama.cpp`). `build_attn_mha` (`src/llama-graph.cpp`)
#   computes `kq = ggml_mul_mat(ctx0, k, q)` on K as stored, then one `ggml_soft_max_ext(ctx0, kq,
#   kq_mask, kq_scale, ...)` that scales, masks and normalizes in one op. Its mask is additive,
#   not boolean: `llm_graph_input_attn_no_cache::set_input` fills it with `-INFINITY` and writes 0
#   where the key's position is not after the query's and both belong to the same sequence. The
#   cache's element type is a context parameter (`type_k`, `type_v` in `include/llama.h`), which
#   changes the last factor of section 6's product.
#
# ## Try it
#
# 1. **Break the scale on purpose.** Delete the division by `math.sqrt(q.shape[-1])` in
#    `attention_by_hand` and rerun section 3: every `check_attention_close` raises. Print
#    `weights.amax(-1).mean()` before and after: it grows without the scale, because the
#    softmax is sharper, each query putting more of its weight on its single best key.
# 2. **Price another shape.** After `import dataclasses`,
#    `kvbytes.kv_rows(dataclasses.replace(cfg, num_layers=32, num_heads=32, num_kv_heads=8,
#    head_dim=128), dtypes=(torch.bfloat16,), context=8192)` prices a Llama-3-8B-sized model:
#    assert that its GQA row has `bytes_per_token == 131_072` (128 KiB a token, so 1 GiB for
#    one 8,192-token sequence) and that its MHA row is 4 times that.
# 3. **Decode needs no mask.** `causal_attention(q[-1:], k.transpose(0, 1), v.transpose(0, 1),
#    positions[-1:])` runs without a mask (one query); check it equals `out[-1:]` within the gate.
#    Then do the same for query 10 by passing only keys and values 0..10: this is what a decode
#    step with a cache of 11 tokens computes.

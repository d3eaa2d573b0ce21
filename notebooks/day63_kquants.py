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
# # Day 63 — K-quant super-blocks by hand: what a Q4_K_M file holds, read byte by byte
#
# Day 60 read the two block types of SmolLM2's file, Q4_1 and Q8_0, 32 weights to a block. The
# GGUF files most people download today are named Q4_K_M, and that name is a recipe, not a
# type: llama.cpp's quantizer picks a type per tensor, mostly "K-quants" whose block is a
# super-block of 256 weights cut into sub-blocks that each carry a small integer scale, itself
# scaled by one float16 for the whole super-block. Qwen2.5-Coder-0.5B-Instruct's Q4_K_M file is
# today's example; the engine fetches it with `nanoserve.fetch.fetch_named_gguf`.
#
# `nanoserve.kquants` (new today) decodes Q4_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks with
# torch ops, and `QuantTensor` keeps such matrices and widens them through it (a later change
# gives these types native kernels, `csrc/kquant.cpp`, held to `kquants` bit for bit). This notebook
# reads the blocks a third way, with `struct` and integer arithmetic, one value at a time, and
# holds all three (by hand, `kquants`, and `gguf`'s numpy decoding) to the same float32 bits.
#
# 1. the file: which tensor gets which type, and the rule that chose them,
# 2. bits a weight, from the block sizes, and the whole file's average,
# 3. one Q4_K super-block by hand: two float16s, twelve bytes of packed 6-bit scales and mins,
#    128 bytes of 4-bit codes,
# 4. one Q6_K super-block by hand, and one Q5_0 block,
# 5. why bit-equal decoding is possible: what float32 rounds and what it does not,
# 6. checks failing on decoders built wrong,
# 7. the script's tables (`days/day63/kquantbench.py`),
# 8. the diagram.

# %%
import struct
import sys
import time
from collections import Counter

import matplotlib
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Image, display

from nanocourse import REPO, diagram_path, read_csv
from nanoserve import kquants
from nanoserve.fetch import fetch_named_gguf
from nanoserve.quant import QuantTensor

sys.path.insert(0, str(REPO / "days" / "day63"))
import kquantbench  # the day's script: the notebook calls its functions and reads its tables

GGUF = fetch_named_gguf("qwen2.5-coder-0.5b-instruct")
# gguf's reader parses the file's metadata (a 151,936-entry vocabulary) field by field on opening
t0 = time.perf_counter()
reader = kquantbench.open_qwen()
print(f"{GGUF.name}: {GGUF.stat().st_size:,} bytes, {len(reader.tensors)} tensors, opened in "
      f"{time.perf_counter() - t0:.1f} s")  # fmt: skip
tensors = {t.name: t for t in reader.tensors}



def block(t, row=0, index=0):
    """The bytes of block `index` of row `row` of tensor t (a row's blocks lie side by side)."""
    nbytes = kquantbench.BLOCKS[t.tensor_type.name.lower()][1]
    return bytes(t.data[row, index * nbytes : (index + 1) * nbytes])


def gguf_block(raw, kind):
    """gguf's numpy decoding of one block's bytes."""
    return dequantize(np.frombuffer(raw, dtype=np.uint8)[None], GGMLQuantizationType[kind.upper()])[0]


def torch_block(t, row=0, index=0):
    """nanoserve.kquants' decoding of the same block, taken from its whole row's decoding."""
    kind = t.tensor_type.name.lower()
    blocks = torch.from_numpy(np.array(t.data[row], dtype=np.uint8)).reshape(-1, kquantbench.BLOCKS[kind][1])
    return kquants.dequantize_blocks(blocks, kind)[index]


# %% [markdown]
# ## 1. What the file holds
#
# Five types over 291 tensors. Only 24 of them are K-quants.

# %%
count = Counter(t.tensor_type.name for t in reader.tensors)
print(f"{'type':<5} {'tensors':>7} {'weights':>12} {'bytes':>12} {'bits/weight':>11}")
for kind, n in count.most_common():
    ts = [t for t in reader.tensors if t.tensor_type.name == kind]
    e, b = sum(int(t.n_elements) for t in ts), sum(int(t.n_bytes) for t in ts)
    print(f"{kind:<5} {n:>7} {e:>12,} {b:>12,} {8 * b / e:>11.4f}")
assert count == {"Q5_0": 133, "F32": 121, "Q8_0": 13, "Q6_K": 12, "Q4_K": 12}

# %% [markdown]
# Layer by layer, the seven matrices of each block. GGUF lists a tensor's dimensions fastest
# first, so `attn_q`'s `[896, 896]` is 896 rows of 896 values and `ffn_down`'s `[4864, 896]` is
# 896 rows of 4864.

# %%
MATS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
print("layer " + "".join(f"{m:>12}" for m in MATS))
for layer in range(24):
    kinds = [tensors[f"blk.{layer}.{m}.weight"].tensor_type.name for m in MATS]
    print(f"{layer:>5} " + "".join(f"{k:>12}" for k in kinds))
for name in ("token_embd.weight", "output.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
    t = tensors[name]
    print(f"{name:<22} {t.tensor_type.name:<5} dims {list(map(int, t.shape))}, data {t.data.shape}")

# %% [markdown]
# Two things stand out. Every matrix whose rows are 896 values long is Q5_0 or Q8_0, and only
# `ffn_down`, whose rows are 4864 = 19 x 256 values, is a K-quant. A K-quant block holds 256
# values of one row, and 896 = 3.5 x 256: those rows cannot be cut into super-blocks, so the
# quantizer falls back to a 32-value type (Q4_K to Q5_0, Q6_K to Q8_0). And the layers that got
# the more precise type (Q6_K for `ffn_down`, Q8_0 for `attn_v`) are 0, 1, 3, 6-10, 13, 16, 19
# and 21, an odd set.
#
# llama.cpp's quantizer (`src/llama-quant.cpp`) decides per tensor: Q4_K by default for Q4_K_M;
# Q6_K for the output matrix (Q8_0 when its rows are not whole super-blocks); Q6_K for `attn_v`
# and `ffn_down` when `use_more_bits(i, n)`: the first eighth, the last eighth, and every third
# tensor between. Its `i` counts the tensors of that kind in the order it meets them, which is
# the file's order, and the file lists blocks as strings sort: `blk.0`, `blk.1`, `blk.10`, ...
# `kquantbench.q4_k_m_type` writes the rule down; it must predict every tensor's type.

# %%
pred = kquantbench.predicted_types(reader)
wrong = [t.name for t in reader.tensors if pred[t.name][1] != t.tensor_type.name.lower()]
print(f"the rule predicts {len(reader.tensors) - len(wrong)} of {len(reader.tensors)} tensors' types")
assert not wrong
downs = [t.name for t in reader.tensors if t.name.endswith("ffn_down.weight")]  # file order
print("ffn_down in file order:", [int(n.split(".")[1]) for n in downs])
by_position = sorted(int(downs[i].split(".")[1]) for i in range(24) if kquantbench.use_more_bits(i, 24))
by_layer = [i for i in range(24) if kquantbench.use_more_bits(i, 24)]
stored_q6 = sorted(int(n.split(".")[1]) for n in downs if tensors[n].tensor_type.name == "Q6_K")
print("Q6_K layers, counting positions in the file:", by_position)
print("Q6_K layers, counting layer numbers:        ", by_layer)
print("Q6_K layers the file holds:                 ", stored_q6)
assert stored_q6 == by_position != by_layer

# %% [markdown]
# So the layers the rule means to protect, the first and last three, are only partly the ones
# protected: of layers 0-2 and 21-23, only 0, 1 and 21 got Q6_K, while layers 3 and 6-10 in the
# middle did. That is a property of how this file was written, not of how it is read: the type
# is recorded per tensor, and a reader follows it.
#
# ## 2. Bits a weight
#
# A type's cost is its block's bytes over its block's values. Each row below splits it into the
# code bits every weight carries and the overhead of the scales shared by a block.

# %%
CODE_BITS = {"q4_0": 4, "q4_1": 4, "q5_0": 5, "q5_1": 5, "q8_0": 8, "q4_k": 4, "q5_k": 5, "q6_k": 6}
print(f"{'type':<5} {'values':>6} {'bytes':>5} {'bits/weight':>11} {'code':>5} {'scales':>7}")
for kind, (values, nbytes) in kquantbench.BLOCKS.items():
    b, code = 8 * nbytes / values, CODE_BITS[kind]
    print(f"{kind.upper():<5} {values:>6} {nbytes:>5} {b:>11.4f} {code:>5} {b - code:>7.4f}")
assert 8 * 144 / 256 == 4.5 and 8 * 210 / 256 == 6.5625 and 8 * 22 / 32 == 5.5 and 8 * 34 / 32 == 8.5

# %% [markdown]
# Q4_K costs what Q4_0 costs, 4.5 bits, yet gives every 32 weights both a scale and a minimum,
# which Q4_1 pays 5 bits for. The trick is the second level: a sub-block's scale and minimum are
# 6-bit integers (12 bytes hold sixteen of them), and only the super-block's two multipliers,
# `d` and `dmin`, are float16. Q6_K spends 8-bit scales on sub-blocks of 16 for 6.5625 bits.
#
# The whole file, and what it would be without the fallback, each tensor at the type the rule
# asks for (the output matrix's Q8_0 included, which the rule itself picks for rows like these):

# %%
elements = sum(int(t.n_elements) for t in reader.tensors)
stored = sum(int(t.n_bytes) for t in reader.tensors)
BITS = {k: 8 * b / v for k, (v, b) in kquantbench.BLOCKS.items()} | {"f32": 32.0}
asked = sum(int(t.n_elements) * BITS[pred[t.name][0]] / 8 for t in reader.tensors)
blk = [t for t in reader.tensors if t.name.startswith("blk.")]
blk_bits = 8 * sum(int(t.n_bytes) for t in blk) / sum(int(t.n_elements) for t in blk)
print(f"file: {elements:,} weights in {stored:,} bytes = {8 * stored / elements:.4f} bits a weight")
print(f"  the 24 blocks alone: {blk_bits:.4f} bits a weight")
ends = int(tensors["token_embd.weight"].n_bytes) + int(tensors["output.weight"].n_bytes)
print(f"  token_embd + output: {ends / stored:.1%} of the bytes")
print(f"at the asked types: {asked:,.0f} bytes = {8 * asked / elements:.4f} bits a weight "
      f"({(stored - asked) / 1e6:.1f} MB more stored)")  # fmt: skip
qwen = {r["matrix"]: r for r in read_csv(kquantbench.HERE / "day-63-qwen.csv")}
assert float(qwen["all"]["bits_per_weight"]) == round(8 * stored / elements, 4)

# %% [markdown]
# ## 3. One Q4_K super-block, by hand
#
# The first Q4_K tensor in the file is `blk.11.ffn_down.weight`: 896 rows of 19 super-blocks of
# 144 bytes. Block 0 of row 0, its first four bytes: `d` and `dmin`, two float16s.

# %%
t4 = next(t for t in reader.tensors if t.tensor_type.name == "Q4_K")
raw = block(t4)
print(t4.name, t4.data.shape, "->", len(raw), "bytes a block")
d, dmin = struct.unpack_from("<ee", raw, 0)
print(f"d = {d!r}, dmin = {dmin!r}")

# %% [markdown]
# Bytes 4-15 hold eight 6-bit scales and eight 6-bit minimums, 96 bits in 12 bytes. Sub-blocks
# 0-3 are simple: scale j is the low 6 bits of byte j, minimum j the low 6 bits of byte j + 4.
# Sub-blocks 4-7 are assembled: the low 4 bits from byte j + 8 (low nibble for the scale, high
# nibble for the minimum) and the top 2 bits from the two bits left over at the top of byte j
# (scale) and byte j + 4 (minimum).

# %%
packed = raw[4:16]
for i, b in enumerate(packed):
    print(f"byte {i:>2}: {b:08b}")
scales, mins = [], []
for j in range(4):
    scales.append(packed[j] & 0b111111)
    mins.append(packed[j + 4] & 0b111111)
for j in range(4):
    scales.append((packed[j + 8] & 0b1111) | (packed[j] >> 6) << 4)
    mins.append((packed[j + 8] >> 4) | (packed[j + 4] >> 6) << 4)
print("scales:", scales)
print("mins:  ", mins)
assert (scales, mins) == kquantbench.scale_min_k4(packed)

# %% [markdown]
# The 128 code bytes come in four runs of 32. Run k holds sub-block 2k in its low nibbles and
# sub-block 2k + 1 in its high ones. A value is `d * scale * code - dmin * min`, computed as
# gguf computes it in float32: `d * scale` and `dmin * min` first, each rounded to float32, then
# the product with the code, then the difference (`kquantbench.f32` rounds a Python float to
# float32 through `struct`).

# %%
f32 = kquantbench.f32
values = []
for j in range(8):
    run = raw[16 + 32 * (j // 2) : 16 + 32 * (j // 2) + 32]
    codes = [b & 0x0F for b in run] if j % 2 == 0 else [b >> 4 for b in run]
    step, low = f32(d * scales[j]), f32(dmin * mins[j])
    values += [f32(f32(step * q) - low) for q in codes]
    if j in (0, 7):
        print(f"sub-block {j}: scale {scales[j]}, min {mins[j]}, codes {codes[:6]} ... -> "
              f"{[f'{v:.6f}' for v in values[32 * j : 32 * j + 3]]} ...")  # fmt: skip
print(len(values), "values")

ours, theirs = torch_block(t4).numpy(), gguf_block(raw, "q4_k")
kquantbench.check_bit_equal(values, ours, "by hand against nanoserve.kquants")
kquantbench.check_bit_equal(values, theirs, "by hand against gguf")
assert np.array_equal(np.array(values, dtype=np.float32).view(np.uint32), theirs.view(np.uint32))
assert values == kquantbench.by_hand_q4_k(raw)
print("by hand == kquants.dequantize_blocks == gguf.quants.dequantize: 256 float32 bit patterns")

# %% [markdown]
# The same on the whole tensor: `nanoserve.kquants.dequantize` against gguf over all 17,024
# super-blocks, and `QuantTensor`, which holds the matrix as the file's bytes and widens it
# through `kquants`.

# %%
data4 = np.array(t4.data, dtype=np.uint8)
full4 = dequantize(data4, t4.tensor_type)  # (896, 4864)
kquantbench.check_bit_equal(kquants.dequantize(torch.from_numpy(data4), "q4_k", full4.shape), full4, t4.name)
q = QuantTensor.from_gguf(t4)
kquantbench.check_bit_equal(q.dequantize(), full4, "QuantTensor")
print(q, f"blocks {tuple(q.blocks.shape)}")
print(f"{full4.size:,} values bit-equal to gguf's")

# %% [markdown]
# ## 4. One Q6_K super-block, and one Q5_0 block
#
# Q6_K has no minimum. Its 210 bytes are 128 bytes of low 4 bits (`ql`), 64 bytes of high 2
# bits (`qh`), sixteen signed bytes of scale, one per 16 values, and `d` last. The 256 values
# are two halves of 128. In half h, value j takes its low 4 bits from `ql[64h + j % 64]` (the low
# nibble for j < 64, the high one after) and its high 2 bits from `qh[32h + j % 32]`, at bit
# 2 * (j // 32): each `qh` byte feeds four values 32 apart. The code, 0 to 63, is centred by
# subtracting 32, and the value is `d * scale * (code - 32)`.
#
# The first Q6_K tensor is `blk.0.ffn_down.weight`; block 0 of row 0:

# %%
t6 = next(t for t in reader.tensors if t.tensor_type.name == "Q6_K")
raw6 = block(t6)
ql, qh = raw6[:128], raw6[128:192]
scales6 = struct.unpack_from("<16b", raw6, 192)  # signed bytes
(d6,) = struct.unpack_from("<e", raw6, 208)
print(t6.name, t6.data.shape, "->", len(raw6), "bytes a block")
print(f"d = {d6!r}, scales {list(scales6)}")
values6 = []
for i in range(256):
    h, j = divmod(i, 128)
    low = ql[64 * h + j % 64]
    low = low & 0x0F if j < 64 else low >> 4
    high = (qh[32 * h + j % 32] >> (2 * (j // 32))) & 0b11
    code = low | high << 4
    values6.append(f32(f32(d6 * scales6[i // 16]) * (code - 32)))
print("codes 0-7:", [kquantbench.q6_k_code(raw6, i) for i in range(8)])
print("values 0-3:", [f"{v:.6f}" for v in values6[:4]])
kquantbench.check_bit_equal(values6, torch_block(t6), "by hand against nanoserve.kquants")
kquantbench.check_bit_equal(values6, gguf_block(raw6, "q6_k"), "by hand against gguf")
assert values6 == kquantbench.by_hand_q6_k(raw6)
data6 = np.array(t6.data, dtype=np.uint8)
full6 = dequantize(data6, t6.tensor_type)
kquantbench.check_bit_equal(kquants.dequantize(torch.from_numpy(data6), "q6_k", full6.shape), full6, t6.name)
print(f"by hand == kquants == gguf for the block; {full6.size:,} values of {t6.name} bit-equal")

# %% [markdown]
# Q5_0 is the type most of this file is: 22 bytes for 32 weights, a float16 `d`, a 32-bit word
# whose bit i is value i's fifth bit, and 16 bytes of low nibbles (values 0-15) and high nibbles
# (16-31). The code, 0 to 31, is centred by subtracting 16. Block 0 of row 0 of
# `blk.0.attn_q.weight`:

# %%
t5 = tensors["blk.0.attn_q.weight"]
raw5 = block(t5)
(d5,) = struct.unpack_from("<e", raw5, 0)
(fifth,) = struct.unpack_from("<I", raw5, 2)
low5 = [b & 0x0F for b in raw5[6:]] + [b >> 4 for b in raw5[6:]]
codes5 = [q | ((fifth >> i) & 1) << 4 for i, q in enumerate(low5)]
values5 = [f32(d5 * (q - 16)) for q in codes5]
print(f"d = {d5!r}, fifth bits {fifth:032b} (value 31 first)")
print("codes:", codes5)
kquantbench.check_bit_equal(values5, torch_block(t5), "by hand against nanoserve.kquants")
kquantbench.check_bit_equal(values5, gguf_block(raw5, "q5_0"), "by hand against gguf")
assert values5 == kquantbench.by_hand_q5_0(raw5)
print("by hand == kquants == gguf:", len(values5), "values")

# %% [markdown]
# ## 5. What float32 rounds
#
# Three decoders agreeing to the bit is less of a coincidence than it looks, because most of
# the arithmetic cannot round. A float16 has 11 significant bits and float32 has 24. A Q6_K
# value is d (11 bits) times a scale of at most 128 in size (7 bits) times a code minus 32 of at
# most 32 in size (5 bits): at most 23 bits, so every product is exact in float32, in any order.
# Q5_0's `d * (q - 16)` needs at most 15. Q4_K's two products need at most 21 and 17 bits; only
# the final difference can round.
#
# And it cannot round either while the weight is below 1 in size. Every float16 is a whole
# multiple of 2**-24 (its smallest step), and scales, minimums and codes are integers, so both
# terms and their difference are whole multiples of 2**-24. Below 1 such a multiple is N * 2**-24
# with N under 2**24, which float32's 24 bits hold exactly. This tensor's largest weight is under
# 1, and the float64 decoding equals the float32 one in every value. Across the file's twelve
# Q4_K tensors only a handful of weights reach 1, and they did not round either:

# %%
b4 = data4.reshape(-1, 144)  # (17024, 144): one super-block a row
d_all = b4[:, 0:2].copy().view(np.float16).astype(np.float64)  # (17024, 1)
dmin_all = b4[:, 2:4].copy().view(np.float16).astype(np.float64)
sc, mn = (x.numpy().astype(np.float64) for x in kquants._scale_min_k4(torch.from_numpy(b4[:, 4:16].copy())))
runs = b4[:, 16:].reshape(-1, 4, 1, 32)  # (17024, 4 runs, 1, 32 bytes)
codes_all = np.concatenate([runs & 0x0F, runs >> 4], 2).reshape(-1, 8, 32).astype(np.float64)  # 8 sub-blocks
exact = (d_all * sc)[..., None] * codes_all - (dmin_all * mn)[..., None]
print(f"largest |weight| in {t4.name}: {np.abs(full4).max():.6f}")
assert np.abs(full4).max() < 1
assert np.array_equal(exact.reshape(full4.shape), full4.astype(np.float64))
print(f"{exact.size:,} Q4_K values: float32 equals float64 in every one")
print(f"block 0 by hand in float64 == in float32: {kquantbench.by_hand_q4_k(raw, r=float) == values}")

# the file's other Q4_K tensors: the argument covers every weight below 1; the blocks holding
# one of 1 or more are decoded by hand in float64 and in float32
big_values, big_blocks, moved = 0, 0, 0
q4ks = [t for t in reader.tensors if t.tensor_type.name == "Q4_K"]
for t in q4ks:
    sb = np.array(t.data, dtype=np.uint8).reshape(-1, 144)
    big = np.abs(dequantize(sb, t.tensor_type)) >= 1  # (super-blocks, 256)
    big_values += int(big.sum())
    for i in np.flatnonzero(big.any(1)):
        big_blocks += 1
        narrow, wide = kquantbench.by_hand_q4_k(bytes(sb[i])), kquantbench.by_hand_q4_k(bytes(sb[i]), r=float)
        moved += sum(a != b for a, b in zip(narrow, wide))
print(f"the file's {len(q4ks)} Q4_K tensors: {big_values} weights of 1 or more in size, in {big_blocks} "
      f"super-blocks; by hand, float32 differs from float64 in {moved} values")  # fmt: skip
assert moved == 0

# %% [markdown]
# Weights of 1 or more can round, and random blocks have some: the script's random blocks draw
# their float16 fields around 0.02, so a scale times a code can reach past 1. Sixty-four random
# blocks of each type that has a minimum, decoded by hand in float32 and in float64:

# %%
for kind in ("q4_1", "q5_1", "q4_k", "q5_k"):
    rand = kquantbench.random_blocks(kind, 1024)[:64]
    narrow = np.array([v for b in rand for v in kquantbench.BY_HAND[kind](bytes(b))])
    wide = np.array([v for b in rand for v in kquantbench.BY_HAND[kind](bytes(b), r=float)])
    moved = narrow != wide
    smallest = f", the smallest of them {np.abs(wide[moved]).min():.3f} in size" if moved.any() else ""
    print(f"{kind.upper()}: {int(moved.sum())} of {wide.size:,} values rounded{smallest}; "
          f"{int((np.abs(wide) >= 1).sum()):,} are 1 or more in size")  # fmt: skip
    assert (np.abs(wide[moved]) >= 1).all()

# %% [markdown]
# Where a value rounds, the order of operations decides its last bit. That is why
# `nanoserve.kquants` follows gguf's order (`d * scale` before the code), and why the checks
# compare bit patterns rather than allow a tolerance: where nothing rounds, as in the tensor
# above, a decoder that is one bit off anywhere has read some field wrong.
#
# ## 6. Checks failing on a wrong decoder
#
# The easiest mistake in Q4_K is in the twelve scale bytes: read the low nibble of bytes 8-11 as
# the minimum and the high nibble as the scale. Sub-blocks 0-3 stay right, every value stays in
# range, and nothing raises. `check_bit_equal`, the gate the script and this notebook use,
# catches it on the one block:


# %%
def swapped_scale_min(packed):
    """Sub-blocks 4-7 with the nibbles of bytes 8-11 exchanged: the mistake."""
    scales, mins = kquantbench.scale_min_k4(packed)
    for j in range(4):
        scales[4 + j] = (packed[j + 8] >> 4) | (packed[j] >> 6) << 4
        mins[4 + j] = (packed[j + 8] & 0x0F) | (packed[j + 4] >> 6) << 4
    return scales, mins


print("right:  ", kquantbench.scale_min_k4(packed))
print("swapped:", swapped_scale_min(packed))
try:
    kquantbench.check_bit_equal(kquantbench.by_hand_q4_k(raw, unpack=swapped_scale_min), theirs, "swapped")
except AssertionError as err:
    print("caught:", err)

# %% [markdown]
# 96 values, not 128: sub-block 6's scale and minimum are both 63, byte 10 is 11111111, and
# exchanging its two nibbles changes nothing. One block can hide a bug that a whole tensor shows.
# The same mistake in `nanoserve.kquants` (its `_scale_min_k4` replaced for one call), against
# gguf over the tensor:

# %%
right = kquants._scale_min_k4


def swapped_torch(scales):
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md >> 4) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md & 0x0F) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


kquants._scale_min_k4 = swapped_torch
try:
    wrong4 = kquants.dequantize(torch.from_numpy(data4), "q4_k", full4.shape)
finally:
    kquants._scale_min_k4 = right
try:
    kquantbench.check_bit_equal(wrong4, full4, f"{t4.name} with swapped nibbles")
except AssertionError as err:
    print("caught:", err)

# %% [markdown]
# And a Q6_K decoder that reads its scales as unsigned bytes (`"<16B"`). Every block of this
# tensor has negative scales (the block above has ten of sixteen), so one block is enough:

# %%
neg = (data6.reshape(-1, 210)[:, 192:208].view(np.int8) < 0).any(1)
print(f"blocks with a negative scale: {int(neg.sum()):,} of {neg.size:,}")
try:
    unsigned = kquantbench.by_hand_q6_k(raw6, scale_format="<16B")
    kquantbench.check_bit_equal(unsigned, gguf_block(raw6, "q6_k"), "Q6_K with unsigned scales")
except AssertionError as err:
    print("caught:", err)

# %% [markdown]
# ## 7. The script's tables
#
# `kquantbench.py` decodes each type three ways: 64 blocks by hand, the first two tensors of
# the type with torch (the blocks' matrices before the embedding and output), and gguf; a type
# the file does not hold is checked on seeded random blocks. Its two tables, recomputed here
# (the timing columns, one tensor's decoding, are the script's run and are not recomputed):

# %%
types = read_csv(kquantbench.HERE / "day-63-types.csv")
live = kquantbench.type_rows(reader, 64, 2, reps=1)
cols = ["type", "values_per_block", "bytes_per_block", "bits_per_weight", "qwen_tensors", "qwen_mb"]
cols += ["qwen_share", "checked_on", "by_hand_values", "by_hand_max_diff", "rounded", "torch_values"]
cols += ["torch_max_diff"]
for a, b in zip(types, live):
    assert all(a[c] == str(b[c]) for c in cols), (a, b)
print(" | ".join(cols + ["torch_ms", "gguf_ms"]))
for r in types:
    print(" | ".join(r[c] for c in cols + ["torch_ms", "gguf_ms"]))
print("the script's timings were measured on:", types[0]["cpu"])

# %%
rows = kquantbench.qwen_rows(reader)
for a, b in zip(read_csv(kquantbench.HERE / "day-63-qwen.csv"), rows):
    assert a == {k: str(v) for k, v in b.items()}, (a, b)
print(" | ".join(rows[0]))
for r in rows:
    print(" | ".join(str(v) for v in r.values()))

# %% [markdown]
# Every difference is zero: the by-hand decoders over 64 blocks of each type, and the torch
# decoders over two tensors of each type the file holds, equal gguf's to the bit. The K-quants
# are 6.1% (Q4_K) and 8.8% (Q6_K) of the file's bytes; Q5_0 is 54.9% and Q8_0 30.1%, most of
# that the output matrix.
#
# The last two columns are milliseconds for decoding one tensor of 4,358,144 values, timed by
# the script on a 2-core AMD EPYC with AVX-512, at 2 threads (its cpu line is printed above). Which of
# the two decoders is quicker depends on the type. For the K-quants `nanoserve.kquants` was the
# faster: 2.2 ms against gguf's 7.4 for Q4_K, 4.0 against 8.3 for Q6_K. For Q5_0 it was the
# slower, 60.0 ms against 14.4. Reading `kquants.py` suggests where to look: its K-quant paths
# keep the codes in bytes until one widening to float32, while its Q5_0 path builds the fifth
# bits as 64-bit integers, 32 of them for every block. These are the timings of one run, not
# facts the notebook checks.
#
# ## 8. The diagram

# %%
fig, axes = plt.subplot_mosaic([["q4k", "q4k", "q4k"], ["q6k", "q6k", "q6k"], ["bits12", "grid", "bpw"]],
                               figsize=(15, 11), height_ratios=[1, 1, 4.2])  # fmt: skip


def strip(ax, cells, title):
    x0 = 0
    for width, label, color in cells:
        ax.add_patch(plt.Rectangle((x0, 0), width, 1, facecolor=color, edgecolor="black"))
        turn = 90 if width < 4 else 0  # d, dmin: too narrow for a label across
        ax.text(x0 + width / 2, 0.5, label, ha="center", va="center", fontsize=8, rotation=turn)
        x0 += width
    ax.set_xlim(0, x0)
    ax.set_ylim(0, 1)
    ax.set_xticks(range(0, x0 + 1, 16))
    ax.set_yticks([])
    ax.set_xlabel("byte")
    ax.set_title(title, fontsize=11)


strip(
    axes["q4k"],
    [(2, "d", "#f4a582"), (2, "dmin", "#92c5de"), (12, "scales+mins", "#fddbc7")]
    + [(32, f"codes: sub-block {2 * k} (low) | {2 * k + 1} (high)", "#a6dba0" if k % 2 else "#d9f0d3")
       for k in range(4)],
    "Q4_K super-block, 144 bytes for 256 weights (4.5 bits): w = d*scale_j*code - dmin*min_j, "
    "8 sub-blocks of 32",
)  # fmt: skip
strip(
    axes["q6k"],
    [(64, f"ql: values {128 * h}-{128 * h + 63} low nibbles, {128 * h + 64}-{128 * h + 127} high", c)
     for h, c in ((0, "#d9f0d3"), (1, "#a6dba0"))]
    + [(32, f"qh: 2 bits x 4 values, half {h}", c) for h, c in ((0, "#e7d4e8"), (1, "#c2a5cf"))]
    + [(16, "16 int8 scales", "#fddbc7"), (2, "d", "#f4a582")],
    "Q6_K super-block, 210 bytes for 256 weights (6.5625 bits): w = d*scale_i*(code - 32), "
    "16 sub-blocks of 16",
)  # fmt: skip

# the 12 scale bytes bit by bit: which scale (s) or min (m) each bit belongs to
ax = axes["bits12"]
owner = np.zeros((12, 8), dtype=int)  # 0 scale 0-3, 1 min 0-3, 2 scale 4-7, 3 min 4-7
label = [["" for _ in range(8)] for _ in range(12)]
for j in range(4):
    for bit in range(8):
        owner[j, bit], label[j][bit] = (0, f"s{j}") if bit < 6 else (2, f"s{j + 4}")
        owner[j + 4, bit], label[j + 4][bit] = (1, f"m{j}") if bit < 6 else (3, f"m{j + 4}")
        owner[j + 8, bit], label[j + 8][bit] = (2, f"s{j + 4}") if bit < 4 else (3, f"m{j + 4}")
cmap = matplotlib.colors.ListedColormap(["#4393c3", "#d6604d", "#92c5de", "#f4a582"])
ax.imshow(owner[:, ::-1], cmap=cmap, aspect="auto")  # bit 7 on the left
for i in range(12):
    for bit in range(8):
        ax.text(7 - bit, i, label[i][bit], ha="center", va="center", fontsize=7)
ax.set_xticks(range(8), [str(7 - k) for k in range(8)])
ax.set_yticks(range(12), [f"byte {4 + i}" for i in range(12)])
ax.set_xlabel("bit")
ax.set_title("Q4_K's 12 scale bytes: 6-bit scales s0-s7, mins m0-m7", fontsize=10)

# the file: each block's seven matrices by type
ax = axes["grid"]
order = ["Q5_0", "Q8_0", "Q4_K", "Q6_K"]
colors = ["#d9f0d3", "#5aae61", "#92c5de", "#2166ac"]
grid = np.array([[order.index(tensors[f"blk.{i}.{m}.weight"].tensor_type.name) for m in MATS]
                 for i in range(24)])  # fmt: skip
ax.imshow(grid, cmap=matplotlib.colors.ListedColormap(colors), aspect="auto", vmin=0, vmax=3)
for i in range(24):
    for k in range(len(MATS)):
        ax.text(k, i, order[grid[i, k]], ha="center", va="center", fontsize=6)
ax.set_xticks(range(len(MATS)), [m.replace("attn_", "").replace("ffn_", "") for m in MATS], fontsize=8)
ax.set_yticks(range(24), [str(i) for i in range(24)], fontsize=7)
ax.set_ylabel("layer")
ax.set_title("Qwen2.5-Coder-0.5B Q4_K_M: a type per matrix", fontsize=10)

# bits a weight per block type, the file's share of bytes in each
ax = axes["bpw"]
blocks_only = [r for r in types if r["type"] != "F32"]
names = [r["type"] for r in blocks_only]
bpw = [float(r["bits_per_weight"]) for r in blocks_only]
share = [float(r["qwen_share"]) for r in blocks_only]
bars = ax.barh(names, bpw, color=["#2166ac" if s > 0 else "#cccccc" for s in share])
for bar, b, s in zip(bars, bpw, share):
    ax.text(b + 0.3, bar.get_y() + bar.get_height() / 2, f"{b:g}" + (f"  ({s:g}% of file)" if s else ""),
            va="center", fontsize=8)  # fmt: skip
ax.axvline(float(qwen["all"]["bits_per_weight"]), color="black", ls="--", lw=1)  # the whole file
average = float(qwen["all"]["bits_per_weight"])
ax.text(average + 0.1, -0.7, f"whole file: {average}", fontsize=8)
ax.set_xlim(0, 13)
ax.set_ylim(len(names) - 0.5, -1)
ax.set_xlabel("bits a weight (blue: types in the file; F32 is 0.1% of it)")
ax.set_title("bits a weight, and each type's share of the file's bytes", fontsize=10)
fig.tight_layout()
path = diagram_path("day63-kquants.png")
fig.savefig(path, dpi=100)
plt.close(fig)
display(Image(filename=str(path)))

# %% [markdown]
# ## In the real systems
#
# * **llama.cpp** declares the super-blocks in `ggml/src/ggml-common.h`: `block_q4_K` is a
#   float16 pair `d`, `dmin` (a union with `ggml_half2 dm`), `scales[K_SCALE_SIZE]` (12) and
#   `qs[QK_K/2]`; `block_q6_K` is `ql[QK_K/2]`, `qh[QK_K/4]`, `int8_t scales[QK_K/16]` and `d`
#   last, the byte order read above. Its CPU products never widen a K-quant to floats: the type
#   table in `ggml-cpu.c` gives Q4_K and Q6_K the `vec_dot_type` `GGML_TYPE_Q8_K`, so a row of
#   activations is first quantized into `block_q8_K` (a float scale, 256 int8 codes and sixteen
#   int16 sums of 16 codes, which the minimum terms need), and `ggml_vec_dot_q4_K_q8_K` works on
#   integers. The type of each tensor is chosen at quantization time in `src/llama-quant.cpp`:
#   `llama_tensor_get_type` (through `llama_tensor_get_type_impl` and its `use_more_bits` lambda
#   in the version read) applies the Q4_K_M recipe, and `tensor_type_fallback` maps Q4_K to
#   Q5_0, Q5_K to Q5_1 and Q6_K to Q8_0 when a row is not a whole number of 256-value blocks,
#   with a warning per tensor.
# * **vLLM** reads GGUF files through `GGUFConfig` (`vllm/model_executor/layers/quantization/gguf.py`),
#   which lists `KQUANT_TYPES` (Q2_K to Q6_K) beside the 32-value types and the i-quants.
#   `GGUFLinearMethod` keeps each weight as the file's bytes with its type, and a merged
#   QKV or gate/up linear keeps one type per shard (`shard_weight_type`): its `apply` multiplies
#   each shard by its own kernel and concatenates the results, the same answer to a Q4_K_M file
#   that stores V in another type than Q and K. On CUDA the product is `ops.ggml_mul_mat_vec_a8`
#   for a few rows, `ops.ggml_mul_mat_a8` for more, and `ops.ggml_dequantize` plus a matmul
#   where neither kernel covers the type (`csrc/quantization/gguf/`, ported from llama.cpp).
# * **transformers** loads a GGUF checkpoint (`from_pretrained(..., gguf_file=...)`) by
#   dequantizing every tensor to floats with the `gguf` package's `dequantize`
#   (`modeling_gguf_pytorch_utils.py`), the numpy decoding this notebook compares against; the
#   model then runs unquantized.
# * **gguf-py** (`gguf/quants.py` in llama.cpp's repository) is that numpy reference: one class a
#   type, `Q4_K.get_scale_min` unpacking the twelve bytes as section 3 does, on whole arrays.

# %% [markdown]
# ## Try it
#
# 1. **A Q5_K block by hand.** Q5_K is Q4_K with 32 bytes of fifth bits after the scale bytes:
#    bit j of byte i is value i of sub-block j's fifth bit. Write the decoder from section 3's
#    cell, run it on `kquantbench.random_blocks("q5_k", 8)`, and check it with
#    `kquantbench.check_bit_equal(..., dequantize(blocks, GGMLQuantizationType.Q5_K), ...)`;
#    then compare with `kquantbench.by_hand_q5_k`.
# 2. **Break the fifth bit.** In section 4's Q5_0 cell take the fifth bit from `(fifth >> (31 -
#    i)) & 1` instead. Predict how many of the 32 values change (count the positions where bit i
#    and bit 31 - i of `fifth` differ: 22 in this block), then check the number
#    `check_bit_equal` reports.
# 3. **The rule by layer number.** Change `kquantbench.predicted_types` to count layers by their
#    number (`int(t.name.split(".")[1])`) instead of their position in the file, and rerun
#    section 1's check: it must now miss 32 tensors, the `ffn_down` and `attn_v` of the 16
#    layers in one set of section 1's printout and not the other. The file would be no smaller:
#    12 of each 24 get the larger type either way.

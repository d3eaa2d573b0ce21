"""Day 63's tables: the GGUF block types decoded by hand, and what a Q4_K_M file holds.

Two CSVs:

* `day-63-types.csv`: one row per block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
  and F32 for scale): values and bytes a block, bits a weight, how many of Qwen2.5-Coder-0.5B-
  Instruct's Q4_K_M tensors hold it, and two decodings held against `gguf.quants.dequantize`
  bit for bit. `by_hand_*`: this file's pure-Python decoders (`struct` and integer arithmetic,
  one value at a time) over `--blocks` blocks, and `rounded`, how many of those values the
  float32 arithmetic rounds (they differ from the same decoding in float64); `torch_*`:
  nanoserve's torch decoding (`nanoserve.kquants`, or `quant.dequantize_torch` for Q4_1 and
  Q8_0) over the first `--tensors` tensors of the type (the blocks' matrices before the
  embedding and output). A type the file does not hold is checked on seeded random blocks
  instead. `torch_ms` and `gguf_ms` (best of `--reps`) time the decoding of the first of those
  tensors, `ms_values` values, for the types `nanoserve.kquants` decodes; they are timings,
  not facts, and stay empty for random blocks.
* `day-63-qwen.csv`: one row per matrix role of the file (token_embd, attn_q, ..., output): its
  row length, the type llama.cpp's Q4_K_M rule asks for (`q4_k_m_type`) and the types the file
  stores, MB and bits a weight; a last row for the whole file.

    python days/day63/kquantbench.py [--blocks 64] [--tensors 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import struct
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from nanocourse import write_csv
from nanoserve import kquants
from nanoserve.fetch import fetch_named_gguf
from nanoserve.gguf_file import _open_gguf
from nanoserve.quant import dequantize_torch

HERE = Path(__file__).resolve().parent
MODEL = "qwen2.5-coder-0.5b-instruct"
QK_K = 256  # values a K-quant super-block
# type -> (values a block, bytes a block), the order of the table
BLOCKS = {
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q8_0": (32, 34),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}
# the float16 fields of each type, where random bytes could be NaN or infinite
HALVES = {"q4_0": [0], "q4_1": [0, 2], "q5_0": [0], "q5_1": [0, 2], "q8_0": [0]}
HALVES |= {"q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}
ROLES = ["token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
ROLES += ["output", "norms and biases"]


# --- by hand: one block's bytes -> its values, as Python floats rounded to float32 ---


def f32(x: float) -> float:
    """x rounded to the nearest float32 (Python computes in float64; one rounding to float32
    after each operation gives exactly the float32 operation's result)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def half(raw: bytes, at: int) -> float:
    """The little-endian float16 at byte `at`."""
    return struct.unpack_from("<e", raw, at)[0]


def nibbles(qs: bytes) -> list[int]:
    """k bytes -> 2k codes: the low nibbles first, then the high ones."""
    return [b & 0x0F for b in qs] + [b >> 4 for b in qs]


def fifth_bits(qh: int, codes: list[int]) -> list[int]:
    """Q5_0/Q5_1: bit i of the 32-bit word qh is code i's fifth bit."""
    return [q | ((qh >> i) & 1) << 4 for i, q in enumerate(codes)]


def scale_min_k4(packed: bytes) -> tuple[list[int], list[int]]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins. Sub-blocks 0-3: the low
    6 bits of bytes 0-3 (scales) and 4-7 (mins). Sub-blocks 4-7: the low nibble (scale) and high
    nibble (min) of bytes 8-11, with the top 2 bits of bytes 0-3 (scale) and 4-7 (min) on top."""
    scales = [packed[j] & 0x3F for j in range(4)]
    mins = [packed[j + 4] & 0x3F for j in range(4)]
    for j in range(4):
        scales.append((packed[j + 8] & 0x0F) | (packed[j] >> 6) << 4)
        mins.append((packed[j + 8] >> 4) | (packed[j + 4] >> 6) << 4)
    return scales, mins


# Each decoder rounds after every operation with `r`: f32 gives the float32 results gguf's
# numpy computes; r=float keeps Python's float64, against which the rounding can be counted.


def by_hand_q4_0(raw: bytes, r=f32) -> list[float]:
    d = half(raw, 0)
    return [r(d * (q - 8)) for q in nibbles(raw[2:18])]


def by_hand_q4_1(raw: bytes, r=f32) -> list[float]:
    d, m = half(raw, 0), half(raw, 2)
    return [r(r(d * q) + m) for q in nibbles(raw[4:20])]


def by_hand_q5_0(raw: bytes, r=f32) -> list[float]:
    d = half(raw, 0)
    (qh,) = struct.unpack_from("<I", raw, 2)
    return [r(d * (q - 16)) for q in fifth_bits(qh, nibbles(raw[6:22]))]


def by_hand_q5_1(raw: bytes, r=f32) -> list[float]:
    d, m = half(raw, 0), half(raw, 2)
    (qh,) = struct.unpack_from("<I", raw, 4)
    return [r(r(d * q) + m) for q in fifth_bits(qh, nibbles(raw[8:24]))]


def by_hand_q8_0(raw: bytes, r=f32) -> list[float]:
    d = half(raw, 0)
    return [r(d * q) for q in struct.unpack_from("<32b", raw, 2)]


def by_hand_q4_k(raw: bytes, r=f32, unpack=scale_min_k4) -> list[float]:
    """Eight sub-blocks of 32: sub-block j's codes are the low (j even) or high (j odd) nibbles
    of bytes 32 * (j // 2) to 32 * (j // 2) + 31 of the 128 code bytes; value = d * scale_j *
    code - dmin * min_j. `unpack` reads the 12 scale bytes (a wrong one can be passed in)."""
    d, dmin = half(raw, 0), half(raw, 2)
    scales, mins = unpack(raw[4:16])
    out = []
    for j in range(8):
        chunk = raw[16 + 32 * (j // 2) : 16 + 32 * (j // 2) + 32]
        codes = [b & 0x0F for b in chunk] if j % 2 == 0 else [b >> 4 for b in chunk]
        step, low = r(d * scales[j]), r(dmin * mins[j])
        out += [r(r(step * q) - low) for q in codes]
    return out


def by_hand_q5_k(raw: bytes, r=f32) -> list[float]:
    """As Q4_K, with 32 bytes of fifth bits after the scales: bit j of byte i is value i of
    sub-block j's fifth bit."""
    d, dmin = half(raw, 0), half(raw, 2)
    scales, mins = scale_min_k4(raw[4:16])
    qh = raw[16:48]
    out = []
    for j in range(8):
        chunk = raw[48 + 32 * (j // 2) : 48 + 32 * (j // 2) + 32]
        codes = [b & 0x0F for b in chunk] if j % 2 == 0 else [b >> 4 for b in chunk]
        codes = [q | ((qh[i] >> j) & 1) << 4 for i, q in enumerate(codes)]
        step, low = r(d * scales[j]), r(dmin * mins[j])
        out += [r(r(step * q) - low) for q in codes]
    return out


def q6_k_code(raw: bytes, i: int) -> int:
    """Value i's 6-bit code in a Q6_K block, 0..63. Per half of 128 values (h), value j of it
    takes its low 4 bits from byte 64h + j % 64 of `ql` (low nibble for j < 64, high for
    j >= 64) and its high 2 bits from bits 2 * (j // 32) of byte 32h + j % 32 of `qh`."""
    h, j = divmod(i, 128)
    low = raw[64 * h + j % 64]
    low = low & 0x0F if j < 64 else low >> 4
    high = (raw[128 + 32 * h + j % 32] >> (2 * (j // 32))) & 3
    return low | high << 4


def by_hand_q6_k(raw: bytes, r=f32, scale_format: str = "<16b") -> list[float]:
    """Sixteen sub-blocks of 16, each with a signed byte of scale; value = d * scale * (code -
    32). `scale_format` reads the 16 scale bytes ("<16b", signed; a wrong one can be passed)."""
    scales = struct.unpack_from(scale_format, raw, 192)
    d = half(raw, 208)
    return [r(r(d * scales[i // 16]) * (q6_k_code(raw, i) - 32)) for i in range(QK_K)]


BY_HAND = {
    "q4_0": by_hand_q4_0,
    "q4_1": by_hand_q4_1,
    "q5_0": by_hand_q5_0,
    "q5_1": by_hand_q5_1,
    "q8_0": by_hand_q8_0,
    "q4_k": by_hand_q4_k,
    "q5_k": by_hand_q5_k,
    "q6_k": by_hand_q6_k,
}


# --- the gate ---


def check_bit_equal(got, want, what: str) -> None:
    """`got` and `want` hold the same float32 bit patterns, value for value; otherwise an
    AssertionError says how many differ and by how much at most. Empty input passes."""
    got = np.asarray(got, dtype=np.float32).reshape(-1)
    want = np.asarray(want, dtype=np.float32).reshape(-1)
    assert got.shape == want.shape, f"{what}: {got.size} values against gguf's {want.size}"
    differ = got.view(np.uint32) != want.view(np.uint32)
    if differ.any():
        off = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
        raise AssertionError(
            f"{what}: {int(differ.sum()):,} of {got.size:,} values differ from gguf's, by up to {off:.4g}"
        )


def max_diff(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.abs(got.reshape(-1) - want.reshape(-1)).max(initial=0.0))


# --- the file ---


def open_qwen():
    """The Q4_K_M GGUF's reader (fetched once; `_open_gguf` parses its metadata, 10-20 s)."""
    return _open_gguf(fetch_named_gguf(MODEL))


def role(name: str) -> str:
    """'blk.3.ffn_down.weight' -> 'ffn_down'; a 1-D tensor (norm, bias) -> 'norms and biases'."""
    if name.endswith(".bias") or "norm" in name:
        return "norms and biases"
    return name.removeprefix("blk.").split(".")[1] if name.startswith("blk.") else name.split(".")[0]


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the tensors that get more bits: the first and last eighth, and every
    third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}  # for rows not a multiple of 256


def q4_k_m_type(name: str, cols: int, i: int, n: int, ndim: int) -> tuple[str, str]:
    """(the type the Q4_K_M rule asks for, the type a row of `cols` values can hold) for tensor
    `name`, the i-th of the n tensors of its role in the file's order: Q4_K by default; Q6_K for
    the output matrix (Q8_0 when its rows are not whole super-blocks) and for attn_v and
    ffn_down where `use_more_bits(i, n)`; a K type whose rows are not whole super-blocks falls
    back to a 32-value type. 1-D tensors stay F32."""
    if ndim == 1:
        return "f32", "f32"
    r = role(name)
    if r == "output":
        asked = "q6_k" if cols % QK_K == 0 else "q8_0"
    elif r in ("attn_v", "ffn_down") and use_more_bits(i, n):
        asked = "q6_k"
    else:
        asked = "q4_k"
    stored = asked if cols % QK_K == 0 or asked not in FALLBACK else FALLBACK[asked]
    return asked, stored


def predicted_types(reader) -> dict[str, tuple[str, str]]:
    """name -> (asked, stored) for every tensor, counting each role's tensors in the file's order."""
    n = Counter(role(t.name) for t in reader.tensors)
    seen: Counter = Counter()
    out = {}
    for t in reader.tensors:
        r = role(t.name)
        out[t.name] = q4_k_m_type(t.name, int(t.shape[0]), seen[r], n[r], len(t.shape))
        seen[r] += 1
    return out


def bits(nbytes: int, values: int) -> float:
    return round(8 * nbytes / values, 4)


def summarize(kinds: list[str]) -> str:
    """['q5_0', 'q8_0', 'q5_0'] -> 'Q5_0 x2, Q8_0 x1', most frequent first."""
    return ", ".join(f"{k.upper()} x{c}" for k, c in Counter(kinds).most_common())


def qwen_rows(reader) -> list[dict]:
    pred = predicted_types(reader)
    rows = []
    for r in ROLES:
        ts = [t for t in reader.tensors if role(t.name) == r]
        nbytes, values = sum(int(t.n_bytes) for t in ts), sum(int(t.n_elements) for t in ts)
        stored = [t.tensor_type.name.lower() for t in ts]
        rows.append(
            {
                "matrix": r,
                "tensors": len(ts),
                "row_values": "-" if r == "norms and biases" else int(ts[0].shape[0]),
                "whole_superblocks": "-" if r == "norms and biases" else int(ts[0].shape[0]) % QK_K == 0,
                "asked": summarize([pred[t.name][0] for t in ts]),
                "stored": summarize(stored),
                "predicted": [pred[t.name][1] for t in ts] == stored,
                "mb": round(nbytes / 1e6, 2),
                "bits_per_weight": bits(nbytes, values),
            }
        )
    nbytes = sum(int(t.n_bytes) for t in reader.tensors)
    values = sum(int(t.n_elements) for t in reader.tensors)
    rows.append(
        {
            "matrix": "all",
            "tensors": len(reader.tensors),
            "row_values": "-",
            "whole_superblocks": "-",
            "asked": summarize([a for a, _ in pred.values()]),
            "stored": summarize([t.tensor_type.name.lower() for t in reader.tensors]),
            "predicted": all(pred[t.name][1] == t.tensor_type.name.lower() for t in reader.tensors),
            "mb": round(nbytes / 1e6, 2),
            "bits_per_weight": bits(nbytes, values),
        }
    )
    return rows


# --- the type table ---


def random_blocks(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """n blocks of random bytes, their float16 fields small normal numbers (never NaN)."""
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, size=(n, BLOCKS[kind][1]), dtype=np.uint8)
    for at in HALVES[kind]:
        blocks[:, at : at + 2] = (g.standard_normal(n) * 0.02).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks


def torch_decode(data: np.ndarray, kind: str) -> np.ndarray:
    """nanoserve's torch decoding of (rows, row bytes) blocks: kquants, or Day 60's
    dequantize_torch for Q4_1 and Q8_0."""
    values, nbytes = BLOCKS[kind]
    shape = (data.shape[0], data.shape[1] // nbytes * values)
    blocks = torch.from_numpy(np.ascontiguousarray(data))
    if kind in kquants.BLOCKS:
        return kquants.dequantize(blocks, kind, shape).numpy()
    return dequantize_torch(blocks, kind, shape).numpy()


def best_ms(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e3, 1)


def type_rows(reader, n_blocks: int = 64, n_tensors: int = 2, reps: int = 3) -> list[dict]:
    by_kind: dict[str, list] = {}
    for t in reader.tensors:
        by_kind.setdefault(t.tensor_type.name.lower(), []).append(t)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    rows = []
    for kind, (values, nbytes) in BLOCKS.items():
        qtype = GGMLQuantizationType[kind.upper()]
        ts = by_kind.get(kind, [])
        if ts:
            # the blocks' matrices first: the embedding and output are 136M values each
            picked = sorted(ts, key=lambda t: not t.name.startswith("blk."))[:n_tensors]
            tensors = [np.array(t.data, dtype=np.uint8) for t in picked]
            source = "qwen file"
        else:
            tensors = [random_blocks(kind, 1024).reshape(64, -1)]  # 64 rows of 16 blocks
            source = "random blocks"
        first = tensors[0].reshape(-1, nbytes)[:n_blocks]
        hand = [v for raw in first for v in BY_HAND[kind](bytes(raw))]
        wide = [v for raw in first for v in BY_HAND[kind](bytes(raw), r=float)]
        want = gguf_dequantize(first, qtype)
        check_bit_equal(hand, want, f"{kind} by hand")
        torch_diff, checked = 0.0, 0
        for data in tensors:
            got, ref = torch_decode(data, kind), gguf_dequantize(data, qtype)
            check_bit_equal(got, ref, f"{kind} torch")
            torch_diff, checked = max(torch_diff, max_diff(got, ref)), checked + got.size
        rows.append(
            {
                "type": kind.upper(),
                "values_per_block": values,
                "bytes_per_block": nbytes,
                "bits_per_weight": bits(nbytes, values),
                "qwen_tensors": len(ts),
                "qwen_mb": round(sum(int(t.n_bytes) for t in ts) / 1e6, 2),
                "qwen_share": round(100 * sum(int(t.n_bytes) for t in ts) / total, 1),
                "checked_on": source,
                "by_hand_values": len(hand),
                "by_hand_max_diff": max_diff(hand, want),
                "rounded": sum(a != b for a, b in zip(hand, wide)),
                "torch_values": checked,
                "torch_max_diff": torch_diff,
            }
        )
        if ts and kind in kquants.BLOCKS:  # today's decoders; random blocks are too few to time
            d = tensors[0]
            rows[-1]["ms_values"] = d.shape[0] * d.shape[1] // nbytes * values
            rows[-1]["torch_ms"] = best_ms(lambda d=d, k=kind: torch_decode(d, k), reps)
            rows[-1]["gguf_ms"] = best_ms(lambda d=d, q=qtype: gguf_dequantize(d, q), reps)
    f32s = by_kind.get("f32", [])
    nb = sum(int(t.n_bytes) for t in f32s)
    rows.append(
        {
            "type": "F32",
            "values_per_block": 1,
            "bytes_per_block": 4,
            "bits_per_weight": 32.0,
            "qwen_tensors": len(f32s),
            "qwen_mb": round(nb / 1e6, 2),
            "qwen_share": round(100 * nb / total, 1),
            "checked_on": "-",
        }
        | dict.fromkeys(
            ("by_hand_values", "by_hand_max_diff", "rounded", "torch_values", "torch_max_diff"), "-"
        )
    )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=64, help="blocks of each type decoded by hand")
    p.add_argument("--tensors", type=int, default=2, help="tensors of each type decoded with torch")
    p.add_argument("--reps", type=int, default=3, help="timing repetitions (best kept)")
    args = p.parse_args()
    torch.set_num_threads(2)
    reader = open_qwen()
    types = type_rows(reader, args.blocks, args.tensors, args.reps)
    print(write_csv(types, HERE / "day-63-types.csv", cpu=True))
    for r in types:
        print(r)
    qwen = qwen_rows(reader)
    print(write_csv(qwen, HERE / "day-63-qwen.csv"))
    for r in qwen:
        print(r)


if __name__ == "__main__":
    main()

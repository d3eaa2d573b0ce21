"""The GGUF block types beyond Q4_1 and Q8_0, decoded with torch ops (day 63).

A Q4_K_M or Q5_K_M file mixes several types: Qwen2.5-Coder-0.5B-Instruct's holds Q5_0, Q8_0,
Q4_K and Q6_K matrices. Each type stores a row as blocks; a block is its scales then its codes:

    type   values  bytes  layout (little-endian; "half" is an IEEE float16)
    Q4_0      32     18   d half, 16 bytes of 4-bit codes          x = d * (q - 8)
    Q5_0      32     22   d half, 4 bytes of 5th bits, 16 of 4-bit  x = d * (q - 16)
    Q5_1      32     24   d, m halves, 4 + 16 bytes as Q5_0         x = d * q + m
    Q4_K     256    144   d, dmin halves, 12 bytes of eight 6-bit (scale, min) pairs,
                          128 bytes of 4-bit codes                  x = d*sc * q - dmin*m
    Q5_K     256    176   as Q4_K, with 32 bytes of 5th bits        x = d*sc * q - dmin*m
    Q6_K     256    210   128 bytes of low 4 bits, 64 of high 2 bits, sixteen int8 scales,
                          d half                                     x = d*sc * (q - 32)

In a 32-value block the low nibbles are values 0-15 and the high nibbles 16-31. A K-quant
"super-block" of 256 is eight (Q4_K, Q5_K) or sixteen (Q6_K) sub-blocks, each with its own
small integer scale (and min) multiplied by the super-block's float16 `d` (and `dmin`); within
a 64-value stretch the low nibbles of 32 bytes are the first 32 values and the high nibbles the
next 32. The operations and their order are `gguf.quants`' own (each product rounded to fp32
once, `d * sc` before it meets the code), so the results are bit-equal to it
(tests/test_kquants.py, random blocks of every type).
"""

from __future__ import annotations

import torch

# type -> (values a block, bytes a block)
BLOCKS = {
    "q4_0": (32, 18),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
}


def _half(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 -> (n, 1) fp32: a little-endian float16."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, k, 16 * j) uint8 -> (n, k, 32 * j): per 16j bytes, the low nibbles then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    """(n, bytes) uint8 -> (n, count, bytes) of 0/1: plane b holds bit b of every byte."""
    shifts = torch.arange(count, dtype=torch.uint8).reshape(1, count, 1)
    return (packed.unsqueeze(1) >> shifts) & 1


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, (n, 8) each: scales and
    mins 0-3 are the low 6 bits of bytes 0-3 and 4-7; 4-7 take 4 bits from bytes 8-11 and their
    top 2 bits from the top of bytes 0-3 (scales) and 4-7 (mins)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def dequantize_blocks(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """(n, bytes) uint8 blocks of `kind` -> (n, values) fp32."""
    values, nbytes = BLOCKS[kind]
    n = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != nbytes:
        raise ValueError(f"{kind} blocks are uint8 (n, {nbytes}), not {blocks.dtype} {tuple(blocks.shape)}")
    if kind in ("q4_0", "q5_0", "q5_1"):
        d = _half(blocks[:, 0:2])
        at = 4 if kind == "q5_1" else 2
        m = _half(blocks[:, 2:4]) if kind == "q5_1" else None
        if kind == "q4_0":
            q = _nibbles(blocks[:, at:]).to(torch.int8) - 8
            return d * q.float()
        b = blocks[:, at : at + 4].long()  # a little-endian uint32: bit i is value i's 5th bit
        qh = b[:, :1] | (b[:, 1:2] << 8) | (b[:, 2:3] << 16) | (b[:, 3:4] << 24)  # (n, 1)
        high = (qh >> torch.arange(32)) & 1  # (n, 32)
        q = _nibbles(blocks[:, at + 4 :]).to(torch.int32) | (high << 4)
        if kind == "q5_0":
            return d * (q - 16).float()
        return d * q.float() + m
    if kind in ("q4_k", "q5_k"):
        d, dmin = _half(blocks[:, 0:2]), _half(blocks[:, 2:4])
        sc, mn = _scale_min_k4(blocks[:, 4:16])
        scale = (d * sc.float()).reshape(n, 8, 1)
        low = (dmin * mn.float()).reshape(n, 8, 1)
        qs = blocks[:, 48:] if kind == "q5_k" else blocks[:, 16:]
        q = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)  # sub-block 2j: low nibbles, 2j+1: high
        if kind == "q5_k":  # bit j of qh[i] is value i of sub-block j's 5th bit
            high = _bits(blocks[:, 16:48], 8)  # (n, 8 sub-blocks, 32)
            q = q | (high << 4)
        return (scale * q.float() - low).reshape(n, 256)
    # q6_k
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].contiguous().view(torch.int8).float()  # (n, 16)
    d = _half(blocks[:, 208:210])
    scale = (d * sc).reshape(n, 16, 1)
    low = _nibbles(ql.reshape(n, 2, 64)).reshape(n, 8, 32)  # per 128 values: 64 bytes, low then high
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16)
    return (scale * q.float()).reshape(n, 256)


def dequantize(blocks: torch.Tensor, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    """A matrix stored as rows of `kind` blocks, (rows, cols / values * bytes) uint8 -> (rows,
    cols) fp32."""
    values, nbytes = BLOCKS[kind]
    rows, cols = shape
    if cols % values:
        raise ValueError(f"a {kind} matrix's rows come in blocks of {values} values, not {cols}")
    return dequantize_blocks(blocks.reshape(-1, nbytes), kind).reshape(rows, cols)

"""Weights as a GGUF file holds them: Q4_1 and Q8_0 blocks used in place (phase 6), and the other
types of K-quant files (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: csrc/kquant.cpp, days 63-64).

    w = QuantTensor.from_gguf(reader_tensor)      # the file's bytes, no fp32 copy
    w = QuantTensor.quantize(fp32_matrix, "q4_1") # or quantize a converted model at load
    y = w.linear(x)                                # x (M, in) fp32 -> (M, out) fp32
    rows = w[token_ids]                            # an embedding lookup, widened to fp32

A block is 32 consecutive columns of one row. Q4_1 stores it in 20 bytes: an fp16 scale d, an
fp16 minimum m and 32 four-bit codes (byte j holds column j in its low nibble and column j + 16
in its high one), value = d * code + m. Q8_0 stores 34 bytes: an fp16 scale and 32 signed bytes,
value = d * code. So a Q4_1 matrix is 0.625 bytes a weight against fp32's 4, and a decode step
that streams every weight once reads 6.4x fewer bytes.

A model's matrices are kept in the "split" layout (`QuantTensor.split`): the same bytes of each
row reordered, the row's fp16 scales first, then its minimums, then the codes, so that the
kernel converts a row's scales eight at a time instead of one per block (batch-1 Q4_1 decode
measured ~5% faster here, the two layouts alternating in one process; `from_gguf` and
`quantize` give the file's "gguf" layout, which the kernels read too, with the same sums in
the same order).

With int8 activations on a CPU with AVX512-VNNI (`native().has_tiles()`: whether the build, for
this CPU or the ISA `NANOSERVE_ISA` names, has the instructions) the matrices are kept in "tiles"
instead (`QuantTensor.tiles`, `tile_rows`): sixteen rows' blocks interleaved four bytes at a time,
so that one vpdpbusd multiplies four columns of 16 rows by four activations and the kernel streams
a tile's bytes in order,
prefetching 4 KB ahead. The integer sums are the split kernel's exactly; only the order of the
float additions differs. Measured on a 2-core Xeon with AVX-512, all of SmolLM2's matrices one
after another at batch 1 (best of 5, the two alternating): 2.5 ms over tiles (39.5 GB/s; 3.1 ms
before the prefetch) against 4.75 ms for the split int8 kernel, and a whole decode step fell
from 5.9 to ~3.2 ms. Tiles hold every byte
of the file's blocks (`untile_rows` gives them back) plus, for Q8_0, each block's int16 code
sum (the kernel feeds x as xq + 128, an unsigned operand, and takes 128 * sum off): 1.8 MB
more for SmolLM2's head. An AVX2-only CPU keeps the split layout and its kernels unchanged.
A K-quant file's Q5_0 matrices go into tiles too (`TILES_KINDS`, csrc/kquant.cpp's kind 13: the
same 22 bytes a block and row, their fifth bits reordered for the kernel), which made a 4-row
product of Qwen2.5-0.5B's Q5_0 matrices cost about what one row's does (4.9-5.2 ms against
~10 ms in the file's layout): what a speculative step that verifies drafts multiplies.

The products run in the native kernel (`csrc/quant.cpp`), which widens each block to fp32 in
registers as it goes: the weights it multiplies by are bit for bit the dequantized fp32 weights
(`dequantize`), so against the dequantized model only the order of the sums differs. Without
the native build, `linear` dequantizes the matrix with torch ops on every call and multiplies:
the same numbers, slowly.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from nanoserve import kquants
from nanoserve.errors import NanoserveError

BLOCK = 32
KINDS = {"f32": 0, "q4_1": 1, "q8_0": 2}  # the native kernel's codes
# the K-quant files' other types (csrc/kquant.cpp), read in the file's layout only
KINDS.update({"q4_0": 7, "q5_0": 8, "q5_1": 9, "q4_k": 10, "q5_k": 11, "q6_k": 12})
SPLIT_KINDS = {"q4_1": 3, "q8_0": 4}  # the same kinds in the split layout
TILES_KINDS = {"q4_1": 5, "q8_0": 6, "q5_0": 13}  # and in tiles (Q5_0: csrc/kquant.cpp's)
LAYOUTS = ("gguf", "split", "tiles")
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
BLOCK_VALUES = {"q4_1": BLOCK, "q8_0": BLOCK}
# The K-quant files' other types: kept in the file's layout, read by csrc/kquant.cpp (fp32 and
# int8 activations; kquants.py decodes them with torch ops, the reference and the fallback).
for _kind, (_values, _bytes) in kquants.BLOCKS.items():
    BLOCK_BYTES[_kind], BLOCK_VALUES[_kind] = _bytes, _values
TILE = 16  # rows a tile
# a row's block in tiles: Q8_0 adds its codes' int16 sum
TILE_BLOCK_BYTES = {"q4_1": 20, "q8_0": 36, "q5_0": 22}
# the quantized choices of EngineConfig.weights / --weights; "gguf" is a GGUF's matrices in
# whatever types it holds them (a Q4_K_M file's mix), each as the file has it
WEIGHTS = ("q4_1", "q8_0", "gguf")
# What a quantized linear multiplies its blocks by. "fp32": x as it is, each block widened to fp32
# in registers (the dequantized model's numbers; EngineConfig's default). "int8" (`nanoserve
# serve`'s default, config.DEFAULT_QUANT_ACTIVATIONS, held to the fp32 model's scores by `make
# lmeval`): each row of x quantized to int8, per 256 values (Q8_K) against the K types and per
# block of 32 (a scale per block) against the others, and the products integer multiply-adds, as
# llama.cpp does with its Q8_1 activations: on an AVX2 CPU ~2/3 of the time a block in isolation and
# about the same in a whole decode step, where the weights' bytes dominate; on an AVX512-VNNI
# CPU, over tiles (module doc), the fastest path here, ~2.3x the fp32 activations' decode rate.
ACTIVATIONS = ("fp32", "int8")


def _native():
    from nanoserve.kernels import native

    return native()


class QuantTensor:
    """An (out, in) matrix stored as rows of blocks: `blocks` is uint8 (out, in / 32 * bytes)."""

    def __init__(
        self,
        blocks: torch.Tensor,
        kind: str,
        shape: tuple[int, int],
        activations: str = "fp32",
        layout: str = "gguf",
    ):
        if kind not in BLOCK_BYTES:
            raise ValueError(f"kind is one of {', '.join(BLOCK_BYTES)}, not {kind!r}")
        rows, cols = shape
        values = BLOCK_VALUES[kind]
        if cols % values:
            raise NanoserveError(f"a {kind} matrix has columns in blocks of {values}; this one has {cols}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout is one of {', '.join(LAYOUTS)}, not {layout!r}")
        if layout == "split" and kind not in SPLIT_KINDS:
            raise ValueError(f"{kind} matrices are kept in the file's layout; split is for q4_1 and q8_0")
        if layout == "tiles" and kind not in TILES_KINDS:
            tiled = ", ".join(TILES_KINDS)
            raise ValueError(f"{kind} matrices are kept in the file's layout; tiles are for {tiled}")
        want = (rows, cols // values * BLOCK_BYTES[kind])
        if layout == "tiles":  # one row of bytes a tile of 16 rows
            want = (-(-rows // TILE), cols // BLOCK * TILE * TILE_BLOCK_BYTES[kind])
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != want:
            raise NanoserveError(
                f"a {kind} matrix of shape {shape} is uint8 {want} in the {layout} layout, "
                f"not {blocks.dtype} {tuple(blocks.shape)}"
            )
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations are one of {', '.join(ACTIVATIONS)}, not {activations!r}")
        self.blocks, self.kind, self.shape = blocks.contiguous(), kind, (rows, cols)
        self.activations, self.layout = activations, layout

    # --- building ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, tensor) -> QuantTensor:
        """A gguf.ReaderTensor of a block type, its bytes copied once out of the file's map."""
        kind = tensor.tensor_type.name.lower()
        data = np.array(tensor.data, dtype=np.uint8)  # (rows, row_bytes); a copy: the map is read-only
        cols = int(tensor.shape[0])  # GGUF lists the fastest dimension first
        return cls(torch.from_numpy(data), kind, (data.shape[0], cols))

    @classmethod
    def quantize(cls, w: torch.Tensor, kind: str) -> QuantTensor:
        """Quantize an fp32 (out, in) matrix with gguf's own quantizer (llama.cpp's rounding)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        qtype = GGMLQuantizationType[kind.upper()]
        data = quantize(w.detach().float().cpu().numpy(), qtype)
        return cls(torch.from_numpy(np.ascontiguousarray(data)), kind, tuple(w.shape))

    def with_activations(self, activations: str) -> QuantTensor:
        return QuantTensor(self.blocks, self.kind, self.shape, activations, self.layout)

    @property
    def native(self) -> bool:
        """Whether the native kernels read this kind (all of BLOCK_BYTES' kinds do)."""
        return self.kind in KINDS

    def split(self) -> QuantTensor:
        """The same matrix with each row's bytes in the split layout (the module doc); the K-quant
        files' other types (Q4_0 ... Q6_K) stay in the file's layout, which their kernels read."""
        if self.layout == "split" or self.kind not in SPLIT_KINDS:
            return self
        blocks = split_rows(self.blocks, self.kind)
        return QuantTensor(blocks, self.kind, self.shape, self.activations, "split")

    def tiles(self) -> QuantTensor:
        """The same matrix in tiles of 16 rows (`tile_rows`): the int8 path's layout where the CPU
        has AVX512-VNNI (`native().has_tiles()`)."""
        if self.layout == "tiles" or self.kind not in TILES_KINDS:
            return self
        blocks = tile_rows(self.gguf_blocks(), self.kind)
        return QuantTensor(blocks, self.kind, self.shape, self.activations, "tiles")

    def gguf_blocks(self, rows=None) -> torch.Tensor:
        """The blocks (of `rows`, default all) in the file's layout, whatever this one's is."""
        if self.layout == "tiles":
            b = untile_rows(self.blocks, self.kind, self.shape[0])
            return b if rows is None else b[rows]
        b = self.blocks if rows is None else self.blocks[rows]
        return b if self.layout == "gguf" else gguf_rows(b, self.kind)

    def permute_rows(self, index: torch.Tensor) -> QuantTensor:
        """Rows reordered (blocks run along a row, so a row moves whole)."""
        if self.layout == "tiles":
            return QuantTensor(self.gguf_blocks(index), self.kind, self.shape, self.activations).tiles()
        return QuantTensor(self.blocks[index], self.kind, self.shape, self.activations, self.layout)

    # --- reading ---------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def code(self) -> int:
        if not self.native:
            raise NanoserveError(f"the native kernels do not read {self.kind.upper()} blocks")
        return {"gguf": KINDS, "split": SPLIT_KINDS, "tiles": TILES_KINDS}[self.layout][self.kind]

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix the blocks stand for."""
        ext = _native()
        if ext is not None:
            return ext.dequantize(self.blocks, self.code, *self.shape)
        if self.kind not in SPLIT_KINDS:
            return kquants.dequantize(self.gguf_blocks(), self.kind, self.shape)
        return dequantize_torch(self.gguf_blocks(), self.kind, self.shape)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, in) @ W.T in fp32."""
        ext = _native()
        if ext is not None and x.device.type == "cpu":
            return ext.quant_linear(
                x.float().contiguous(), self.blocks, self.code, self.shape[0], self.activations == "int8"
            )
        # without the native build every call widens the whole matrix: a reference, not a fast
        # path (and int8 activations are per 32 here, for the K types too: an approximation)
        x = x.float() if self.activations == "fp32" else int8_rows(x.float())
        return F.linear(x, self.dequantize())

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (N,) widened to fp32, (N, in): what an embedding lookup needs."""
        ext = _native()
        if ext is None and self.kind not in SPLIT_KINDS:
            ids = ids.reshape(-1)
            return kquants.dequantize(self.gguf_blocks(ids), self.kind, (ids.numel(), self.shape[1]))
        if ext is not None:
            # the true row count: tiles store padding rows past it, which no id may reach
            return ext.embed_rows(
                ids.reshape(-1).long(), self.blocks, self.code, self.shape[1], self.shape[0]
            )
        return dequantize_torch(self.gguf_blocks(ids.reshape(-1)), self.kind, (ids.numel(), self.shape[1]))

    def __repr__(self) -> str:
        layout = f", {self.layout}" if self.layout != "gguf" else ""
        return f"QuantTensor({self.kind}{layout}, shape={self.shape}, {self.nbytes / 1e6:.2f} MB)"


class RowStack(QuantTensor):
    """Matrices of different block types stacked by rows, as one: a Q4_K_M file keeps a layer's
    V in Q8_0 and its Q and K in Q5_0, and the model multiplies Q, K and V as one matrix. Its
    product is each part's product side by side (the fused step writes each part's into its
    columns of one output); `kind` is "mixed"."""

    def __init__(self, parts: list[QuantTensor]):
        cols = {p.shape[1] for p in parts}
        if len(cols) != 1:
            raise NanoserveError(f"stacked matrices share their columns; these have {sorted(cols)}")
        self.parts = list(parts)
        self.kind, self.layout, self.activations = "mixed", "gguf", parts[0].activations
        self.shape = (sum(p.shape[0] for p in parts), cols.pop())
        self.blocks = parts[0].blocks  # its device; the bytes are the parts'

    native = True

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def kinds(self) -> list[str]:
        return [p.kind for p in self.parts]

    def with_activations(self, activations: str) -> RowStack:
        return RowStack([p.with_activations(activations) for p in self.parts])

    def split(self) -> RowStack:
        return RowStack([p.split() for p in self.parts])

    def tiles(self) -> RowStack:
        return RowStack([p.tiles() for p in self.parts])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.linear(x) for p in self.parts], dim=-1)

    def __repr__(self) -> str:
        return f"RowStack({' + '.join(map(repr, self.parts))})"


def split_rows(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """(rows, row bytes) in the file's layout -> each row as its G scales, (Q4_1) its G minimums,
    then its codes: the same bytes, reordered."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, BLOCK_BYTES[kind])
    parts = [b[..., 0:2], b[..., 2:4], b[..., 4:]] if kind == "q4_1" else [b[..., 0:2], b[..., 2:]]
    return torch.cat([p.reshape(rows, -1) for p in parts], dim=1).contiguous()


def gguf_rows(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The inverse of `split_rows`."""
    rows, row_bytes = blocks.shape
    g = row_bytes // BLOCK_BYTES[kind]
    if kind == "q4_1":
        parts = [blocks[:, : 2 * g], blocks[:, 2 * g : 4 * g], blocks[:, 4 * g :]]
    else:
        parts = [blocks[:, : 2 * g], blocks[:, 2 * g :]]
    return torch.cat([p.reshape(rows, g, -1) for p in parts], dim=-1).reshape(rows, row_bytes)


# Q5_0 in tiles: bit 8k + c of a row's 32-bit word of fifth bits is the fifth bit of byte k of
# code vector c, which is code 4c + k (c < 4: the low nibbles, codes 0-15; c >= 4: the high ones,
# 16 + 4(c - 4) + k, the same number); _Q5_BITS[i] is the code whose bit goes to bit i
# (csrc/kquant.cpp's q5t_bit).
_Q5_BITS = [4 * c + k for k in range(4) for c in range(8)]


def tile_rows(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """(rows, row bytes) in the file's layout -> tiles of 16 rows (csrc/quant.cpp, kinds 5 and 6;
    csrc/kquant.cpp, kind 13): the rows padded with zero rows to a multiple of 16; for tile t and
    block g, the 16 rows' fp16 scales, their fp16 minimums (Q4_1), the int16 sums of their codes
    (Q8_0) or their words of fifth bits in the kernel's order (Q5_0, `_Q5_BITS`), then the codes
    four bytes at a time, bytes 4c..4c+3 of each of the 16 rows for c = 0, 1, ... Every byte of
    the file's blocks is kept; (tiles, blocks * 16 * block bytes) uint8."""
    rows, row_bytes = blocks.shape
    g = row_bytes // BLOCK_BYTES[kind]
    t = -(-rows // TILE)
    b = torch.zeros(t * TILE, g, BLOCK_BYTES[kind], dtype=torch.uint8)
    b[:rows] = blocks.reshape(rows, g, BLOCK_BYTES[kind])
    b = b.reshape(t, TILE, g, -1).transpose(1, 2)  # (tiles, blocks, 16 rows, block bytes)
    if kind == "q4_1":
        head = b[..., :4].reshape(t, g, TILE, 2, 2).transpose(2, 3).reshape(t, g, 64)  # 16 d, 16 m
        codes = b[..., 4:]
    elif kind == "q5_0":  # 16 d, then each row's fifth bits reordered (_Q5_BITS), then the nibbles
        qh = b[..., 2:6].contiguous().view(torch.int32)[..., 0]  # (tiles, blocks, 16)
        perm = torch.zeros_like(qh)
        for i, code in enumerate(_Q5_BITS):  # a bit at a time: no (..., 32) temporaries
            perm |= ((qh >> code) & 1) << i
        bits = perm.contiguous().view(torch.uint8).reshape(t, g, 64)
        head = torch.cat([b[..., :2].reshape(t, g, 32), bits], -1)
        codes = b[..., 6:]
    else:
        sums = b[..., 2:].view(torch.int8).to(torch.int16).sum(-1, dtype=torch.int16)
        head = torch.cat(
            [b[..., :2].reshape(t, g, 32), sums.contiguous().view(torch.uint8).reshape(t, g, 32)], -1
        )
        codes = b[..., 2:]
    quads = codes.reshape(t, g, TILE, -1, 4).transpose(2, 3)  # (tiles, blocks, quads, 16 rows, 4)
    return torch.cat([head, quads.reshape(t, g, -1)], -1).reshape(t, -1).contiguous()


def untile_rows(tiles: torch.Tensor, kind: str, rows: int) -> torch.Tensor:
    """The inverse of `tile_rows`: the file's (rows, row bytes), the padding dropped."""
    t = tiles.shape[0]
    tb = TILE * TILE_BLOCK_BYTES[kind]
    g = tiles.shape[1] // tb
    b = tiles.reshape(t, g, tb)
    d = b[..., :32].reshape(t, g, TILE, 2)
    head = 96 if kind == "q5_0" else 64
    if kind == "q4_1":
        parts = [d, b[..., 32:64].reshape(t, g, TILE, 2)]
    elif kind == "q5_0":
        perm = b[..., 32:96].contiguous().view(torch.int32)  # (t, g, 16)
        qh = torch.zeros_like(perm)
        for i, code in enumerate(_Q5_BITS):
            qh |= ((perm >> i) & 1) << code
        parts = [d, qh.contiguous().view(torch.uint8).reshape(t, g, TILE, 4)]
    else:
        parts = [d]  # the sums are derived; the file does not hold them
    codes = b[..., head:].reshape(t, g, -1, TILE, 4).transpose(2, 3).reshape(t, g, TILE, -1)
    out = torch.cat(parts + [codes], -1).transpose(1, 2).reshape(t * TILE, -1)
    return out[:rows].contiguous()


def dequantize_torch(blocks: torch.Tensor, kind: str, shape: tuple[int, int]) -> torch.Tensor:
    """The blocks widened with plain torch ops: the reference the kernel is held to."""
    rows, cols = shape
    b = blocks.reshape(rows, cols // BLOCK, BLOCK_BYTES[kind])
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # (rows, groups, 1)
    if kind == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        return (d * q).reshape(rows, cols)
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    qs = b[..., 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).float()  # columns 0-15 then 16-31
    return (d * q + m).reshape(rows, cols)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x (M, in) as the int8 path sees it: each block of 32 rounded to a multiple of its scale
    max|x| / 127 (the values the kernel's integer sums stand for)."""
    b = x.reshape(x.shape[0], -1, BLOCK)
    d = b.abs().amax(dim=-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d > 0, 1 / d, 0))
    return (q * d).reshape(x.shape)


def weight_bytes(w) -> int:
    """Bytes a weight occupies, whatever it is (a tensor, a packed tensor, a QuantTensor)."""
    if isinstance(w, QuantTensor):
        return w.nbytes
    if getattr(w, "is_mkldnn", False):
        return w.to_dense().numel() * w.element_size()
    return w.numel() * w.element_size()


def kernel_layout(w: QuantTensor) -> QuantTensor:
    """The layout this CPU's kernel reads fastest: tiles for int8 activations where the tiles
    kernel was built (AVX512-VNNI), else split."""
    ext = _native()
    if w.activations == "int8" and ext is not None and ext.has_tiles():
        return w.tiles()
    return w.split()

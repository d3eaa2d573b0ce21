"""The native kernels over the K-quant files' block types (csrc/kquant.cpp, kinds 7-12).

- fp32 activations: the weights the kernel multiplies by are gguf's dequantization bit for bit
  (`dequantize` and `embed_rows` equal it; `quant_linear` equals x @ W.T up to the order of sums);
- int8 activations: llama.cpp's arithmetic, x quantized per 32 (Q8_0) against 32-value blocks and
  per 256 (Q8_K, with its sums of 16) against super-blocks, checked against that arithmetic
  written out here with numpy integers; a Q8_K quantizer that drops its sums is caught.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from nanoserve.kquants import BLOCKS
from nanoserve.quant import KINDS
from tests.test_kquants import random_blocks

native = pytest.importorskip("nanoserve.kernels").native()
pytestmark = pytest.mark.skipif(native is None, reason="the native kernels did not build")

SUPER = ("q4_k", "q5_k", "q6_k")


def matrix(kind: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """Random blocks of `kind` as a (rows, cols) matrix, and gguf's fp32 for it."""
    values, nbytes = BLOCKS[kind]
    blocks = random_blocks(kind, rows * cols // values, seed).reshape(rows, -1)
    want = gguf_dequantize(blocks, GGMLQuantizationType[kind.upper()]).reshape(rows, cols)
    return torch.from_numpy(np.ascontiguousarray(blocks)), want.astype(np.float32)


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_native_dequantize_and_embedding_rows_are_gguf_bit_for_bit(kind):
    rows, cols = 24, 512
    blocks, want = matrix(kind, rows, cols, seed=3)
    got = native.dequantize(blocks, KINDS[kind], rows, cols).numpy()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    ids = torch.tensor([5, 0, 23, 5])
    rows_got = native.embed_rows(ids, blocks, KINDS[kind], cols, rows).numpy()
    assert np.array_equal(rows_got.view(np.uint32), want[ids.numpy()].view(np.uint32))


@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_fp32_activations_multiply_by_the_dequantized_weights(kind, m):
    rows, cols = 40, 768
    blocks, want = matrix(kind, rows, cols, seed=m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    got = native.quant_linear(x, blocks, KINDS[kind], rows, False)
    ref = x.double() @ torch.from_numpy(want).double().T
    scale = (x.double().abs() @ torch.from_numpy(want).double().abs().T).max()
    assert (got.double() - ref).abs().max() <= 1e-6 * scale  # only the order of fp32 sums differs


def q8_0(x: np.ndarray):
    """llama.cpp's Q8_0 activations: per 32, d = max|x| / 127, q = round(x / d) (to even)."""
    b = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.rint(b * inv[..., None]).astype(np.int64)
    return q, d.astype(np.float64)


def q8_k(x: np.ndarray):
    """llama.cpp's Q8_K activations: per 256, the scale is the value of largest magnitude over
    -127, codes round(x * -127 / max) clamped to 127, and the sums of each 16 codes."""
    b = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    at = np.abs(b).argmax(-1)
    mx = np.take_along_axis(b, at[..., None], -1)[..., 0]
    iscale = np.where(mx != 0, np.float32(-127) / np.where(mx != 0, mx, 1), 0).astype(np.float32)
    q = np.minimum(127, np.rint(iscale[..., None] * b)).astype(np.int64)
    d = np.where(mx != 0, np.float32(1) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    return q, d.astype(np.float64), q.reshape(q.shape[0], q.shape[1], 16, 16).sum(-1)


def int8_reference(kind: str, blocks: np.ndarray, want: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The int8 path's result in float64: the dequantized weights (exact values of the blocks)
    against x's quantized values, q * d. Every integer sum of the kernel is exact, so this is its
    result up to fp32 rounding of the scales' products and the sums over blocks."""
    if kind in SUPER:
        q, d, _ = q8_k(x)
        xv = (q * d[..., None]).reshape(x.shape)
    else:
        q, d = q8_0(x)
        xv = (q * d[..., None]).reshape(x.shape)
    return xv @ want.astype(np.float64).T


@pytest.mark.parametrize("m", [1, 2, 5, 8, 19])
@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_int8_activations_are_llama_cpps_arithmetic(kind, m):
    rows, cols = 36, 512
    blocks, want = matrix(kind, rows, cols, seed=10 + m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).numpy()
    got = native.quant_linear(torch.from_numpy(x), blocks, KINDS[kind], rows, True).double().numpy()
    ref = int8_reference(kind, blocks.numpy(), want, x)
    scale = np.abs(x) @ np.abs(want.astype(np.float64)).T
    assert np.abs(got - ref).max() <= 2e-6 * scale.max()
    # and it is not the fp32 path: x's quantization shows, far above that tolerance
    fp32 = x.astype(np.float64) @ want.astype(np.float64).T
    assert np.abs(got - fp32).max() > 1e-4 * scale.max()


def test_a_q8_k_without_its_sums_of_16_is_caught():
    """The check above fails on a wrongly built quantizer: Q4_K's mins and Q6_K's offset of 32
    come off through the sums of each 16 codes; with those sums zero the result moves far."""
    rows, cols = 16, 256
    x = np.random.default_rng(0).standard_normal((1, cols)).astype(np.float32)
    for kind in ("q4_k", "q6_k"):
        blocks, want = matrix(kind, rows, cols, seed=4)
        q, d, sums = q8_k(x)
        ref = int8_reference(kind, blocks.numpy(), want, x)[0]
        # what a kernel would give with every sum of 16 taken as zero, written out with numpy
        if kind == "q6_k":
            scale = (
                torch.from_numpy(blocks.numpy()[:, 192:208].copy())
                .view(torch.int8)
                .numpy()
                .astype(np.float64)
            )
            dd = blocks.numpy()[:, 208:210].copy().view(np.float16).astype(np.float64)
            mins_term = -32 * (dd[:, 0] * (scale * sums[0, 0][None, :]).sum(-1)) * d[0, 0]
        else:
            from nanoserve.kquants import _scale_min_k4

            _, mn = _scale_min_k4(torch.from_numpy(blocks.numpy()[:, 4:16].copy()))
            dmin = blocks.numpy()[:, 2:4].copy().view(np.float16).astype(np.float64)
            pair = sums[0, 0].reshape(8, 2).sum(-1)
            mins_term = -(dmin[:, 0] * (mn.numpy() * pair[None, :]).sum(-1)) * d[0, 0]
        wrong = ref - mins_term
        got = native.quant_linear(torch.from_numpy(x), blocks, KINDS[kind], rows, True).double().numpy()[0]
        assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()
        assert np.abs(got - wrong).max() > 1e-2 * np.abs(ref).max()


def test_columns_not_in_whole_super_blocks_are_a_sentence():
    with pytest.raises(RuntimeError, match="blocks of 256, not 896"):
        native.quant_linear(
            torch.zeros(1, 896), torch.zeros(2 * 504, dtype=torch.uint8), KINDS["q4_k"], 2, False
        )


# --- Q5_0 in tiles (kind 13) and batch invariance ---------------------------------------------


def q5_0_tiles(rows: int, cols: int, seed: int):
    """A random Q5_0 matrix in the file's layout and in tiles, with gguf's fp32 for it."""
    from nanoserve.quant import QuantTensor

    blocks, want = matrix("q5_0", rows, cols, seed)
    gguf = QuantTensor(blocks, "q5_0", (rows, cols), "int8")
    return gguf, gguf.tiles(), want


def test_q5_0_tiles_hold_every_byte_and_are_gguf_bit_for_bit():
    """tile_rows keeps every byte of the file's blocks (untile_rows gives them back; rows padded
    to 16), and the native dequantization and embedding rows read tiles as gguf's fp32."""
    from nanoserve.quant import TILES_KINDS, untile_rows

    for rows, cols in ((24, 512), (37, 96), (16, 608)):
        gguf, tiles, want = q5_0_tiles(rows, cols, seed=rows)
        assert tiles.layout == "tiles" and tiles.code == TILES_KINDS["q5_0"]
        assert tiles.blocks.shape[0] == -(-rows // 16) and tiles.nbytes >= gguf.nbytes
        assert torch.equal(untile_rows(tiles.blocks, "q5_0", rows), gguf.blocks)
        got = native.dequantize(tiles.blocks, tiles.code, rows, cols).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        ids = torch.tensor([rows - 1, 0, rows // 2, 0])
        assert torch.equal(tiles[ids], torch.from_numpy(want[ids.numpy()]))


@pytest.mark.parametrize("m", [1, 2, 4, 5, 8, 19])
def test_q5_0_tiles_int8_product_is_llama_cpps_arithmetic(m):
    """The tiles kernel's integer dots are the file layout's exactly (sum q x - 16 sum x), so the
    product is the same reference's as above; fp32 activations (the portable path over tiles)
    multiply by the dequantized weights."""
    rows, cols = 37, 608  # a partial last tile; 19 blocks a row
    gguf, tiles, want = q5_0_tiles(rows, cols, seed=m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).numpy()
    got = tiles.linear(torch.from_numpy(x)).double().numpy()
    scale = (np.abs(x) @ np.abs(want.astype(np.float64)).T).max()
    assert np.abs(got - int8_reference("q5_0", gguf.blocks.numpy(), want, x)).max() <= 2e-6 * scale
    fp32 = tiles.with_activations("fp32").linear(torch.from_numpy(x)).double().numpy()
    assert np.abs(fp32 - x.astype(np.float64) @ want.astype(np.float64).T).max() <= 1e-6 * scale


def test_q5_0_tiles_with_the_fifth_bits_left_in_the_files_order_are_caught():
    """The check above on a wrongly built input: tiles whose words of fifth bits are the file's
    qh as it lies (not reordered to the kernel's code vectors) give another product."""
    rows, cols = 32, 512
    gguf, tiles, want = q5_0_tiles(rows, cols, seed=7)
    b = tiles.blocks.clone().reshape(2, 16, 352)
    qh = gguf.blocks.reshape(2, 16, 16, 22)[..., 2:6].transpose(1, 2)  # (tiles, blocks, rows, 4)
    b[..., 32:96] = qh.reshape(2, 16, 64)
    wrong = type(tiles)(b.reshape(2, -1), "q5_0", (rows, cols), "int8", "tiles")
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(1)).numpy()
    ref = int8_reference("q5_0", gguf.blocks.numpy(), want, x)
    scale = (np.abs(x) @ np.abs(want.astype(np.float64)).T).max()
    assert np.abs(tiles.linear(torch.from_numpy(x)).double().numpy() - ref).max() <= 2e-6 * scale
    assert np.abs(wrong.linear(torch.from_numpy(x)).double().numpy() - ref).max() > 1e-2 * scale


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_an_int8_product_of_the_k_quant_kinds_does_not_depend_on_its_neighbours(kind):
    """Batch invariance (as test_quant.py's for Q4_1/Q8_0): row i of an int8 product over M rows
    of x is bit for bit row i's product alone, for M up to 15 (below the tile kernels' 16), in
    the file's layout and the one the loader gives (Q5_0 in tiles where the build has them).
    Speculative decoding verifies a draft as one more row of the step, so its greedy tokens rest
    on this. Columns of 19 blocks exercise the Q5_0 rows kernel's blocks past a multiple of 4."""
    from nanoserve.quant import QuantTensor, kernel_layout

    cols = 512 if kind in SUPER else 608
    blocks, _ = matrix(kind, 40, cols, seed=11)
    w = QuantTensor(blocks, kind, (40, cols), "int8")
    x = torch.randn(15, cols, generator=torch.Generator().manual_seed(3)) * 3
    for layout in {w, kernel_layout(w)}:
        alone = torch.cat([layout.linear(x[i : i + 1]) for i in range(15)])
        for m in range(2, 16):
            assert torch.equal(layout.linear(x[:m]), alone[:m]), (kind, layout.layout, m)

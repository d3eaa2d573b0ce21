"""The GGUF block types of K-quant files, decoded by `nanoserve.kquants`, against `gguf`'s own
decoding: bit-equal on random blocks of every type, and on the real Qwen2.5-Coder GGUF's
matrices of each type it holds."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from nanoserve.kquants import BLOCKS, dequantize, dequantize_blocks

# where each type keeps its float16 fields: random bytes there could be NaN or infinite
HALVES = {"q4_0": [0], "q5_0": [0], "q5_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}


def random_blocks(kind: str, n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, size=(n, BLOCKS[kind][1]), dtype=np.uint8)
    for at in HALVES[kind]:
        halves = (g.standard_normal(n) * 0.02).astype(np.float16)
        blocks[:, at : at + 2] = halves.view(np.uint8).reshape(n, 2)
    return blocks


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_random_blocks_decode_bit_equal_to_gguf(kind):
    blocks = random_blocks(kind, 512, seed=len(kind) + ord(kind[1]))
    want = gguf_dequantize(blocks, GGMLQuantizationType[kind.upper()]).reshape(512, -1)
    got = dequantize_blocks(torch.from_numpy(blocks), kind).numpy()
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_one_block_alone_decodes_as_it_does_among_others(kind):
    """A single block's fields sit at odd byte offsets of a small tensor (Q5_0's 5th bits at
    byte 2): reading them must not depend on the tensor's alignment."""
    blocks = torch.from_numpy(random_blocks(kind, 3, seed=7))
    whole = dequantize_blocks(blocks, kind)
    for i in range(3):
        assert torch.equal(dequantize_blocks(blocks[i : i + 1], kind), whole[i : i + 1])


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_a_decoder_that_swaps_its_halves_is_caught(kind, monkeypatch):
    """The comparison above fails on a wrongly built decoder: here the nibbles' order swapped."""
    import nanoserve.kquants as kq

    monkeypatch.setattr(kq, "_nibbles", lambda qs: torch.cat([qs >> 4, qs & 0x0F], dim=-1))
    blocks = random_blocks(kind, 64, seed=1)
    want = gguf_dequantize(blocks, GGMLQuantizationType[kind.upper()]).reshape(64, -1)
    assert not np.array_equal(kq.dequantize_blocks(torch.from_numpy(blocks), kind).numpy(), want)


def test_the_wrong_bytes_a_block_are_a_sentence():
    with pytest.raises(ValueError, match=r"q4_k blocks are uint8 \(n, 144\)"):
        dequantize_blocks(torch.zeros(3, 140, dtype=torch.uint8), "q4_k")
    with pytest.raises(ValueError, match="blocks of 256 values, not 300"):
        dequantize(torch.zeros(2, 144, dtype=torch.uint8), "q4_k", (2, 300))


def test_the_qwen_files_matrices_decode_bit_equal_to_gguf():
    """One matrix of each K-quant file type Qwen2.5-Coder-0.5B-Instruct's Q4_K_M GGUF holds."""
    from nanoserve.fetch import fetch_named_gguf
    from nanoserve.gguf_file import _open_gguf

    reader = _open_gguf(fetch_named_gguf("qwen2.5-coder-0.5b-instruct"))
    seen = set()
    for t in reader.tensors:
        kind = t.tensor_type.name.lower()
        if kind not in BLOCKS or kind in seen:
            continue
        seen.add(kind)
        data = np.array(t.data, dtype=np.uint8)
        shape = (data.shape[0], int(t.shape[0]))
        got = dequantize(torch.from_numpy(data), kind, shape).numpy()
        want = gguf_dequantize(data, t.tensor_type).astype(np.float32)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
    assert seen == {"q5_0", "q4_k", "q6_k"}

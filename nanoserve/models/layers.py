"""The layers every family's forward is built from (days 3-7): the linear layer and its CPU
paths, RMSNorm, rotary embeddings, and the protocol a K/V cache speaks.

A layer here knows shapes and numbers, not a family: `llama.py` (and the families written as
llama with a change, `qwen.py`) put them together. What `linear` multiplies by may be a plain
tensor, a oneDNN-packed one (`pack_linears`) or a GGUF's blocks (`quant.QuantTensor`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from nanoserve.errors import NanoserveError
from nanoserve.quant import QuantTensor

if TYPE_CHECKING:
    from nanoserve.models.llama import Llama, LlamaConfig


class KVCache(Protocol):
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def attention(self, layer: int, q: torch.Tensor) -> torch.Tensor: ...


# --- building blocks -------------------------------------------------------------------------


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T for x (M, in), w (out, in).

    Two CPU facts shape this (Day 12 measures both):

    * In fp32 on a multi-core CPU the output features are split into one slab per thread and
      run as a batched matmul: MKL's own GEMV/GEMM on these tall, thin shapes keeps one core
      streaming the weights, while `bmm` hands each core its own slab. On 2 cores over the
      SmolLM2-135M shapes: 14 -> 23 GB/s at M=1, and 66 -> 46 ms a step at M=8.
    * A CPU without bf16 matrix instructions (AVX2 parts) emulates a bf16 GEMM at ~20 GFLOP/s
      against ~140 for fp32. One row is bandwidth-bound, so bf16's halved bytes win there;
      from `BF16_UPCAST_ROWS` rows on, the weights are widened to fp32 for the product and the
      result rounded back to bf16, which is what a bf16 GEMM does inside anyway (fp32 sums).
    * A weight `pack_linears` has reordered for oneDNN goes straight to oneDNN's GEMM, which
      beats both of the above from a few rows up (the engine's default on CPU, phase 6).
    """
    if isinstance(w, QuantTensor):  # a GGUF's blocks (quant.py)
        return w.linear(x)
    if x.device.type != "cpu":
        return F.linear(x, w)
    if w.is_mkldnn:  # prepacked by `pack_linears`
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    if w.dtype == torch.bfloat16 and x.shape[0] >= BF16_UPCAST_ROWS and not _CPU_HAS_BF16:
        return linear(x.float(), w.float()).to(torch.bfloat16)
    parts = torch.get_num_threads()
    if w.dtype != torch.float32 or parts < 2 or w.shape[0] % parts:
        return F.linear(x, w)
    m, out = x.shape[0], w.shape[0]
    slabs = w.view(parts, out // parts, w.shape[1]).transpose(1, 2)  # (P, in, out/P)
    y = torch.bmm(x.unsqueeze(0).expand(parts, -1, -1), slabs)  # (P, M, out/P)
    return y.transpose(0, 1).reshape(m, out)


BF16_UPCAST_ROWS = 4
_CPU_HAS_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
LINEAR = ("auto", "packed", "plain")


def packing_status(dtype: torch.dtype, device) -> str | None:
    """None when `pack_linears` can pack weights of this dtype on this device, else why not."""
    kind = torch.device(device).type
    if kind != "cpu":
        return f"packed weights are oneDNN's CPU layout; on {kind} the linears stay plain"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn), which packed weights need"
    if dtype == torch.bfloat16 and not _CPU_HAS_BF16:
        return (
            f"oneDNN packs bf16 weights only on a CPU with bf16 instructions (avx512_bf16, "
            f"amx or avx_ne_convert); this one is {torch.backends.cpu.get_cpu_capability()}"
        )
    if dtype not in (torch.float32, torch.bfloat16):
        return f"packed weights are fp32 or bf16, not {dtype}"
    return None


def pack_linears(model: Llama, rows: int = 16) -> int:
    """Reorder every block's four matrices and the head into oneDNN's blocked layout, once.

    `linear` then runs each through oneDNN with the weight already in the order its GEMM reads
    it, instead of re-laying tiles out on every call. Measured on 2 AVX2 cores over
    SmolLM2-135M's 30 blocks and head with the weights cold in cache, as a decode step finds
    them: 95 -> 82 ms at 16 rows, 233 -> 174 ms at 64; the head alone at 16 rows 27 -> 14 ms.
    `rows` is the row count the layout is tuned for (the engine passes max_batch); any count
    runs. The sums come in another order, so results differ from the plain path by float
    rounding (~1e-4 on logits), not more.

    In place and one way: afterwards the matrices are opaque oneDNN tensors (`is_mkldnn`),
    which only `linear` reads; the embedding stays a plain tensor, so a tied head gets a packed
    copy of its own (the one extra: vocab x hidden). Returns the count of matrices packed
    (0 if already packed)."""
    why = packing_status(model.dtype, model.device)
    if why is not None:
        raise ValueError(why)
    if model.head.is_mkldnn:
        return 0
    pack = lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)  # noqa: E731
    for b in model.blocks:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(b, name)
            delattr(b, name)  # a Parameter: replaced by a plain (opaque) tensor attribute
            setattr(b, name, pack(w))
    head = model.head
    if "head" in model._parameters:
        delattr(model, "head")
    model.head = pack(head)
    return 4 * len(model.blocks) + 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, the mean taken in fp32 whatever the model's dtype.

    transformers normalizes in fp32, casts back, then scales by the weight in the model's dtype;
    here it is one call to torch's `rms_norm` (on CPU, torch 2.13 still runs it as about two
    dozen aten ops inside: day 48 counts them; a fused kernel is a GPU matter).
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """The rotary frequencies, (head_dim/2,), with Llama-3 scaling applied when configured."""
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim)
    )
    s = cfg.rope_scaling
    if not s or s.get("rope_type", s.get("type")) in (None, "default"):
        return inv_freq
    if s.get("rope_type", s.get("type")) != "llama3":
        raise NanoserveError(
            f"rope scaling {s.get('rope_type', s.get('type'))!r} is not supported (default, llama3)"
        )
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_tables(cfg: LlamaConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, each (max_positions, head_dim), in fp32."""
    inv_freq = rope_inv_freq(cfg)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # (P, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, hd): halves, not interleaved pairs
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (N, heads, hd) by per-token angles; cos, sin are (N, 1, hd) in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

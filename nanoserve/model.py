"""The Llama family's forward pass, written out (days 3-7).

Holds `LlamaConfig` (read from a Hugging Face `config.json`), the pieces of a decoder block
(RMSNorm, rotary embeddings, grouped-query attention, the SwiGLU MLP) and `Llama`, which runs
them over a flat batch of tokens.

What it deliberately does not hold: any K/V storage. Attention hands its keys and values to a
cache object and asks the same object for the attention output, so a contiguous cache (day 11)
and the paged, batched cache (days 17-24) drop in without the model changing. The protocol is
two methods:

    cache.write(layer, k, v)        # k, v: (N, kv_heads, head_dim) for the N tokens of this step
    cache.attention(layer, q)       # q: (N, heads, head_dim) -> (N, heads, head_dim)

Tokens are flat: `input_ids` and `positions` are (N,) for every sequence of the step packed end
to end, so prefill over ragged prompts needs no padding. Which token belongs to which sequence
is the cache's business, not the model's.

Numerics follow `transformers`' `LlamaForCausalLM` operation for operation (norms in fp32,
rotary tables in fp32, logits in fp32), which is what lets the tests hold us to its logits.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.errors import NanoserveError
from nanoserve.quant import QuantTensor, RowStack


class KVCache(Protocol):
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...
    def attention(self, layer: int, q: torch.Tensor) -> torch.Tensor: ...


# --- configuration ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope_scaling: dict | None = None
    # biases: Qwen2 adds one to Q, K and V (not O); a Llama with attention_bias to all four
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key before the rotation
    family: str = "llama"  # config.json's model_type: llama, mistral, qwen2 or qwen3

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        # transformers 5 writes rope settings under `rope_parameters`; older files use
        # `rope_theta` and `rope_scaling`. Read both.
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = d["num_attention_heads"]
        kind = d.get("model_type")
        qwen2 = kind == "qwen2"  # transformers' Qwen2Attention: q, k, v biased, o not
        # Qwen3Attention's biases follow attention_bias (all four, false in Qwen3's releases), as Llama's
        llama_bias = bool(d.get("attention_bias", False)) and not qwen2
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_layers=d["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                rope_scaling=scaling,
                qkv_bias=qwen2 or llama_bias,
                o_bias=llama_bias,
                qk_norm=kind == "qwen3",
                family=kind or "llama",
            )
        except KeyError as e:
            raise NanoserveError(
                f"config.json lacks the field {e.args[0]!r} that a Llama model needs"
            ) from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> LlamaConfig:
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


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


# --- the model ---------------------------------------------------------------------------------


class Block(nn.Module):
    """One decoder block. Q, K and V share one matrix, and so do the MLP's gate and up
    projections: one matmul instead of three (or two), the same numbers per output element."""

    def __init__(self, cfg: LlamaConfig, layer: int, dtype: torch.dtype, device):
        super().__init__()
        self.layer, self.cfg = layer, cfg
        hd, h = cfg.head_dim, cfg.hidden_size
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        kw = dict(dtype=dtype, device=device)
        self.input_norm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.qkv = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h, **kw), requires_grad=False)
        self.o = nn.Parameter(torch.empty(h, self.q_size, **kw), requires_grad=False)
        self.post_norm = nn.Parameter(torch.ones(h, **kw), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.intermediate_size, h, **kw), requires_grad=False)
        self.down = nn.Parameter(torch.empty(h, cfg.intermediate_size, **kw), requires_grad=False)
        # added after their matmuls, before the rotation (as transformers' q_proj(x) + bias does)
        self.qkv_bias = (
            nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size, **kw), requires_grad=False)
            if cfg.qkv_bias
            else None
        )
        self.o_bias = nn.Parameter(torch.zeros(h, **kw), requires_grad=False) if cfg.o_bias else None
        self.q_norm = nn.Parameter(torch.ones(hd, **kw), requires_grad=False) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(hd, **kw), requires_grad=False) if cfg.qk_norm else None
        self.tp = None  # under tensor parallelism (tp.py): the group whose all-reduces sum o and down

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cfg, n = self.cfg, x.shape[0]
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)  # (N, H)
        qkv = linear(h, self.qkv)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qkv = qkv.view(n, cfg.num_heads + 2 * cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:  # each head's query and key normed over head_dim (Qwen3)
            q = rms_norm(qkv[:, : cfg.num_heads], self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(
                qkv[:, cfg.num_heads : cfg.num_heads + cfg.num_kv_heads], self.k_norm, cfg.rms_norm_eps
            )
            qkv = torch.cat([q, k, qkv[:, cfg.num_heads + cfg.num_kv_heads :]], dim=1)
        qk = apply_rope(
            qkv[:, : cfg.num_heads + cfg.num_kv_heads], cos, sin
        )  # (N, nh + nkv, hd): one rotation
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]  # (N, nh, hd), (N, nkv, hd)
        cache.write(self.layer, k, qkv[:, cfg.num_heads + cfg.num_kv_heads :])
        attn = cache.attention(self.layer, q)  # (N, nh, hd)
        out = linear(attn.reshape(n, self.q_size), self.o)
        if self.o_bias is not None:  # under tensor parallelism rank 0 holds it, the others zeros
            out = out + self.o_bias
        if self.tp is not None:  # this rank's heads' part of the projection: summed over ranks
            out = self.tp.all_reduce(out)
        x = x + out
        h = rms_norm(x, self.post_norm, cfg.rms_norm_eps)
        gate, up = linear(h, self.gate_up).chunk(2, dim=-1)  # (N, I) each
        out = linear(F.silu(gate) * up, self.down)
        if self.tp is not None:  # this rank's MLP columns' part: summed over ranks
            out = self.tp.all_reduce(out)
        return x + out


class Llama(nn.Module):
    def __init__(
        self, cfg: LlamaConfig, dtype: torch.dtype = torch.float32, device="cpu", max_positions=None
    ):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False)
        self.blocks = nn.ModuleList(Block(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw), requires_grad=False)
        self.head = (
            self.embed
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False)
        )
        cos, sin = rope_tables(cfg, max_positions or cfg.max_position_embeddings)
        # The tables are kept in the model's dtype: transformers casts cos/sin to it before rotating.
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)
        self.weights = str(dtype).removeprefix("torch.")  # what the matrices hold; quant.py sets q4_1/q8_0
        self._fused = None  # the fused step's operand lists, built on its first call
        self.tp = None  # tensor parallelism (tp.py): this rank's share of a model split over ranks

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def matrices(self) -> list:
        """The embedding, the head and every block's four matrices (a tied head listed twice)."""
        return [self.embed, self.head] + [
            getattr(b, n) for b in self.blocks for n in ("qkv", "o", "gate_up", "down")
        ]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (M, vocab) in fp32 for the tokens at `logits_at` (default: every token).

        input_ids, positions: (N,) for all tokens of the step, packed end to end.
        """
        # under tensor parallelism each rank holds a slice of the vocabulary (tp.py)
        x = self.embed[input_ids] if self.tp is None else self.tp.embed(self.embed, input_ids)  # (N, H)
        cos = self.cos[positions].unsqueeze(1)  # (N, 1, hd)
        sin = self.sin[positions].unsqueeze(1)
        for block in self.blocks:
            x = block(x, cos, sin, cache)
        if logits_at is not None:
            x = x[logits_at]  # (M, H): only the rows whose next token we sample
        x = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        logits = linear(x, self.head).float()  # (M, V)
        return logits if self.tp is None else self.tp.gather_logits(logits)

    # --- one decode step in one call (phase 6) ------------------------------------------------

    def fused_status(self) -> str | None:
        """None when `fused_decode` can run this model, else why not."""
        from nanoserve.kernels import native, native_status

        if self.device.type != "cpu":
            return f"the fused decode step is a CPU kernel; this model is on {self.device.type}"
        if self.dtype != torch.float32:
            return f"the fused decode step computes in fp32; this model's activations are {self.dtype}"
        if getattr(self.head, "is_mkldnn", False):
            return "the linears are packed for oneDNN, which the fused step cannot read (linear='plain')"
        if native() is None:
            return f"the native kernels are {native_status()}"
        other = sorted({m.kind for m in self.matrices() if isinstance(m, QuantTensor) and not m.native})
        if other:
            kinds = ", ".join(other)
            return f"the fused decode step has no kernel for {kinds} matrices"
        if self.cfg.o_bias:
            return "the fused decode step has no output-projection bias; this model's step runs as ops"
        return None

    def fused_decode(self, plan, cache) -> torch.Tensor:
        """A decode plan (one token a row) run as one native call (csrc/quant.cpp): the same
        computation as `forward` through `cache.view(plan)` with native attention, its glue
        (norms, rotary, K/V writes, SiLU, residuals) in C++ instead of ~70 torch ops a block.
        Logits (B, vocab) fp32, one row per plan row."""
        from nanoserve.kernels import native

        if self._fused is None:
            mats, kinds, parts, part_rows = [], [], [], []

            def add(w):
                pieces = w.parts if isinstance(w, RowStack) else [w]  # a stack as its parts
                parts.append(len(pieces))
                for p in pieces:
                    if isinstance(p, QuantTensor):
                        mats.append(p.blocks), kinds.append(p.code)
                    else:
                        mats.append(p.detach().contiguous()), kinds.append(0)
                    part_rows.append(p.shape[0])

            add(self.embed)
            norms, biases, qk_norms = [], [], []
            for b in self.blocks:
                for name in ("qkv", "o", "gate_up", "down"):
                    add(getattr(b, name))
                norms += [b.input_norm.detach(), b.post_norm.detach()]
                if b.qkv_bias is not None:  # Qwen2's
                    biases.append(b.qkv_bias.detach().contiguous())
                if b.q_norm is not None:  # Qwen3's
                    qk_norms += [b.q_norm.detach().contiguous(), b.k_norm.detach().contiguous()]
            add(self.head)
            norms.append(self.norm.detach())
            int8 = isinstance(self.head, QuantTensor) and self.head.activations == "int8"
            stacked = {}  # only what differs from a Llama's one tensor a matrix: its call stays as it was
            if len(mats) != len(parts):
                stacked.update(parts=parts, part_rows=part_rows)
            if biases:
                stacked["biases"] = biases
            if qk_norms:
                stacked["qk_norms"] = qk_norms
            self._fused = (mats, kinds, norms, int8, stacked)
        mats, kinds, norms, int8, stacked = self._fused
        cache.ensure_pools()
        cfg = self.cfg
        return native().fused_decode(
            plan.input_ids,
            plan.positions,
            plan.write_slots,
            plan.slot_window,
            plan.context_lens,
            mats,
            kinds,
            norms,
            cache.k,
            cache.v,
            self.cos,
            self.sin,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
            self.head.shape[0],
            cfg.rms_norm_eps,
            int8,
            **stacked,
        )

    # --- loading ---------------------------------------------------------------------------

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Copy weights named as in transformers' LlamaForCausalLM, fusing QKV and gate/up."""
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise NanoserveError(f"the weights lack the tensor {name!r} that this Llama config needs")
            used.add(name)
            return sd[name]

        def put(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
            if tuple(dst.shape) != tuple(src.shape):
                raise NanoserveError(
                    f"tensor {name!r} has shape {tuple(src.shape)} but the config implies {tuple(dst.shape)}"
                )
            dst.copy_(src)

        put(self.embed, take("embed_tokens.weight"), "embed_tokens.weight")
        put(self.norm, take("norm.weight"), "norm.weight")
        if not self.cfg.tie_word_embeddings:
            put(self.head, take("lm_head.weight"), "lm_head.weight")
        for i, b in enumerate(self.blocks):
            p = f"layers.{i}."
            put(b.input_norm, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(
                b.post_norm,
                take(p + "post_attention_layernorm.weight"),
                p + "post_attention_layernorm.weight",
            )
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            put(b.qkv, qkv, p + "self_attn.qkv")
            if b.qkv_bias is not None:
                put(
                    b.qkv_bias,
                    torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]),
                    p + "qkv bias",
                )
            put(b.o, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            if b.o_bias is not None:
                put(b.o_bias, take(p + "self_attn.o_proj.bias"), p + "self_attn.o_proj.bias")
            if b.q_norm is not None:
                put(b.q_norm, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
                put(b.k_norm, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            put(b.gate_up, gate_up, p + "mlp.gate_up")
            put(b.down, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
        # A tied checkpoint may still carry lm_head (a copy of the embedding); nothing else may be left.
        extra = sorted(set(sd) - used - {"lm_head.weight"} - {k for k in sd if "rotary_emb" in k})
        if extra:
            raise NanoserveError(f"the weights hold tensors this Llama config does not use: {extra[:5]}")


def model_weight_bytes(model: Llama) -> int:
    """Bytes the model's weights occupy (a tied head counted once), quantized or not."""
    from nanoserve.quant import weight_bytes

    seen, total = set(), 0
    ws = [model.embed, model.head, model.norm]
    for b in model.blocks:
        ws += [b.input_norm, b.post_norm] + [getattr(b, n) for n in ("qkv", "o", "gate_up", "down")]
        ws += [w for w in (b.qkv_bias, b.o_bias, b.q_norm, b.k_norm) if w is not None]
    for w in ws:
        if id(w) not in seen:
            seen.add(id(w))
            total += weight_bytes(w)
    return total


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> Llama:
    """Build a `Llama` from an HF-layout directory (config.json + safetensors)."""
    from nanoserve.weights import check_model_dir, load_state_dict

    model_dir = check_model_dir(model_dir)
    cfg = LlamaConfig.from_dir(model_dir)
    model = Llama(cfg, dtype=dtype, device=device)
    model.load_hf_state_dict(load_state_dict(model_dir, dtype=dtype, device=device))
    return model.eval()

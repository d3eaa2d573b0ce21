"""The Llama family (days 3-7): `LlamaConfig`, the decoder `Block` and `Llama`, which runs the
blocks over a flat batch of tokens. Mistral's checkpoints are this family too, and so are the
families written as a Llama with a change (`qwen.py`: Qwen2's Q/K/V biases, Qwen3's per-head
Q/K norms), which set the config's switches and reuse this forward.

What it deliberately does not hold: any K/V storage. Attention hands its keys and values to a
cache object and asks the same object for the attention output, so a contiguous cache (day 11)
and the paged, batched cache (days 17-24) drop in without the model changing. The protocol is
two methods (`layers.KVCache`):

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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.errors import NanoserveError
from nanoserve.models.layers import KVCache, apply_rope, linear, rms_norm, rope_tables
from nanoserve.models.registry import Family, family, register
from nanoserve.quant import QuantTensor, RowStack, weight_bytes

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
    # a family's switches (`Family.switches`): biases (Qwen2 adds one to Q, K and V, not O; a
    # Llama with attention_bias to all four), and Qwen3's RMSNorm over each head's query and key
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    # sliding-window attention (Gemma 3): the layers in `sliding_layers` attend only to the last
    # `sliding_window` positions (their own included), rotated with `rope_local_theta` when set;
    # the others attend to the whole context. A Llama has none.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float | None = None
    query_scale: float | None = None  # the attention's scale on q.k; None: head_dim ** -0.5
    embed_multiplier: float = 1.0  # the embedding's rows are scaled by this (Gemma: sqrt(hidden))
    family: str = "llama"  # the registry's name for config.json's model_type (`registry.FAMILIES`)

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        """The config of a Hugging Face `config.json`, its family's switches set by the family
        its `model_type` names (`registry.family`; none means llama)."""
        # transformers 5 writes rope settings under `rope_parameters`; older files use
        # `rope_theta` and `rope_scaling`. Read both.
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        heads = d.get("num_attention_heads")
        fam = family(d.get("model_type") or "llama")
        try:
            fields = dict(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_layers=d["num_hidden_layers"],
                num_heads=d["num_attention_heads"],
                num_kv_heads=d.get("num_key_value_heads") or heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                rope_scaling=scaling,
                family=fam.name,
            )
            fields.update(fam.switches(d))  # a family's switches may also replace what is read above
        except KeyError as e:
            raise NanoserveError(
                f"config.json lacks the field {e.args[0]!r} that a {fam.name} model needs"
            ) from None
        return cls(**fields)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> LlamaConfig:
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim**-0.5

    def window(self, layer: int) -> int | None:
        """How many of the latest positions `layer` attends to (its own included), or None: all."""
        return self.sliding_window if layer in self.sliding_layers else None

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(dtype).bits // 8


# --- the model ---------------------------------------------------------------------------------


class Block(nn.Module):
    """One decoder block. Q, K and V share one matrix, and so do the MLP's gate and up
    projections: one matmul instead of three (or two), the same numbers per output element."""

    # (attribute, the weight's name in a Hugging Face checkpoint): what the loaders copy a
    # block's norms from; post_norm is the norm before the MLP, whatever a family calls it
    NORMS = (("input_norm", "input_layernorm"), ("post_norm", "post_attention_layernorm"))

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
    block_class = Block  # a family written as a Llama with other blocks names its own (gemma.py)
    # added to every norm weight read from a Hugging Face checkpoint: Gemma's store w for a gain
    # of 1 + w; a GGUF stores the gain itself (llama.cpp's converter adds the 1)
    hf_norm_shift = 0.0

    def __init__(
        self, cfg: LlamaConfig, dtype: torch.dtype = torch.float32, device="cpu", max_positions=None
    ):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False)
        self.blocks = nn.ModuleList(self.block_class(cfg, i, dtype, device) for i in range(cfg.num_layers))
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
        self.weights = str(dtype).removeprefix("torch.")  # the matrices: the loader sets q4_1, q8_0, gguf
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
            self._fused = self._fused_operands()
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
            **self._fused_step_args(plan, cache, stacked),
        )

    def _fused_step_args(self, plan, cache, extra: dict) -> dict:
        """The step's keyword arguments beyond a Llama's: those `_fused_operands` built once
        (a family may add what each step needs, as Gemma 3's sliding layers do)."""
        return extra

    def _fused_operands(self) -> tuple:
        """The fused step's operand lists, built once: every matrix as its tensors and kinds (a
        stacked one as its parts), the norms, whether activations are int8, and the keyword
        arguments only some families pass (a Llama's call stays as day 61 made it)."""
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
        return mats, kinds, norms, int8, stacked

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

        shift = self.hf_norm_shift

        def put_norm(dst: torch.Tensor, name: str) -> None:
            put(dst, take(name) + shift if shift else take(name), name)

        put(self.embed, take("embed_tokens.weight"), "embed_tokens.weight")
        put_norm(self.norm, "norm.weight")
        if not self.cfg.tie_word_embeddings:
            put(self.head, take("lm_head.weight"), "lm_head.weight")
        for i, b in enumerate(self.blocks):
            p = f"layers.{i}."
            for attr, hf in b.NORMS:
                put_norm(getattr(b, attr), p + hf + ".weight")
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
                put_norm(b.q_norm, p + "self_attn.q_norm.weight")
                put_norm(b.k_norm, p + "self_attn.k_norm.weight")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            put(b.gate_up, gate_up, p + "mlp.gate_up")
            put(b.down, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
        # A tied checkpoint may still carry lm_head (a copy of the embedding); nothing else may be left.
        extra = sorted(set(sd) - used - {"lm_head.weight"} - {k for k in sd if "rotary_emb" in k})
        if extra:
            raise NanoserveError(f"the weights hold tensors this Llama config does not use: {extra[:5]}")


def model_weight_bytes(model: Llama) -> int:
    """Bytes the model's weights occupy (a tied head counted once), quantized or not."""
    seen, total = set(), 0
    ws = [model.embed, model.head, model.norm]
    for b in model.blocks:
        ws += [getattr(b, attr) for attr, _ in b.NORMS] + [
            getattr(b, n) for n in ("qkv", "o", "gate_up", "down")
        ]
        ws += [w for w in (b.qkv_bias, b.o_bias, b.q_norm, b.k_norm) if w is not None]
    for w in ws:
        if id(w) not in seen:
            seen.add(id(w))
            total += weight_bytes(w)
    return total


def _llama_switches(d: dict) -> dict:
    # LlamaAttention's biases follow attention_bias, all four of them (false in Meta's releases)
    bias = bool(d.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


LLAMA = register(Family("llama", "LlamaForCausalLM", Llama, _llama_switches, gguf_rotary_permuted=True))
# Mistral's checkpoints are a Llama's; one whose layers attend to a sliding window narrower than
# its context (Mistral 7B v0.1) is refused by `weights.check_model_dir`
MISTRAL = register(Family("mistral", "MistralForCausalLM", Llama, _llama_switches, gguf_rotary_permuted=True))

"""The Gemma 3 family (phase 6): the Llama forward with six changes, each a switch of the config
or a method here, read from transformers' `Gemma3ForCausalLM` and llama.cpp's `gemma3` graph:

* the embedding's rows are scaled by sqrt(hidden) before the first block (`embed_multiplier`);
* every RMSNorm's gain is 1 + w in a Hugging Face checkpoint (`hf_norm_shift`); a GGUF stores
  the gain itself, llama.cpp's converter having added the 1;
* four norms a block: before attention (input_norm), after it (attn_out_norm, before the
  residual add), before the MLP (post_norm, as in a Llama) and after it (mlp_out_norm);
* an RMSNorm on each head's query and key over head_dim, before the rotation (as Qwen3);
* a gated MLP whose gate goes through GELU's tanh approximation, not SiLU;
* most layers attend only to their latest `sliding_window` positions and rotate with a base of
  10,000; every sixth (layers 5, 11, 17 of 18) attends to the whole context with a base of 1e6.
  The window is the cache's business (`cache.py` reads `cfg.window(layer)`); here a layer only
  picks its rotary tables.

The fused decode step (day 61's one native call) runs a Gemma block with these switches passed
to it: the scale, the two extra norms, GELU, the query scale, and for the sliding layers their
own write slots, window and rotary tables (`_fused_step_args` below).

The head is the embedding (tied): Gemma 3 270M's 262,144 x 640 matrix is 168M of its 268M
parameters. The query scale is query_pre_attn_scalar ** -0.5 (256 for 270M, equal to head_dim).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.errors import NanoserveError
from nanoserve.models.layers import KVCache, apply_rope, linear, rms_norm, rope_tables
from nanoserve.models.llama import Block, Llama
from nanoserve.models.registry import Family, register


class GemmaBlock(Block):
    NORMS = (
        ("input_norm", "input_layernorm"),
        ("attn_out_norm", "post_attention_layernorm"),
        ("post_norm", "pre_feedforward_layernorm"),
        ("mlp_out_norm", "post_feedforward_layernorm"),
    )

    def __init__(self, cfg, layer: int, dtype: torch.dtype, device):
        super().__init__(cfg, layer, dtype, device)
        kw = dict(dtype=dtype, device=device)
        self.attn_out_norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw), requires_grad=False)
        self.mlp_out_norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw), requires_grad=False)
        self.local = cfg.window(layer) is not None  # which rotary tables this layer reads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cfg, n, nh, nkv = self.cfg, x.shape[0], self.cfg.num_heads, self.cfg.num_kv_heads
        eps = cfg.rms_norm_eps
        h = rms_norm(x, self.input_norm, eps)
        qkv = linear(h, self.qkv).view(n, nh + 2 * nkv, cfg.head_dim)
        q = rms_norm(qkv[:, :nh], self.q_norm, eps)
        k = rms_norm(qkv[:, nh : nh + nkv], self.k_norm, eps)
        qk = apply_rope(torch.cat([q, k], dim=1), cos, sin)  # (N, nh + nkv, hd): one rotation
        cache.write(self.layer, qk[:, nh:], qkv[:, nh + nkv :])
        attn = cache.attention(self.layer, qk[:, :nh])  # (N, nh, hd), the window applied there
        out = linear(attn.reshape(n, self.q_size), self.o)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        x = x + rms_norm(out, self.attn_out_norm, eps)
        h = rms_norm(x, self.post_norm, eps)
        gate, up = linear(h, self.gate_up).chunk(2, dim=-1)
        out = linear(F.gelu(gate, approximate="tanh") * up, self.down)
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        return x + rms_norm(out, self.mlp_out_norm, eps)


class Gemma3(Llama):
    block_class = GemmaBlock
    hf_norm_shift = 1.0

    def __init__(self, cfg, dtype: torch.dtype = torch.float32, device="cpu", max_positions=None):
        super().__init__(cfg, dtype=dtype, device=device, max_positions=max_positions)
        local = replace(cfg, rope_theta=cfg.rope_local_theta or cfg.rope_theta, rope_scaling=None)
        cos, sin = rope_tables(local, max_positions or cfg.max_position_embeddings)
        self.register_buffer("cos_local", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin_local", sin.to(device=device, dtype=dtype), persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids, positions, cache: KVCache, logits_at=None) -> torch.Tensor:
        x = self.embed[input_ids] if self.tp is None else self.tp.embed(self.embed, input_ids)
        # transformers scales in the model's dtype: sqrt(640) rounded to it first
        x = x * torch.tensor(self.cfg.embed_multiplier, dtype=x.dtype)
        tables = {
            False: (self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)),
            True: (self.cos_local[positions].unsqueeze(1), self.sin_local[positions].unsqueeze(1)),
        }
        for block in self.blocks:
            x = block(x, *tables[block.local], cache)
        if logits_at is not None:
            x = x[logits_at]
        x = rms_norm(x, self.norm, self.cfg.rms_norm_eps)
        logits = linear(x, self.head).float()
        return logits if self.tp is None else self.tp.gather_logits(logits)

    # --- the fused decode step (csrc/quant.cpp): Llama's walk with Gemma's switches ----------

    def _fused_operands(self) -> tuple:
        mats, kinds, norms, int8, extra = super()._fused_operands()
        out_norms = []
        for b in self.blocks:
            out_norms += [b.attn_out_norm.detach().contiguous(), b.mlp_out_norm.detach().contiguous()]
        extra.update(
            out_norms=out_norms,
            gelu=True,
            embed_scale=self.cfg.embed_multiplier or 1.0,  # rounded to fp32 in C++, as forward does
            attn_scale=self.cfg.attention_scale,
            sliding=[int(b.local) for b in self.blocks],
        )
        return mats, kinds, norms, int8, extra

    def _fused_step_args(self, plan, cache, extra: dict) -> dict:
        """Llama's fused step, plus what the sliding blocks read: the latest `sliding_window`
        slots of each row's window and, where they have blocks of their own, those slots and the
        step's write slots mapped through `local_of`, cut once a step as the ops path cuts them
        (`cache._one_query_rows`)."""
        from nanoserve.cache import _latest

        keep = self.cfg.sliding_window
        if keep is None or not any(extra["sliding"]):
            return extra
        window, lens, slots = plan.slot_window, plan.context_lens, plan.write_slots
        if window.shape[1] > keep:
            window, lens = _latest(window, lens, keep)
        if cache.local_of is not None:
            window, slots = cache._to_local(window), cache._to_local(slots)
        return {**extra, "local": [slots.contiguous(), window, lens, self.cos_local, self.sin_local]}


def _gemma3_switches(d: dict) -> dict:
    """config.json -> the config's switches. transformers 5 writes one rope entry per layer type
    (`rope_parameters`); older files `rope_theta` and `rope_local_base_freq`."""
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(cap) is not None:  # Gemma 2's; Gemma 3 has neither
            raise NanoserveError(
                f"config.json sets {cap} ({d[cap]}), which nanoserve's gemma3 does not apply"
            )
    n = d["num_hidden_layers"]
    pattern = int(d.get("sliding_window_pattern") or 6)
    types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
    ]
    rope = d.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    scaling = full if full.get("rope_type", "default") != "default" else d.get("rope_scaling")
    window = d.get("sliding_window")
    return {
        "qk_norm": True,
        "qkv_bias": bool(d.get("attention_bias", False)),
        "o_bias": bool(d.get("attention_bias", False)),
        "sliding_window": int(window) if window else None,
        "sliding_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window else (),
        "rope_theta": float(full.get("rope_theta", d.get("rope_theta", 1e6))),
        "rope_local_theta": float(local.get("rope_theta", d.get("rope_local_base_freq", 10000.0))),
        "rope_scaling": scaling,
        "query_scale": float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        "embed_multiplier": float(d["hidden_size"]) ** 0.5,
        "tie_word_embeddings": bool(d.get("tie_word_embeddings", True)),
    }


def _gemma3_gguf_config(get) -> dict:
    """What a GGUF's metadata does not say and llama.cpp's gemma3 graph fixes: every sixth layer
    global, the local layers' rotary base 10,000, and q scaled by head_dim ** -0.5 (by
    (hidden / heads) ** -0.5 for the 62-layer 27B, the one whose two differ)."""
    n, hidden, heads = int(get("block_count")), int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(get("attention.sliding_window")),
        "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)],
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": hidden // heads if n == 62 else head_dim,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


GEMMA3 = register(
    Family(
        "gemma3",
        "Gemma3ForCausalLM",
        Gemma3,
        _gemma3_switches,
        sliding_windows=True,
        model_type="gemma3_text",
        gguf_names={
            "ffn_norm": "pre_feedforward_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        gguf_norm_shift=1.0,
        gguf_config=_gemma3_gguf_config,
    )
)

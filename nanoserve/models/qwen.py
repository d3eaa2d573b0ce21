"""The Qwen family, written as a Llama with a change (day 64): the same `Llama` forward, two
switches of its config.

* `qwen2` (Qwen2, Qwen2.5, Qwen2.5-Coder): a bias on the Q, K and V projections, added after
  their matmuls and before the rotation; none on the output projection.
* `qwen3`: no biases (unless `attention_bias` asks for all four, as Llama's), and an RMSNorm over
  each head's query and key, over head_dim, before the rotation.

Both rotate each head's halves (llama.cpp's NEOX rope), so a GGUF keeps Hugging Face's Q/K rows.
"""

from __future__ import annotations

from nanoserve.models.llama import Llama
from nanoserve.models.registry import Family, register


def _qwen2_switches(d: dict) -> dict:
    # transformers' Qwen2Attention: q, k and v biased, o not, whatever attention_bias says
    return {"qkv_bias": True, "o_bias": False}


def _qwen3_switches(d: dict) -> dict:
    # Qwen3Attention's biases follow attention_bias, all four (false in Qwen3's releases)
    bias = bool(d.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


QWEN2 = register(Family("qwen2", "Qwen2ForCausalLM", Llama, _qwen2_switches))
QWEN3 = register(Family("qwen3", "Qwen3ForCausalLM", Llama, _qwen3_switches))

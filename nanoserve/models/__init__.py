"""The model families nanoserve runs, one file a family, and what they share.

    layers.py    linear, RMSNorm, rotary embeddings, the K/V cache protocol (days 3-7, 12)
    llama.py     the Llama forward (and Mistral's checkpoints)
    qwen.py      Qwen2 and Qwen3: a Llama with Q/K/V biases, or with per-head Q/K norms
    gemma.py     Gemma 3: four norms a block, GELU, and sliding-window layers
    registry.py  which family a config.json's model_type or a GGUF's architecture names
    loader.py    a model from a Hugging Face directory or from a GGUF's own blocks

Everything a caller needs is importable from `nanoserve.models`.
"""

from nanoserve.models.gemma import GEMMA3, Gemma3
from nanoserve.models.layers import (
    BF16_UPCAST_ROWS,
    LINEAR,
    KVCache,
    apply_rope,
    linear,
    pack_linears,
    packing_status,
    rms_norm,
    rope_inv_freq,
    rope_tables,
)
from nanoserve.models.llama import LLAMA, MISTRAL, Block, Llama, LlamaConfig, model_weight_bytes
from nanoserve.models.loader import (
    MATRICES,
    describe_weights,
    load_gguf_model,
    load_model,
    load_quantized,
    quantize_model,
    split_model,
    weight_types,
)
from nanoserve.models.qwen import QWEN2, QWEN3
from nanoserve.models.registry import FAMILIES, Family, family

__all__ = [
    "BF16_UPCAST_ROWS",
    "FAMILIES",
    "GEMMA3",
    "LINEAR",
    "LLAMA",
    "MATRICES",
    "MISTRAL",
    "QWEN2",
    "QWEN3",
    "Block",
    "Family",
    "Gemma3",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "apply_rope",
    "describe_weights",
    "family",
    "linear",
    "load_gguf_model",
    "load_model",
    "load_quantized",
    "model_weight_bytes",
    "pack_linears",
    "packing_status",
    "quantize_model",
    "rms_norm",
    "rope_inv_freq",
    "rope_tables",
    "split_model",
    "weight_types",
]

"""Loading a model: a family's module built from a Hugging Face directory or from a GGUF's own
blocks, and the quantized models (phase 6) put together from `quant.py`'s matrices.

The weight formats (`quant.py`, `kquants.py`) know blocks and bytes; this module is where they
meet a model: which GGUF tensor becomes which matrix of which block (`gguf_file.hf_name`),
Q/K rows reordered back for the families whose GGUF rows llama.cpp interleaved, Q/K/V and
gate/up fused. It fetches nothing: the caller names the directory and the file
(`fetch.model_gguf` finds a named model's).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from nanoserve.errors import NanoserveError
from nanoserve.models.llama import Llama, LlamaConfig, model_weight_bytes
from nanoserve.models.registry import family
from nanoserve.quant import BLOCK_BYTES, WEIGHTS, QuantTensor, RowStack, kernel_layout


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> Llama:
    """Build the model of an HF-layout directory (config.json + safetensors), of the family its
    config.json names."""
    from nanoserve.weights import check_model_dir, load_state_dict

    model_dir = check_model_dir(model_dir)
    cfg = LlamaConfig.from_dir(model_dir)
    model = family(cfg.family).model(cfg, dtype=dtype, device=device)
    model.load_hf_state_dict(load_state_dict(model_dir, dtype=dtype, device=device))
    return model.eval()


MATRICES = ("qkv", "o", "gate_up", "down")  # a block's four matrices


def _set(owner, name: str, value) -> None:
    if name in owner._parameters:
        delattr(owner, name)  # a Parameter: replaced by a plain attribute
    setattr(owner, name, value)


def quantize_model(model, weights: str, activations: str = "fp32") -> None:
    """Quantize an fp32 model's matrices in place: "q4_1" puts the block matrices in Q4_1 and the
    embedding (and head) in Q8_0, the mix llama.cpp's Q4_1 files hold; "q8_0" puts all in Q8_0.
    Norms stay fp32."""
    if weights not in ("q4_1", "q8_0"):
        raise ValueError(f"a model is quantized to q4_1 or q8_0, not {weights!r} (gguf is a file's own mix)")
    if getattr(model.head, "is_mkldnn", False):
        raise ValueError("the model's linears are packed for oneDNN; quantize a freshly loaded model")
    for b in model.blocks:
        for name in MATRICES:
            w = getattr(b, name)
            _set(b, name, QuantTensor.quantize(w, weights).with_activations(activations))
    tied = model.head is model.embed
    embed = QuantTensor.quantize(model.embed, "q8_0").with_activations(activations)
    _set(model, "embed", embed)
    _set(
        model,
        "head",
        embed if tied else QuantTensor.quantize(model.head, "q8_0").with_activations(activations),
    )
    model.weights, model._fused = weights, None
    split_model(model)


def split_model(model) -> None:
    """Every QuantTensor of the model in its kernel's layout (`kernel_layout`: split, or tiles for
    int8 activations on an AVX512-VNNI CPU), in place (a tied head stays tied)."""
    for b in model.blocks:
        for name in MATRICES:
            w = getattr(b, name)
            if isinstance(w, QuantTensor):
                _set(b, name, kernel_layout(w))
    tied = model.head is model.embed
    if isinstance(model.embed, QuantTensor):
        _set(model, "embed", kernel_layout(model.embed))
    if tied:
        _set(model, "head", model.embed)
    elif isinstance(model.head, QuantTensor):
        _set(model, "head", kernel_layout(model.head))
    model._fused = None


def load_gguf_model(path, cfg, weights: str, activations: str = "fp32"):
    """A `Llama` whose matrices are the GGUF's own blocks: Q4_1 and Q8_0 tensors kept as the file
    holds them, float tensors (F32, F16, BF16) as fp32. `weights` names the block matrices' kind
    and must be what the file holds; a file whose matrices are in another type is refused."""
    from nanoserve.gguf_file import _open_gguf, gguf_family, hf_name, unpermute_rotary_rows

    if weights not in WEIGHTS:
        raise ValueError(f"weights are one of {', '.join(WEIGHTS)}, not {weights!r}")
    reader = _open_gguf(path)
    fam = gguf_family(reader)
    permuted = fam.gguf_rotary_permuted
    model = family(cfg.family).model(cfg, dtype=torch.float32, device="cpu")
    found: dict[str, object] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # the config already holds the scaling these frequencies come from
        kind = t.tensor_type.name.lower()
        name = hf_name(t.name, fam.gguf_names).removeprefix("model.")
        if kind in BLOCK_BYTES:
            w = QuantTensor.from_gguf(t).with_activations(activations)
        elif kind in ("f32", "f16", "bf16"):
            from gguf.quants import dequantize

            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        else:
            raise NanoserveError(
                f"{Path(path).name} holds {t.name} as {t.tensor_type.name}, a type nanoserve does not "
                "read (it reads Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and float tensors)"
            )
        if permuted and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
            rows = w.shape[0]
            order = unpermute_rotary_rows(torch.arange(rows), heads)
            w = w.permute_rows(order) if isinstance(w, QuantTensor) else w[order]
        found[name] = w

    def take(name: str):
        if name not in found:
            raise NanoserveError(f"{Path(path).name} lacks the tensor {name!r} a Llama of this config needs")
        return found.pop(name)

    def fuse(parts: list, what: str):
        kinds = {p.kind if isinstance(p, QuantTensor) else "f32" for p in parts}
        if kinds == {"f32"}:
            return torch.cat(parts).contiguous()
        if len(kinds) > 1 and (weights != "gguf" or "f32" in kinds):
            raise NanoserveError(
                f"{Path(path).name} stores the parts of {what} in different types {sorted(kinds)} "
                "(--weights gguf serves such a file)"
            )
        # neighbours of one type become one matrix (a Q4_K_M layer's Q and K, both Q5_0): one
        # product, one quantization of x, where a part each would take two
        runs: list[list] = []
        for p in parts:
            if runs and runs[-1][0].kind == p.kind:
                runs[-1].append(p)
            else:
                runs.append([p])
        fused = []
        for run in runs:
            blocks = torch.cat([p.blocks for p in run])
            fused.append(QuantTensor(blocks, run[0].kind, (blocks.shape[0], run[0].shape[1]), activations))
        return fused[0] if len(fused) == 1 else RowStack(fused)

    def check(w, shape, what):
        if tuple(w.shape) != tuple(shape):
            raise NanoserveError(
                f"{what} has shape {tuple(w.shape)} in the file, the config implies {tuple(shape)}"
            )
        return w

    matrix_kinds = set()
    for i, b in enumerate(model.blocks):
        p = f"layers.{i}."
        for attr, hf in b.NORMS:  # a GGUF's norms are gains already (`Llama.hf_norm_shift`)
            getattr(b, attr).copy_(take(p + hf + ".weight"))
        mats = {
            "qkv": fuse([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], p + "qkv"),
            "o": take(p + "self_attn.o_proj.weight"),
            "gate_up": fuse(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], p + "gate_up"
            ),
            "down": take(p + "mlp.down_proj.weight"),
        }
        for name, w in mats.items():
            _set(b, name, check(w, getattr(b, name).shape, p + name))
            matrix_kinds.update(
                w.kinds if isinstance(w, RowStack) else [w.kind if isinstance(w, QuantTensor) else "f32"]
            )
        if b.qkv_bias is not None:
            b.qkv_bias.copy_(
                check(
                    torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]),
                    b.qkv_bias.shape,
                    p + "qkv bias",
                )
            )
        if b.o_bias is not None:
            b.o_bias.copy_(check(take(p + "self_attn.o_proj.bias"), b.o_bias.shape, p + "o bias"))
        if b.q_norm is not None:
            b.q_norm.copy_(check(take(p + "self_attn.q_norm.weight"), b.q_norm.shape, p + "q norm"))
            b.k_norm.copy_(check(take(p + "self_attn.k_norm.weight"), b.k_norm.shape, p + "k norm"))
    model.norm.copy_(take("norm.weight"))
    embed = check(take("embed_tokens.weight"), model.embed.shape, "embed_tokens")
    head = found.pop("lm_head.weight", None)
    _set(model, "embed", embed)
    _set(
        model,
        "head",
        embed if cfg.tie_word_embeddings or head is None else check(head, model.embed.shape, "lm_head"),
    )
    if found:
        raise NanoserveError(
            f"{Path(path).name} holds tensors this Llama config does not use: {sorted(found)[:5]}"
        )
    model.weight_kinds = sorted(matrix_kinds)  # what /health and the boot line name
    if weights != "gguf" and matrix_kinds != {weights}:
        raise NanoserveError(
            f"--weights {weights} asks for {weights} block matrices; {Path(path).name} holds them as "
            f"{', '.join(sorted(matrix_kinds))} (--weights gguf serves them as they are; or pass --model "
            "with the converted directory to quantize its fp32 weights)"
        )
    model.weights, model._fused = weights, None
    split_model(model)
    return model.eval()


def weight_types(model) -> list[str]:
    """The types the model's matrices hold, e.g. ['float32'] or ['q4_k', 'q5_0', 'q6_k', 'q8_0']."""
    kinds = set()
    for m in model.matrices():
        if isinstance(m, RowStack):
            kinds.update(m.kinds)
        elif isinstance(m, QuantTensor):
            kinds.add(m.kind)
        else:
            kinds.add(str(m.dtype).removeprefix("torch."))
    return sorted(kinds)


def describe_weights(model) -> str:
    """'q4_1 (int8 activations), 96.6 MB' / 'q4_1 (int8 activations, tiles), 98.3 MB' /
    'float32, 538.2 MB'."""
    mb = model_weight_bytes(model) / 1e6
    w = getattr(model, "weights", None)
    if w in WEIGHTS:
        first = model.blocks[0].qkv if model.blocks else model.head
        acts = first.activations
        tiles = ", tiles" if first.layout == "tiles" else ""  # the AVX512-VNNI kernel's layout
        if w == "gguf":  # the file's own mix
            w = "gguf " + "+".join(getattr(model, "weight_kinds", []))
        return f"{w} ({acts} activations{tiles}), {mb:.1f} MB"
    return f"{str(model.dtype).removeprefix('torch.')}, {mb:.1f} MB"


def load_quantized(config, model_dir, gguf=None):
    """The model `build_engine` serves when config.weights names a quantized kind: the GGUF's
    own blocks (`gguf`: config.gguf, or the named model's file, which the caller fetched), else
    the directory's fp32 weights quantized at load."""
    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"--weights {config.weights} runs on the CPU kernels (csrc/quant.cpp); on {device} "
            "serve float32 or bfloat16 weights"
        )
    if gguf is None and config.weights == "gguf":
        raise NanoserveError("--weights gguf serves a GGUF file's own matrices; name it with --gguf FILE")
    if gguf is not None:
        if not Path(gguf).is_file():
            raise NanoserveError(f"the GGUF file {gguf} does not exist")
        return load_gguf_model(
            gguf, LlamaConfig.from_dir(model_dir), config.weights, config.quant_activations
        )
    model = load_model(model_dir, dtype=torch.float32)
    quantize_model(model, config.weights, config.quant_activations)
    return model
